/// \file main.cpp
/// kvmem-run: runs a kvmem memory over one captured attention layer (safetensors in, safetensors out).
/// Exit status: 0 on success, 2 for bad options or inputs (the message names the parameter and value),
/// 1 for any other failure.

#include <CLI/CLI.hpp>
#include <Kokkos_Core.hpp>
#include <cstdio>
#include <exception>

#include "evict_command.hpp"
#include "kvm_command.hpp"
#include "ovq_command.hpp"
#include "trellis_command.hpp"

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
    if (kvm_cmd->parsed()) kvmem::tools::run_kvm(kvm);
    if (ovq_cmd->parsed()) kvmem::tools::run_ovq(ovq);
    if (trellis_cmd->parsed()) kvmem::tools::run_trellis(trellis);
    if (evict_cmd->parsed()) kvmem::tools::run_evict(evict);
  } catch (const kvmem::invalid_argument& e) {
    std::fprintf(stderr, "kvmem-run: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvmem-run: failed: %s\n", e.what());
    return 1;
  }
  return 0;
}
