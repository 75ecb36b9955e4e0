#pragma once
// Structure-aware libFuzzer mutations of safetensors files (docs/reliability.md).
//
// Byte-level mutations almost never turn a valid file into another valid one with a different shape (the
// shape, the data_offsets of every later tensor and the data must all change together), so alone they
// hardly reach what a file's *meaning* can do to kvmem-run: T = 0 with a huge batch, a dtype swap, a
// missing tensor, a NaN in the data, a flag at its limit. mutate_safetensors() parses the input and, when
// it parses, edits it as a file — one named dimension across every tensor that has it (or one set to 0 and
// another made huge: empty tensors whose shapes still ask for memory), a dtype, a tensor's presence or
// name, the data values, a metadata entry — and writes it back with consistent offsets; a
// quarter of the time, or when the input does not parse, it leaves the bytes to libFuzzer's own mutators.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <kvmem/io/safetensors.hpp>

extern "C" std::size_t LLVMFuzzerMutate(std::uint8_t* data, std::size_t size, std::size_t max_size);

namespace kvmem_fuzz {

/// Which named dimension each axis of a tensor is (kvmem-run's tensor contract); other tensors get none.
inline const std::map<std::string, std::vector<char>>& axes() {
  // B batch, H query heads, K kv-heads, T tokens, D key channels, V value channels
  static const std::map<std::string, std::vector<char>> a = {
      {"q", {'B', 'H', 'T', 'D'}},  {"k", {'B', 'K', 'T', 'D'}}, {"v", {'B', 'K', 'T', 'V'}},
      {"gate", {'B', 'K', 'T'}},    {"ln_weight", {'D'}},        {"ln_bias", {'D'}},
      {"tau_state", {'H'}},         {"tau_bswa", {'H'}},         {"lengths", {'B'}}};
  return a;
}

/// Largest data a structural mutation writes, bytes; a bigger shape keeps its old data (an invalid file).
inline constexpr std::uint64_t kMaxData = 1u << 16;

inline std::int64_t interesting_dim(std::minstd_rand& rng, std::int64_t old) {
  static const std::int64_t values[] = {0, 1, 2, 3, 4, 7, 8, 16, 255, 256, 65536, 2147483647, 2147483648LL,
                                        1LL << 40, 1LL << 62, std::numeric_limits<std::int64_t>::max()};
  constexpr std::int64_t top = std::numeric_limits<std::int64_t>::max();
  switch (rng() % 4) {
    case 0: return old > top - 2 ? top : std::max<std::int64_t>(0, old + static_cast<std::int64_t>(rng() % 5) - 2);
    case 1: return old > top / 2 ? top : old * 2;
    default: return values[rng() % (sizeof(values) / sizeof(values[0]))];
  }
}

/// Resizes t.bytes to what its dtype and shape need (when at most kMaxData), filling new bytes with values.
inline void fit_data(kvmem::io::Tensor& t, std::minstd_rand& rng) {
  const std::uint64_t es = kvmem::io::dtype_size(t.dtype);
  std::uint64_t n = es;
  for (auto d : t.shape)
    if (d < 0 || __builtin_mul_overflow(n, static_cast<std::uint64_t>(d), &n)) return;
  if (es == 0 || n > kMaxData) return;
  const std::size_t old = t.bytes.size();
  t.bytes.resize(n);
  for (std::size_t i = old; i + es <= n; i += es) {
    if (t.dtype == "F32") {
      const float x = static_cast<float>(static_cast<int>(rng() % 2001) - 1000) / 500.0f;
      std::memcpy(&t.bytes[i], &x, 4);
    } else if (t.dtype == "F64") {
      const double x = static_cast<double>(static_cast<int>(rng() % 2001) - 1000) / 500.0;
      std::memcpy(&t.bytes[i], &x, 8);
    } else {
      for (std::size_t b = 0; b < es; ++b) t.bytes[i + b] = static_cast<unsigned char>(b == 0 ? rng() % 40 : 0);
    }
  }
}

/// Sets element i of a numeric tensor to x (converted to its dtype).
inline void set_element(kvmem::io::Tensor& t, std::size_t i, double x) {
  const std::size_t es = kvmem::io::dtype_size(t.dtype);
  if (es == 0 || (i + 1) * es > t.bytes.size()) return;
  unsigned char* p = &t.bytes[i * es];
  if (t.dtype == "F32") {
    const float f = static_cast<float>(x);
    std::memcpy(p, &f, 4);
  } else if (t.dtype == "F64") {
    std::memcpy(p, &x, 8);
  } else if (t.dtype == "I64") {
    const std::int64_t v = std::isfinite(x) && std::abs(x) < 9e18 ? static_cast<std::int64_t>(x) : -1;
    std::memcpy(p, &v, 8);
  } else if (t.dtype == "I32") {
    const std::int32_t v = std::isfinite(x) && std::abs(x) < 2e9 ? static_cast<std::int32_t>(x) : -1;
    std::memcpy(p, &v, 4);
  }
}

/// One structural edit of `f` (see the file comment). `flags` are metadata keys worth setting.
inline void mutate_file(kvmem::io::SafetensorsFile& f, std::minstd_rand& rng, const std::vector<std::string>& flags) {
  auto pick = [&]() -> std::pair<const std::string, kvmem::io::Tensor>* {
    if (f.tensors.empty()) return nullptr;
    auto it = f.tensors.begin();
    std::advance(it, rng() % f.tensors.size());
    return &*it;
  };
  static const char names[] = {'B', 'H', 'K', 'T', 'D', 'V'};
  // Sets named dimension `which` to `value` (or, if value < 0, to one interesting_dim) in every tensor.
  auto set_named = [&](char which, std::int64_t value) {
    for (auto& [name, t] : f.tensors) {
      const auto a = axes().find(name);
      if (a == axes().end()) continue;
      for (std::size_t i = 0; i < a->second.size() && i < t.shape.size(); ++i)
        if (a->second[i] == which) {
          if (value < 0) value = interesting_dim(rng, t.shape[i]);
          t.shape[i] = value;
        }
      fit_data(t, rng);
    }
  };
  switch (rng() % 8) {
    case 0:  // one named dimension, consistently across every tensor that has it
      set_named(names[rng() % 6], -1);
      break;
    case 7: {  // empty but huge: one named dimension 0, another large (the tensors stay consistent and tiny)
      static const std::int64_t huge[] = {1LL << 20, 1LL << 31, 1LL << 40, 1LL << 62};
      const char zero = names[rng() % 6];
      char big = names[rng() % 6];
      if (big == zero) big = names[(std::find(names, names + 6, zero) - names + 1) % 6];
      set_named(zero, 0);
      set_named(big, huge[rng() % 4]);
      break;
    }
    case 1: {  // one dimension of one tensor (inconsistent shapes), or its rank
      if (auto* e = pick()) {
        auto& t = e->second;
        if (!t.shape.empty() && rng() % 4) t.shape[rng() % t.shape.size()] = interesting_dim(rng, t.shape[0]);
        else if (rng() % 2 && !t.shape.empty()) t.shape.pop_back();
        else t.shape.push_back(1 + rng() % 3);
        fit_data(t, rng);
      }
      break;
    }
    case 2: {  // dtype
      static const char* dtypes[] = {"F32", "F64", "I64", "I32", "F16", "BF16", "U8", "BOOL", "I8"};
      if (auto* e = pick()) {
        e->second.dtype = dtypes[rng() % 9];
        e->second.bytes.clear();
        fit_data(e->second, rng);
      }
      break;
    }
    case 3: {  // a tensor removed, renamed, or an optional one added
      if (rng() % 3 == 0) {
        kvmem::io::Tensor l;
        l.dtype = rng() % 2 ? "I64" : "I32";
        l.shape = {f.tensors.count("q") && !f.tensors.at("q").shape.empty() ? f.tensors.at("q").shape[0] : 1};
        fit_data(l, rng);
        f.tensors["lengths"] = l;
      } else if (auto* e = pick()) {
        const std::string name = e->first;
        auto t = e->second;
        f.tensors.erase(name);
        if (rng() % 2) {
          static const char* names[] = {"q", "k", "v", "gate", "lengths", "ln_weight", "tau_state", "x", ""};
          f.tensors[names[rng() % 9]] = t;
        }
      }
      break;
    }
    case 4: {  // data values: special floats, huge or negative lengths
      static const double specials[] = {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity(),
                                        -std::numeric_limits<double>::infinity(), 1e38, -1e38, 1e300, 1e-45, 0.0, -1.0,
                                        1e6, 4e9, 9.3e18};
      if (auto* e = pick()) {
        const std::size_t es = std::max<std::size_t>(1, kvmem::io::dtype_size(e->second.dtype));
        const std::size_t n = e->second.bytes.size() / es;
        for (int r = 0, m = 1 + static_cast<int>(rng() % 3); n && r < m; ++r)
          set_element(e->second, rng() % n, specials[rng() % (sizeof(specials) / sizeof(specials[0]))]);
      }
      break;
    }
    case 5: {  // a metadata flag
      static const char* values[] = {"0", "1", "2", "3", "4", "5", "8", "16", "-1", "-2", "256", "1000000",
                                     "2147483647", "9223372036854775807", "-9223372036854775808", "0.5", "1e300",
                                     "-1e300", "nan", "inf", "prefill", "decode", "fixed", "power-law",
                                     "saturating", "plateau", "linear", "x"};
      if (!flags.empty()) f.metadata[flags[rng() % flags.size()]] = values[rng() % (sizeof(values) / sizeof(values[0]))];
      break;
    }
    default: {  // shuffle shapes between two tensors
      auto* a = pick();
      auto* b = pick();
      if (a && b) {
        std::swap(a->second.shape, b->second.shape);
        fit_data(a->second, rng);
        fit_data(b->second, rng);
      }
      break;
    }
  }
}

/// libFuzzer custom mutator body: structural edits of parseable files, byte mutations otherwise.
inline std::size_t mutate_safetensors(std::uint8_t* data, std::size_t size, std::size_t max_size, unsigned seed,
                                      const std::vector<std::string>& flags) {
  std::minstd_rand rng(seed);
  if (rng() % 4 == 0) return LLVMFuzzerMutate(data, size, max_size);
  kvmem::io::SafetensorsFile f;
  try {
    f = kvmem::io::SafetensorsFile::parse(std::vector<unsigned char>(data, data + size), "mutator");
  } catch (const kvmem::invalid_argument&) {
    return LLVMFuzzerMutate(data, size, max_size);
  }
  for (int i = 0, n = 1 + static_cast<int>(rng() % 2); i < n; ++i) mutate_file(f, rng, flags);
  const auto out = f.serialize();
  if (out.size() > max_size) return LLVMFuzzerMutate(data, size, max_size);
  std::memcpy(data, out.data(), out.size());
  return out.size();
}

}  // namespace kvmem_fuzz
