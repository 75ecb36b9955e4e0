// libFuzzer target: the whole `kvmem-run kvm` input path on one file (docs/reliability.md) — the
// safetensors header, dtypes, shapes, offsets, tensor names and lengths (SafetensorsFile::read,
// KvmInputs::load), the memory config and budget built from them, and a small KVM run over whatever is
// accepted (kvmem::tools::run_command with run_kvm, as kvmem-run's main calls it), written to /dev/null.
//
// Flags come from the file's "__metadata__" (keys named like the flags: "mode", "budget", "chunk",
// "window_chunks", "rope_dims", "sinks", "min_rows", "growth_factor", "growth_exponent", "round_down",
// "saturation_n", "plateau_n", "max_chunks"), so the fuzzer explores them too. The libFuzzer build adds a
// structure-aware mutator (safetensors_mutator.hpp) that edits shapes, dtypes, tensors, values and flags
// of files that parse. Only the two that size allocations
// independently of the file, chunk and window_chunks, are kept small ([-1, 16] and [-1, 4]); every other
// value goes through as written, as it would from the command line.
//
// Bad input must end in kvmem::invalid_argument (kvmem-run's exit status 2 with a message); any other
// exception, a sanitizer report, or an allocation over -malloc_limit_mb is a finding. Kokkos runs on one
// thread: the clang build of this target sees Kokkos' OpenMP backend without OpenMP code generation (see
// scripts/fuzz), which is only correct with a one-thread pool.
#include <unistd.h>

#include <Kokkos_Core.hpp>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "kvmem_run/commands.hpp"  // run_kvm, compiled in the library kvmem_run_kvm

namespace {
std::string g_input;  // the input is handed to run_kvm as a file, as kvmem-run gets it

void setup() {
  static const bool done = [] {
    Kokkos::initialize(Kokkos::InitializationSettings().set_num_threads(1).set_disable_warnings(true));
    std::atexit([] { Kokkos::finalize(); });
    char path[] = "/tmp/kvmem_fuzz_kvm_input_XXXXXX";
    const int fd = mkstemp(path);
    if (fd < 0) {
      std::perror("mkstemp");
      std::abort();
    }
    close(fd);
    g_input = path;
    std::atexit([] { std::remove(g_input.c_str()); });
    if (!std::freopen("/dev/null", "w", stdout)) std::abort();  // run_kvm prints a summary per run
    return true;
  }();
  (void)done;
}

template <class T>
void take_int(const std::map<std::string, std::string>& md, const char* key, T& out, T lo, T hi) {
  const auto it = md.find(key);
  if (it == md.end()) return;
  T value{};
  const auto& s = it->second;
  const auto r = std::from_chars(s.data(), s.data() + s.size(), value);
  if (r.ec == std::errc() && value >= lo && value <= hi) out = value;
}
void take_double(const std::map<std::string, std::string>& md, const char* key, double& out) {
  const auto it = md.find(key);
  if (it == md.end()) return;
  char* end = nullptr;
  const double value = std::strtod(it->second.c_str(), &end);
  if (end != it->second.c_str()) out = value;
}

/// The flags a file's metadata may set (also the keys the structure-aware mutator edits).
const std::vector<std::string> kFlags = {"mode",     "budget",          "chunk",      "window_chunks", "rope_dims",
                                         "sinks",    "min_rows",        "round_down", "max_chunks",    "growth_factor",
                                         "growth_exponent", "saturation_n", "plateau_n"};

kvmem::tools::KvmOptions options_from(const std::map<std::string, std::string>& md) {
  kvmem::tools::KvmOptions o;
  o.chunk = 4;
  o.window_chunks = 2;
  o.rope_dims = 0;
  o.sinks = 1;
  auto& b = o.budget;
  if (const auto it = md.find("mode"); it != md.end()) o.mode = it->second;
  if (const auto it = md.find("budget"); it != md.end()) b.kind = it->second;
  take_int(md, "chunk", o.chunk, -1, 16);
  take_int(md, "window_chunks", o.window_chunks, -1, 4);
  constexpr long lmin = std::numeric_limits<long>::min(), lmax = std::numeric_limits<long>::max();
  constexpr int imin = std::numeric_limits<int>::min(), imax = std::numeric_limits<int>::max();
  take_int(md, "rope_dims", o.rope_dims, imin, imax);
  take_int(md, "sinks", o.sinks, imin, imax);
  take_int(md, "max_chunks", o.max_chunks, lmin, lmax);
  take_int(md, "min_rows", b.min_rows, lmin, lmax);
  take_int(md, "round_down", b.round_down, lmin, lmax);
  take_double(md, "growth_factor", b.growth_factor);
  take_double(md, "growth_exponent", b.growth_exponent);
  take_double(md, "saturation_n", b.saturation_n);
  take_double(md, "plateau_n", b.plateau_n);
  return o;
}
}  // namespace

#ifdef KVMEM_LIBFUZZER
#include "safetensors_mutator.hpp"
extern "C" std::size_t LLVMFuzzerCustomMutator(std::uint8_t* data, std::size_t size, std::size_t max_size, unsigned seed) {
  return kvmem_fuzz::mutate_safetensors(data, size, max_size, seed, kFlags);
}
#endif

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  setup();
  std::map<std::string, std::string> metadata;
  try {
    metadata = kvmem::io::SafetensorsFile::parse(std::vector<unsigned char>(data, data + size), "fuzz").metadata;
  } catch (const kvmem::invalid_argument&) {
    // run_kvm rejects the file below with the same error
  }
  FILE* f = std::fopen(g_input.c_str(), "wb");
  if (!f || std::fwrite(data, 1, size, f) != size || std::fclose(f) != 0) {
    std::perror(g_input.c_str());
    std::abort();
  }
  auto o = options_from(metadata);
  o.input = g_input;
  o.output = "/dev/null";
  try {
    using kvmem::tools::run_kvm;  // in every storage type: the file picks it (BF16 and F16 inputs included)
    kvmem::tools::run_command(o, run_kvm<float>, run_kvm<kvmem::bfloat16>, run_kvm<kvmem::float16>);
  } catch (const kvmem::invalid_argument& e) {
    if (*e.what() == '\0') std::abort();  // kvmem-run prints the message; it must say something
  }
  return 0;
}
