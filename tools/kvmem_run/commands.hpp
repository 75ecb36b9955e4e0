#pragma once
/// \file commands.hpp
/// The four subcommands of kvmem-run and their explicit instantiations, one storage type per translation
/// unit: run_f32.cpp, run_bf16.cpp and run_f16.cpp each instantiate every command for their storage type
/// (KVMEM_RUN_COMMANDS), and main.cpp, which includes this header, only declares them (extern template).
/// A build with two or more cores compiles the three in parallel; one translation unit with all of them
/// would take three times as long as kvmem-run did with float32 alone.

#include <string>

#include <kvmem/dtype.hpp>
#include <kvmem/errors.hpp>
#include <kvmem/io/safetensors.hpp>

#include "evict_command.hpp"
#include "kvm_command.hpp"
#include "ovq_command.hpp"
#include "tensors.hpp"
#include "trellis_command.hpp"

/// Explicit instantiations (`prefix` empty) or their declarations (`prefix` extern) of every command for the
/// storage type `Storage`; used inside namespace kvmem::tools.
#define KVMEM_RUN_COMMANDS(prefix, Storage)                                                                    \
  prefix template void run_kvm<Storage>(const KvmOptions&, const io::SafetensorsFile&, const TokenDtype&);     \
  prefix template void run_ovq<Storage>(const OvqOptions&, const io::SafetensorsFile&, const TokenDtype&);     \
  prefix template void run_trellis<Storage>(const TrellisOptions&, const io::SafetensorsFile&, const TokenDtype&); \
  prefix template void run_evict<Storage>(const EvictOptions&, const io::SafetensorsFile&, const TokenDtype&);

namespace kvmem::tools {

KVMEM_RUN_COMMANDS(extern, float)
KVMEM_RUN_COMMANDS(extern, bfloat16)
KVMEM_RUN_COMMANDS(extern, float16)

}  // namespace kvmem::tools
