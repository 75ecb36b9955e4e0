/// \file main.cpp
/// kvmem-run: runs a kvmem memory over one captured attention layer (safetensors in, safetensors out).
/// Exit status: 0 on success, 2 for bad options or inputs (the message names the parameter and value),
/// 1 for any other failure. Tokens run in the input's dtype (F32, BF16 or F16; --dtype converts): the
/// commands for each storage type are compiled in their own translation unit (commands.hpp).

#include <CLI/CLI.hpp>
#include <Kokkos_Core.hpp>
#include <cstdio>
#include <exception>

#include "commands.hpp"

int main(int argc, char** argv) {
  CLI::App app{"kvmem-run: run a kvmem attention memory over a captured layer"};
  app.require_subcommand(1);
  kvmem::tools::KvmOptions kvm;
  auto* kvm_cmd = kvmem::tools::add_kvm_command(app, kvm);
  kvmem::tools::OvqOptions ovq;
  auto* ovq_cmd = kvmem::tools::add_ovq_command(app, ovq);
  kvmem::tools::TrellisOptions trellis;
  auto* trellis_cmd = kvmem::tools::add_trellis_command(app, trellis);
  kvmem::tools::EvictOptions evict;
  auto* evict_cmd = kvmem::tools::add_evict_command(app, evict);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  Kokkos::ScopeGuard guard;
  try {
    using namespace kvmem;
    using namespace kvmem::tools;
    if (kvm_cmd->parsed()) run_command(kvm, run_kvm<float>, run_kvm<bfloat16>, run_kvm<float16>);
    if (ovq_cmd->parsed()) run_command(ovq, run_ovq<float>, run_ovq<bfloat16>, run_ovq<float16>);
    if (trellis_cmd->parsed()) run_command(trellis, run_trellis<float>, run_trellis<bfloat16>, run_trellis<float16>);
    if (evict_cmd->parsed()) run_command(evict, run_evict<float>, run_evict<bfloat16>, run_evict<float16>);
  } catch (const kvmem::invalid_argument& e) {
    std::fprintf(stderr, "kvmem-run: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvmem-run: failed: %s\n", e.what());
    return 1;
  }
  return 0;
}
