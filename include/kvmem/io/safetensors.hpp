#pragma once
/// \file safetensors.hpp
/// Reading and writing safetensors files (tools and examples; needs nlohmann-json).
///
/// Format: an 8-byte little-endian header length n, n bytes of JSON mapping each tensor name to
/// {"dtype", "shape", "data_offsets": [begin, end)} (offsets in bytes, relative to the data section
/// after the header) plus an optional "__metadata__" object of strings, then the raw little-endian data.
/// The reader checks everything before it allocates or copies: a header length past the end of the
/// file, malformed JSON, unknown dtypes, offsets outside the data, byte counts that do not match the
/// shape (with overflow checks), and overlapping tensors all throw kvmem::invalid_argument naming the
/// file, the tensor and the value.

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "../dtype.hpp"
#include "../errors.hpp"

namespace kvmem::io {

static_assert(std::endian::native == std::endian::little, "kvmem::io assumes a little-endian host");

/// One tensor: dtype name as in safetensors ("F32", "F64", "BF16", "F16", "I64", "I32", ...), shape, raw
/// little-endian bytes (numel() times dtype_size(dtype)).
struct Tensor {
  std::string dtype;
  std::vector<std::int64_t> shape;
  std::vector<unsigned char> bytes;

  /// Number of elements (product of the shape; 1 for a scalar).
  [[nodiscard]] std::int64_t numel() const {
    std::int64_t n = 1;
    for (auto d : shape) n *= d;
    return n;
  }
};

/// Bytes per element of a safetensors dtype, or 0 if kvmem does not know it.
[[nodiscard]] inline std::size_t dtype_size(const std::string& dtype) {
  static const std::map<std::string, std::size_t> sizes = {{"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2},
                                                           {"I64", 8}, {"I32", 4}, {"I16", 2}, {"I8", 1},
                                                           {"U8", 1},  {"BOOL", 1}};
  const auto it = sizes.find(dtype);
  return it == sizes.end() ? 0 : it->second;
}

namespace detail {
/// Longest header excerpt quoted in an error message, characters.
inline constexpr std::size_t brief_chars = 80;

/// `text` cut to brief_chars characters (with "..." when cut).
[[nodiscard]] inline std::string brief(std::string text) {
  if (text.size() > brief_chars) text = text.substr(0, brief_chars) + "...";
  return text;
}

/// A short JSON excerpt of a header value for an error message. Containers are written at most two
/// levels deep and cut at brief_chars: nlohmann's dump() recurses once per nesting level, so a hostile
/// header of a million nested arrays would overflow the stack, and a long value would flood the message.
[[nodiscard]] inline std::string brief(const nlohmann::json& j, int depth = 0) {
  if (!j.is_structured()) return brief(j.dump());
  if (depth >= 2) return j.empty() ? (j.is_array() ? "[]" : "{}") : (j.is_array() ? "[...]" : "{...}");
  std::string s = j.is_array() ? "[" : "{";
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it != j.begin()) s += ",";
    if (j.is_object()) s += nlohmann::json(it.key()).dump() + ":";
    s += brief(*it, depth + 1);
    if (s.size() > brief_chars) return brief(s);
  }
  return s + (j.is_array() ? "]" : "}");
}
}  // namespace detail

/// A safetensors file in memory: tensors by name plus string metadata.
struct SafetensorsFile {
  std::map<std::string, Tensor> tensors;
  std::map<std::string, std::string> metadata;
  /// Size of the parsed file, bytes (0 for a file built in memory): a bound for sizes its header implies.
  std::uint64_t file_bytes = 0;

  /// Largest header accepted, bytes (the format's own limit is 100 MB).
  static constexpr std::uint64_t max_header_bytes = 100u << 20;

