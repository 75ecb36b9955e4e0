#pragma once
/// \file tensors.hpp
/// kvmem-run helpers: named tensors of a safetensors file checked against expected shapes and the run's
/// dtype (TokenDtype), as Kokkos views of the run's storage type; the --dtype flag and the summary's
/// "memory held" line.

#include <CLI/CLI.hpp>
#include <Kokkos_Core.hpp>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <kvmem/dtype.hpp>
#include <kvmem/errors.hpp>
#include <kvmem/io/safetensors.hpp>

namespace kvmem::tools {

/// Shape of `name` as a string, e.g. "[2, 4, 100, 64]".
inline std::string shape_string(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

/// Whether `dtype` is a floating-point safetensors dtype kvmem-run reads: F32, F64, BF16 or F16.
inline bool is_float_dtype(const std::string& dtype) {
  return dtype == "F32" || dtype == "F64" || dtype == "BF16" || dtype == "F16";
}

/// The tensor `name` of `file`, required to be a float tensor (F32, F64, BF16 or F16) of rank `rank`.
/// Throws kvmem::invalid_argument naming the tensor for a missing tensor, another dtype or another rank.
/// `name` and `layout` are C strings: a std::string temporary argument would make every `const auto& t =
/// float_tensor(...)` look like a dangling reference to g++ (-Wdangling-reference).
inline const io::Tensor& float_tensor(const io::SafetensorsFile& file, const char* name, std::size_t rank,
                                      const char* layout) {
  const auto& t = file.at(name);
  require(is_float_dtype(t.dtype), "tensor '" + std::string(name) + "' dtype", t.dtype,
          "unsupported; float tensors must be F32, F64, BF16 or F16");
  require(t.shape.size() == rank, "tensor '" + std::string(name) + "' shape", shape_string(t.shape),
          "must have rank " + std::to_string(rank) + " " + std::string(layout));
  return t;
}

/// The safetensors dtype name `name` of a storage type ("F32", "BF16", "F16") as --dtype spells it: "f32",
/// "bf16", "f16".
inline std::string dtype_flag(std::string_view name) { return name == "F32" ? "f32" : name == "BF16" ? "bf16" : "f16"; }

/// The storage type of a run's tokens (q, k, v, gates, y), as a safetensors dtype name: "F32", "BF16" or
/// "F16". It is q's dtype (F64 runs as F32) unless --dtype names one: then every token tensor is converted
/// to it, rounded once to nearest even. Without --dtype nothing is converted to a narrower type.
struct TokenDtype {
  std::string name;        ///< "F32", "BF16" or "F16" (kvmem::dtype_name of the memory's storage type)
  std::string q_dtype;     ///< dtype of tensor 'q' in the input file
  bool converted = false;  ///< --dtype was given: token tensors of any float dtype are converted to `name`

  /// The run's dtype for the input file `f` and the --dtype flag `flag` ("" when absent, else f32, bf16 or
  /// f16). Throws kvmem::invalid_argument naming tensor 'q' when it is missing or not F32, F64, BF16, F16.
  static TokenDtype of(const io::SafetensorsFile& f, const std::string& flag) {
    TokenDtype d;
    d.q_dtype = f.at("q").dtype;
    require(is_float_dtype(d.q_dtype), "tensor 'q' dtype", d.q_dtype,
            "unsupported; token tensors must be F32, F64, BF16 or F16");
    d.converted = !flag.empty();
    if (flag == "f32") d.name = "F32";
    else if (flag == "bf16") d.name = "BF16";
    else if (flag == "f16") d.name = "F16";
    else if (flag.empty()) d.name = run_dtype(d.q_dtype);
    else throw invalid_argument("--dtype = " + flag + ": unknown dtype (use f32, bf16 or f16)");
    return d;
  }

  /// The dtype a float tensor of dtype `dtype` runs in without --dtype: F64 runs as F32, as it always has.
  static std::string run_dtype(const std::string& dtype) { return dtype == "F64" ? "F32" : dtype; }

  /// The run's dtype as --dtype spells it: "f32", "bf16" or "f16".
  [[nodiscard]] std::string flag() const { return dtype_flag(name); }

  /// How the tokens were read, for the summary: "" when q is already of the run's dtype, else e.g.
  /// "  (F32 tokens converted to bf16 by --dtype)" or "  (F64 tokens read as f32)".
  [[nodiscard]] std::string conversion() const {
    if (q_dtype == name) return "";
    return "  (" + q_dtype + " tokens " + (converted ? "converted to " + flag() + " by --dtype)" : "read as " + flag() + ")");
  }
};

/// A command's instantiation for one storage type: run_kvm<float>, run_evict<bfloat16>, ...
template <class Options>
using Command = void (*)(const Options&, const io::SafetensorsFile&, const TokenDtype&);

/// Reads o.input and runs the command's instantiation for the run's dtype (q's, or --dtype's: TokenDtype):
/// `f32`, `bf16` or `f16`. Throws kvmem::invalid_argument for a missing or unreadable file, an unsupported
/// dtype of q, or any bad option or tensor the command finds.
template <class Options>
void run_command(const Options& o, Command<std::type_identity_t<Options>> f32,
                 Command<std::type_identity_t<Options>> bf16, Command<std::type_identity_t<Options>> f16) {
  const auto file = io::SafetensorsFile::read(o.input);
  const auto dtype = TokenDtype::of(file, o.dtype);
  const auto command = dtype.name == dtype_name<float> ? f32 : dtype.name == dtype_name<bfloat16> ? bf16 : f16;
  command(o, file, dtype);
}

/// The token tensor `name` of `file` (q, k, v, gate, alpha, betas, gammas): a float tensor of rank `rank`
/// (float_tensor) whose dtype is the run's: q's dtype (F32 and F64 count as one: both run as F32) unless
/// --dtype converts every token tensor. Throws kvmem::invalid_argument naming the tensor, its dtype and q's.
inline const io::Tensor& token_tensor(const io::SafetensorsFile& file, const char* name, std::size_t rank,
                                      const char* layout, const TokenDtype& dtype) {
  const auto& t = float_tensor(file, name, rank, layout);
  require(dtype.converted || TokenDtype::run_dtype(t.dtype) == dtype.name, "tensor '" + std::string(name) + "' dtype",
          t.dtype,
          "differs from tensor 'q' dtype = " + dtype.q_dtype +
              ": every token tensor must have q's dtype (the run's); --dtype f32|bf16|f16 converts them all");
  return t;
}

/// Requires dimension `axis` of tensor `name` to equal `want` (described as `what`).
inline void expect_dim(const io::Tensor& t, const std::string& name, std::size_t axis, std::int64_t want,
                       const std::string& what) {
  require(t.shape[axis] == want, "tensor '" + name + "' shape", shape_string(t.shape),
          "dimension " + std::to_string(axis) + " must equal " + what + " = " + std::to_string(want));
}

/// Requires one token's worth of the token tensor `name` (its size with dimension `token_axis` taken as 1)
/// to fit in the file it came from, and every other dimension to fit an int. With T >= 1 this always
/// holds; with T = 0 the tensor holds no data, yet its batch, head and channel dimensions still size the
/// memory (B x Hkv x (window + chunk) x (D + Dv)) and the outputs (state_rows [B, Hkv]), so without it a
/// 300-byte file could make kvmem-run allocate any amount. (Found by fuzzing; docs/reliability.md.)
inline void require_token_fits(const io::SafetensorsFile& f, const io::Tensor& t, const std::string& name,
                               std::size_t token_axis) {
  if (f.file_bytes == 0) return;  // built in memory: its sizes are the caller's
  std::uint64_t bytes = io::dtype_size(t.dtype);
  for (std::size_t i = 0; i < t.shape.size(); ++i) {
    if (i == token_axis) continue;
    const auto dim = static_cast<std::uint64_t>(t.shape[i]);
    require(dim <= 2147483647u, "tensor '" + name + "' shape", shape_string(t.shape),
            "dimension " + std::to_string(i) + " must be below 2^31");
    require(dim == 0 || bytes <= f.file_bytes / dim, "tensor '" + name + "' shape", shape_string(t.shape),
            "a single token of it would need more bytes than the whole file (" + std::to_string(f.file_bytes) +
                "); its batch, head or channel dimensions are too large");
    bytes *= dim;
  }
}

/// The optional `lengths` [B] tensor (I64 or I32, each in [0, T]) of a ragged batch; all T without it.
/// Throws kvmem::invalid_argument naming the tensor or the offending entry.
inline std::vector<long> load_lengths(const io::SafetensorsFile& f, long B, long T) {
  std::vector<long> lengths(B, T);
  if (!f.has("lengths")) return lengths;
  const auto& l = f.at("lengths");
  require(l.dtype == "I64" || l.dtype == "I32", "tensor 'lengths' dtype", l.dtype, "must be I64 (or I32)");
  require(l.shape.size() == 1 && l.shape[0] == B, "tensor 'lengths' shape", shape_string(l.shape),
          "must be [B] with B = " + std::to_string(B));
  const auto vals = io::to_double(l, "lengths");
  for (long b = 0; b < B; ++b) {
    require(vals[b] >= 0 && vals[b] <= static_cast<double>(T), "lengths[" + std::to_string(b) + "]", vals[b],
            "must be in [0, T = " + std::to_string(T) + "]");
    lengths[b] = static_cast<long>(vals[b]);
  }
  return lengths;
}

/// Storage*, Storage**, ... for rank R.
template <int R, class Storage> struct rank_type { using type = typename rank_type<R - 1, Storage>::type*; };
template <class Storage> struct rank_type<0, Storage> { using type = Storage; };

/// `d` rounded to float32 to odd (of the two floats around d, the one with an odd last bit; d itself when it
/// is a float, NaN and +-Inf as they are). Rounding this to a 16-bit type to nearest even then gives the
/// correctly rounded d: float32 keeps more than two bits beyond bfloat16's and float16's mantissas
/// (Boldo and Melquiond, "Emulation of FMA and correctly rounded sums: proved algorithms using rounding to
/// odd", IEEE Trans. Computers 57(4), 2008); rounding to nearest twice could round a tie the wrong way.
inline float round_to_odd_float(double d) {
  float f = static_cast<float>(d);
  if (static_cast<double>(f) != d && std::isfinite(f) && (std::bit_cast<std::uint32_t>(f) & 1u) == 0)
    f = std::nextafter(f, d > static_cast<double>(f) ? std::numeric_limits<float>::infinity()
                                                     : -std::numeric_limits<float>::infinity());
  return f;
}

/// The elements of the float tensor `t` (float_tensor) as Storage, row-major. A tensor of Storage's own
/// dtype is copied bit for bit (BF16 stays BF16, never through float); F32 and F64 become float as they
/// always have (F64 rounded to nearest); any other conversion (an explicit --dtype) rounds once to nearest
/// even (kvmem::from_float of round_to_odd_float). Throws kvmem::invalid_argument naming `name` for a
/// dtype to_double does not read.
template <StorageType Storage>
std::vector<Storage> stored_values(const io::Tensor& t, const std::string& name) {
  std::vector<Storage> out(static_cast<std::size_t>(t.numel()));
  if (t.dtype == dtype_name<Storage>) {
    if (!out.empty()) std::memcpy(out.data(), t.bytes.data(), t.bytes.size());
    return out;
  }
  const auto values = io::to_double(t, name);
  for (std::size_t i = 0; i < out.size(); ++i) {
    if constexpr (std::same_as<Storage, float>) out[i] = static_cast<float>(values[i]);
    else out[i] = from_float<Storage>(round_to_odd_float(values[i]));
  }
  return out;
}

/// Copies the float tensor `t` into a new LayoutRight device view of Storage of rank R (1, 3 or 4) with the
/// tensor's shape, labelled `name`, converting as stored_values does.
template <int R, class MemorySpace, StorageType Storage = float>
auto to_view(const io::Tensor& t, const std::string& name) {
  auto f = stored_values<Storage>(t, name);
  using data_t = typename rank_type<R, Storage>::type;
  using device_t = Kokkos::View<data_t, Kokkos::LayoutRight, MemorySpace>;
  using host_t = Kokkos::View<data_t, Kokkos::LayoutRight, Kokkos::HostSpace, Kokkos::MemoryUnmanaged>;
  auto make = [&](auto&&... lead) {
    auto ext = [&](int i) { return static_cast<std::size_t>(t.shape[i]); };
    if constexpr (R == 1) return std::make_pair(device_t(lead..., ext(0)), host_t(f.data(), ext(0)));
    else if constexpr (R == 3) return std::make_pair(device_t(lead..., ext(0), ext(1), ext(2)), host_t(f.data(), ext(0), ext(1), ext(2)));
    else return std::make_pair(device_t(lead..., ext(0), ext(1), ext(2), ext(3)), host_t(f.data(), ext(0), ext(1), ext(2), ext(3)));
  };
  auto [view, host] = make(Kokkos::view_alloc(Kokkos::WithoutInitializing, name));
  Kokkos::deep_copy(view, host);
  return view;
}

/// Prints the summary's "memory held" line: `held` bytes (`what` they are, e.g. "state rows float32 +
/// window bf16") against a full KV cache of the same dtype, `tokens` x `kv_heads` x `channels` (D + Dv) x
/// sizeof(Storage) bytes, and their ratio.
template <StorageType Storage>
void print_memory_held(long held, const std::string& what, long tokens, long kv_heads, long channels) {
  const long full = tokens * kv_heads * channels * static_cast<long>(sizeof(Storage));
  std::printf("  memory held   %.3f MiB (%s) vs full KV cache %.3f MiB (%s): %.1f%%\n", held / 1048576.0, what.c_str(),
              full / 1048576.0, dtype_flag(dtype_name<Storage>).c_str(), full ? 100.0 * held / full : 0.0);
}

/// Registers `--dtype f32|bf16|f16` on `cmd` (default: q's dtype; see TokenDtype).
inline void add_dtype_option(CLI::App* cmd, std::string& dtype) {
  cmd->add_option("--dtype", dtype,
                  "dtype of the tokens (q, k, v, gates) and of y: f32, bf16 or f16; converts every token tensor "
                  "(default: q's dtype, F64 as f32; token tensors must then all have it)")
      ->check(CLI::IsMember({"f32", "bf16", "f16"}));
}

}  // namespace kvmem::tools
