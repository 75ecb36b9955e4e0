// libFuzzer target: kvmem::io::SafetensorsFile::parse on arbitrary bytes (docs/reliability.md).
//
// Every input must either be rejected with kvmem::invalid_argument naming the file, or be accepted as a
// file whose tensors are consistent: known dtype, non-negative shape, exactly numel * dtype size bytes,
// all of them inside the input, convertible by to_double where the dtype is numeric; and the writer's
// bytes for an accepted file must parse back to the same tensors and metadata. Anything else (another
// exception, a sanitizer report, an allocation over -malloc_limit_mb) is a finding.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include <kvmem/io/safetensors.hpp>

namespace {
[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "fuzz_safetensors: invariant broken: %s\n", what.c_str());
  std::abort();
}
void check(bool ok, const std::string& what) {
  if (!ok) fail(what);
}
const char* const kName = "fuzz.safetensors";
}  // namespace

#ifdef KVMEM_LIBFUZZER
#include "safetensors_mutator.hpp"
// Structure-aware edits of files that parse (safetensors_mutator.hpp), byte mutations otherwise.
extern "C" std::size_t LLVMFuzzerCustomMutator(std::uint8_t* data, std::size_t size, std::size_t max_size, unsigned seed) {
  static const std::vector<std::string> keys = {"source", "n", "", "__metadata__"};
  return kvmem_fuzz::mutate_safetensors(data, size, max_size, seed, keys);
}
#endif

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using kvmem::io::SafetensorsFile;
  const std::vector<unsigned char> bytes(data, data + size);
  SafetensorsFile file;
  try {
    file = SafetensorsFile::parse(bytes, kName);
  } catch (const kvmem::invalid_argument& e) {
    check(std::string_view(e.what()).find(kName) != std::string_view::npos,
          std::string("error does not name the file: ") + e.what());
    return 0;
  }
  std::uint64_t total = 0;
  for (const auto& [name, t] : file.tensors) {
    const std::size_t es = kvmem::io::dtype_size(t.dtype);
    check(es != 0, "accepted unknown dtype " + t.dtype);
    std::uint64_t n = 1;
    for (const auto d : t.shape) {
      check(d >= 0, "negative dimension in tensor '" + name + "'");
      check(!__builtin_mul_overflow(n, static_cast<std::uint64_t>(d), &n), "element count overflows in '" + name + "'");
    }
    check(n == static_cast<std::uint64_t>(t.numel()), "numel() disagrees with the shape of '" + name + "'");
    std::uint64_t nbytes = 0;
    check(!__builtin_mul_overflow(n, es, &nbytes) && nbytes == t.bytes.size(), "byte count of '" + name + "'");
    total += t.bytes.size();
    const bool numeric = t.dtype == "F32" || t.dtype == "F64" || t.dtype == "BF16" || t.dtype == "F16" ||
                         t.dtype == "I64" || t.dtype == "I32";
    try {
      const auto values = kvmem::io::to_double(t, name);
      check(numeric && values.size() == n, "to_double of '" + name + "'");
    } catch (const kvmem::invalid_argument&) {
      check(!numeric, "to_double rejected numeric tensor '" + name + "'");
    }
  }
  check(total <= size, "tensors hold more bytes than the input");

  // The writer's bytes parse back to the same file.
  const auto again = SafetensorsFile::parse(file.serialize(), "round trip");
  check(again.metadata == file.metadata, "metadata changed in a round trip");
  check(again.tensors.size() == file.tensors.size(), "tensor count changed in a round trip");
  for (const auto& [name, t] : file.tensors) {
    const auto& u = again.at(name);
    check(u.dtype == t.dtype && u.shape == t.shape && u.bytes == t.bytes, "tensor '" + name + "' changed in a round trip");
  }
  return 0;
}