  /// Parses `bytes` (a whole file); `name` is used in error messages.
  static SafetensorsFile parse(const std::vector<unsigned char>& bytes, const std::string& name) {
    const std::string where = "file '" + name + "'";
    require(bytes.size() >= 8, where + " size", bytes.size(), "too short for a safetensors header (needs 8 bytes)");
    std::uint64_t n = 0;
    std::memcpy(&n, bytes.data(), 8);
    require(n <= bytes.size() - 8, where + " header length", n,
            "larger than the " + std::to_string(bytes.size() - 8) + " bytes after it (truncated or corrupt file)");
    require(n <= max_header_bytes, where + " header length", n, "exceeds the 100 MB safetensors limit");
    nlohmann::json header;
    try {
      header = nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + static_cast<std::ptrdiff_t>(n));
    } catch (const nlohmann::json::exception& e) {
      throw invalid_argument(where + " header: not valid JSON (" + e.what() + ")");
    }
    require(header.is_object(), where + " header", header.type_name(), "must be a JSON object");
    const std::uint64_t data_size = bytes.size() - 8 - n;
    const unsigned char* data = bytes.data() + 8 + n;
    SafetensorsFile file;
    file.file_bytes = bytes.size();
    std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges;
    for (const auto& [key, entry] : header.items()) {
      if (key == "__metadata__") {
        require(entry.is_object(), where + " __metadata__", entry.type_name(), "must be an object of strings");
        for (const auto& [mk, mv] : entry.items()) {
          require(mv.is_string(), where + " __metadata__." + detail::brief(mk), detail::brief(mv), "must be a string");
          file.metadata[mk] = mv.get<std::string>();
        }
        continue;
      }
      const std::string t = where + " tensor '" + detail::brief(key) + "'";
      require(entry.is_object() && entry.contains("dtype") && entry.contains("shape") &&
                  entry.contains("data_offsets"),
              t, detail::brief(entry), "needs dtype, shape and data_offsets");
      const auto& dt = entry["dtype"];
      require(dt.is_string(), t + " dtype", detail::brief(dt), "must be a string");
      Tensor tensor;
      tensor.dtype = dt.get<std::string>();
      const std::size_t es = dtype_size(tensor.dtype);
      require(es != 0, t + " dtype", detail::brief(tensor.dtype), "unknown dtype");
      const auto& shape = entry["shape"];
      require(shape.is_array(), t + " shape", detail::brief(shape), "must be an array");
      std::uint64_t count = 1;
      std::uint64_t nonzero = 1;  // product of the non-zero dimensions
      bool no_elements = false;   // a zero dimension anywhere: the tensor holds nothing
      for (const auto& d : shape) no_elements = no_elements || (d.is_number_integer() && d.get<std::int64_t>() == 0);
      for (const auto& d : shape) {
        require(d.is_number_unsigned() || (d.is_number_integer() && d.get<std::int64_t>() >= 0), t + " shape",
                detail::brief(shape), "entries must be non-negative integers");
        const std::uint64_t dim = d.get<std::uint64_t>();
        // Shapes are int64 (Tensor::shape); a dimension past that would read back negative.
        require(dim <= static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()), t + " shape",
                detail::brief(shape), "entries must be below 2^63");
        if (no_elements) {  // holds nothing, but the other dimensions must still multiply below 2^63 (numel())
          require(dim == 0 || nonzero <= static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()) / dim,
                  t + " shape", detail::brief(shape), "dimensions multiply past 2^63");
          if (dim != 0) nonzero *= dim;
        } else {
          require(count <= data_size / dim, t + " shape", detail::brief(shape), "holds more elements than the file");
        }
        count *= dim;
        tensor.shape.push_back(static_cast<std::int64_t>(dim));
      }
      const auto& off = entry["data_offsets"];
      require(off.is_array() && off.size() == 2 && off[0].is_number_unsigned() && off[1].is_number_unsigned(),
              t + " data_offsets", detail::brief(off), "must be two non-negative integers");
      const std::uint64_t begin = off[0].get<std::uint64_t>(), end = off[1].get<std::uint64_t>();
      require(begin <= end && end <= data_size, t + " data_offsets", detail::brief(off),
              "must satisfy begin <= end <= " + std::to_string(data_size) + " (the data section)");
      require(end - begin == count * es, t + " data_offsets", detail::brief(off),
              "span " + std::to_string(end - begin) + " bytes but dtype and shape need " + std::to_string(count * es));
      tensor.bytes.assign(data + begin, data + end);
      if (end > begin) ranges.emplace_back(begin, end);
      file.tensors.emplace(key, std::move(tensor));
    }
    std::sort(ranges.begin(), ranges.end());
    for (std::size_t i = 1; i < ranges.size(); ++i)
      require(ranges[i].first >= ranges[i - 1].second, where + " data_offsets", ranges[i].first,
              "tensors overlap");
    return file;
  }

  /// Reads and parses the file at `path`. Throws kvmem::invalid_argument if it cannot be opened.
  static SafetensorsFile read(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    require(static_cast<bool>(in), "file", path, "cannot be opened for reading");
    std::vector<unsigned char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    return parse(bytes, path);
  }

  /// The tensor `name`; throws kvmem::invalid_argument if the file has none.
  [[nodiscard]] const Tensor& at(const std::string& name) const {
    const auto it = tensors.find(name);
    if (it == tensors.end()) throw invalid_argument("tensor '" + name + "': missing from the file");
    return it->second;
  }
  [[nodiscard]] bool has(const std::string& name) const { return tensors.count(name) != 0; }

  /// Adds (or replaces) the tensor `name` of shape `shape` from numel(shape) elements of host data of type
  /// T, copied bit for bit: float -> F32, double -> F64, kvmem::bfloat16 -> BF16, kvmem::float16 -> F16,
  /// int64 -> I64, int32 -> I32, unsigned char -> U8. Another T does not compile.
  template <class T>
  void put(const std::string& name, std::vector<std::int64_t> shape, const T* data) {
    Tensor t;
    if constexpr (std::is_same_v<T, float>) t.dtype = "F32";
    else if constexpr (std::is_same_v<T, double>) t.dtype = "F64";
    else if constexpr (std::is_same_v<T, bfloat16> || std::is_same_v<T, float16>) t.dtype = dtype_name<T>;
    else if constexpr (std::is_same_v<T, std::int64_t>) t.dtype = "I64";
    else if constexpr (std::is_same_v<T, std::int32_t>) t.dtype = "I32";
    else if constexpr (std::is_same_v<T, unsigned char>) t.dtype = "U8";
    else static_assert(sizeof(T) == 0, "unsupported element type");
    t.shape = std::move(shape);
    const auto n = static_cast<std::size_t>(t.numel()) * sizeof(T);
    t.bytes.resize(n);
    if (n) std::memcpy(t.bytes.data(), data, n);
    tensors[name] = std::move(t);
  }

  /// The file's bytes: header and data (tensors in name order, 8-byte aligned header).
  [[nodiscard]] std::vector<unsigned char> serialize() const {
    nlohmann::json header = nlohmann::json::object();
    if (!metadata.empty()) header["__metadata__"] = metadata;
    std::uint64_t offset = 0;
    for (const auto& [name, t] : tensors) {
      header[name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.bytes.size()}}};
      offset += t.bytes.size();
    }
    std::string text = header.dump();
    text.append((8 - text.size() % 8) % 8, ' ');
    const std::uint64_t n = text.size();
    std::vector<unsigned char> bytes(8 + text.size());
    std::memcpy(bytes.data(), &n, 8);
    std::memcpy(bytes.data() + 8, text.data(), text.size());
    bytes.reserve(bytes.size() + offset);
    for (const auto& [name, t] : tensors) bytes.insert(bytes.end(), t.bytes.begin(), t.bytes.end());
    return bytes;
  }

  /// Writes serialize() to `path`.
  void write(const std::string& path) const {
    const auto bytes = serialize();
    std::ofstream out(path, std::ios::binary);
    require(static_cast<bool>(out), "file", path, "cannot be opened for writing");
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    require(static_cast<bool>(out), "file", path, "write failed");
  }
};

