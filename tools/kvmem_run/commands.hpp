#pragma once
/// \file commands.hpp
/// The four subcommands of kvmem-run and their explicit instantiations, which every includer sees declared
/// (extern template) and six translation units define, so that two or more cores compile them in parallel:
///  - run_kvm_f32.cpp, run_kvm_bf16.cpp, run_kvm_f16.cpp: `kvm` for one storage type each; they form the
///    library kvmem_run_kvm (run_kvm.cmake), which kvmem-run and the kvm_input fuzz target both link, so
///    a build compiles them once;
///  - run_f32.cpp, run_bf16.cpp, run_f16.cpp: `ovq`, `trellis` and `evict` for one storage type each.

#include <string>

#include <kvmem/dtype.hpp>
#include <kvmem/errors.hpp>
#include <kvmem/io/safetensors.hpp>

#include "evict_command.hpp"
#include "kvm_command.hpp"
#include "ovq_command.hpp"
#include "tensors.hpp"
#include "trellis_command.hpp"

/// Explicit instantiation (`prefix` empty) or its declaration (`prefix` extern) of the command function
/// `command` (options type `Options`) for the storage type `Storage`; used inside namespace kvmem::tools.
#define KVMEM_RUN_COMMAND(prefix, command, Options, Storage) \
  prefix template void command<Storage>(const Options&, const io::SafetensorsFile&, const TokenDtype&);

/// The same for every storage type of the tokens (float, bfloat16, float16).
#define KVMEM_RUN_COMMAND_EVERY_STORAGE(prefix, command, Options) \
  KVMEM_RUN_COMMAND(prefix, command, Options, float)              \
  KVMEM_RUN_COMMAND(prefix, command, Options, bfloat16)           \
  KVMEM_RUN_COMMAND(prefix, command, Options, float16)

namespace kvmem::tools {

KVMEM_RUN_COMMAND_EVERY_STORAGE(extern, run_kvm, KvmOptions)
KVMEM_RUN_COMMAND_EVERY_STORAGE(extern, run_ovq, OvqOptions)
KVMEM_RUN_COMMAND_EVERY_STORAGE(extern, run_trellis, TrellisOptions)
KVMEM_RUN_COMMAND_EVERY_STORAGE(extern, run_evict, EvictOptions)

}  // namespace kvmem::tools