/// The elements of `t` (numel() of them, in its row-major order) converted to float64, exactly: from F32,
/// F64, BF16, F16 (every bfloat16 and float16 value is a float32 value, kvmem::to_float), I64 (exact up to
/// 2^53) or I32. Throws kvmem::invalid_argument naming the tensor `name` and its dtype for another dtype
/// (I16, I8, U8, BOOL).
[[nodiscard]] inline std::vector<double> to_double(const Tensor& t, const std::string& name) {
  const std::size_t n = static_cast<std::size_t>(t.numel());
  std::vector<double> out(n);
  auto convert = [&](auto tag) {
    using T = decltype(tag);
    for (std::size_t i = 0; i < n; ++i) {
      T x;
      std::memcpy(&x, t.bytes.data() + i * sizeof(T), sizeof(T));
      if constexpr (std::is_same_v<T, bfloat16> || std::is_same_v<T, float16>) out[i] = static_cast<double>(to_float(x));
      else out[i] = static_cast<double>(x);
    }
  };
  if (t.dtype == "F32") convert(float{});
  else if (t.dtype == "F64") convert(double{});
  else if (t.dtype == "BF16") convert(bfloat16{});
  else if (t.dtype == "F16") convert(float16{});
  else if (t.dtype == "I64") convert(std::int64_t{});
  else if (t.dtype == "I32") convert(std::int32_t{});
  else
    throw invalid_argument("tensor '" + name + "' dtype = " + t.dtype +
                           ": unsupported (use F32, F64, BF16, F16, I64 or I32)");
  return out;
}

}  // namespace kvmem::io
