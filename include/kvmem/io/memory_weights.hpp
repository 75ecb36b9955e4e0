#pragma once
/// \file memory_weights.hpp
/// Reading kvmem's trained memory weights files (format "kvmem-memory-weights-1"; written by the Python
/// package's kvmem.weights.save, docs/python.md "Trained weights"; needs nlohmann-json like safetensors.hpp).
///
/// A weights file is a safetensors file holding every attention layer's trained parameters of one memory
/// for one model: tensors `layers.<L>.<name>` (float32) and string metadata `format`, `memory` ("kvm",
/// "ovq" or "kvpop"), `model` (the model's name) and `shape` (JSON: layers, hidden, query_heads, kv_heads,
/// head_dim, adapter_rank), plus what the trainer recorded (budget, recipe, training texts). The names and
/// shapes of each memory's tensors are in policy/trained_weights.hpp, which turns them into the views a
/// memory reads.

#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "../errors.hpp"
#include "safetensors.hpp"

namespace kvmem::io {

/// The `format` metadata of a kvmem weights file.
inline constexpr const char* memory_weights_format = "kvmem-memory-weights-1";

/// The model sizes a weights file was trained for (its `shape` metadata): attention layers, hidden size
/// (the attention input's features), query heads Hq, kv-heads Hkv, head_dim D, and the rank of the low-rank
/// adapters on the q and k projections (0: none).
struct WeightsShape {
  long layers = 0, hidden = 0, query_heads = 0, kv_heads = 0, head_dim = 0, adapter_rank = 0;
};

/// A parsed, checked weights file. Every error is a kvmem::invalid_argument naming the file and what is
/// wrong in it (the tensor and the shape expected, the metadata key and the value expected).
class MemoryWeightsFile {
 public:
  /// Reads the weights file at `path`, which must hold weights of memory `memory` ("kvm", "ovq", "kvpop").
  /// Throws kvmem::invalid_argument for a file that cannot be read or is not safetensors, a `format` other
  /// than memory_weights_format, another memory, or a `shape` metadata that is not a JSON object of the six
  /// sizes (layers, hidden, query_heads, kv_heads, head_dim >= 1; adapter_rank >= 0).
  static MemoryWeightsFile read(const std::string& path, const std::string& memory) {
    return from(SafetensorsFile::read(path), path, memory);
  }

  /// The same checks on a file already parsed (`path` names it in errors).
  static MemoryWeightsFile from(SafetensorsFile file, const std::string& path, const std::string& memory) {
    MemoryWeightsFile w;
    w.path_ = path;
    w.file_ = std::move(file);
    const auto meta = [&](const char* key) {
      const auto it = w.file_.metadata.find(key);
      return it == w.file_.metadata.end() ? std::string("(none)") : it->second;
    };
    require(meta("format") == memory_weights_format, w.where() + " metadata format", meta("format"),
            std::string("must be ") + memory_weights_format + " (a kvmem weights file, written by kvmem.weights.save)");
    w.memory_ = meta("memory");
    require(w.memory_ == memory, w.where() + " metadata memory", w.memory_,
            "holds another memory's weights; expected " + memory);
    w.model_ = meta("model");
    nlohmann::json shape;
    try {
      shape = nlohmann::json::parse(meta("shape"));
    } catch (const nlohmann::json::exception&) {
      shape = nullptr;
    }
    require(shape.is_object(), w.where() + " metadata shape", detail::brief(meta("shape")),
            "must be a JSON object of layers, hidden, query_heads, kv_heads, head_dim, adapter_rank");
    const auto size = [&](const char* key, long low) {
      const auto it = shape.find(key);
      const bool ok = it != shape.end() && it->is_number_integer() && it->get<long>() >= low;
      require(ok, w.where() + " metadata shape." + key, it == shape.end() ? std::string("(none)") : detail::brief(*it),
              "must be an integer >= " + std::to_string(low));
      return it->get<long>();
    };
    w.shape_ = {size("layers", 1),   size("hidden", 1),   size("query_heads", 1),
                size("kv_heads", 1), size("head_dim", 1), size("adapter_rank", 0)};
    return w;
  }

  [[nodiscard]] const std::string& path() const { return path_; }
  /// The memory the weights are for: "kvm", "ovq" or "kvpop".
  [[nodiscard]] const std::string& memory() const { return memory_; }
  /// The model the weights were trained for (its name, as the trainer recorded it).
  [[nodiscard]] const std::string& model() const { return model_; }
  [[nodiscard]] const WeightsShape& shape() const { return shape_; }
  /// Every metadata string of the file (the trainer's records included).
  [[nodiscard]] const std::map<std::string, std::string>& metadata() const { return file_.metadata; }
  /// The parsed safetensors file.
  [[nodiscard]] const SafetensorsFile& file() const { return file_; }

  /// Throws kvmem::invalid_argument naming the file when it was trained for another model than `model`.
  void expect_model(const std::string& model) const {
    require(model_ == model, where() + " metadata model", model_, "the weights were trained for another model than " + model);
  }

  /// Throws kvmem::invalid_argument naming the file and the size when the file's model has other query
  /// heads, kv-heads or head_dim than the attention it is applied to.
  void expect_sizes(long query_heads, long kv_heads, long head_dim) const {
    const auto check = [&](const char* key, long have, long want) {
      require(have == want, where() + " metadata shape." + key, have,
              "the attention the weights are applied to has " + std::to_string(want));
    };
    check("query_heads", shape_.query_heads, query_heads);
    check("kv_heads", shape_.kv_heads, kv_heads);
    check("head_dim", shape_.head_dim, head_dim);
  }

  /// Throws kvmem::invalid_argument naming the file when `layer` is not one of its layers.
  void expect_layer(long layer) const {
    require(layer >= 0 && layer < shape_.layers, "layer", layer,
            "outside [0, " + std::to_string(shape_.layers) + "), the layers of " + where());
  }

  /// The prefix of layer `layer`'s tensor names, "layers.<layer>.".
  [[nodiscard]] static std::string layer_prefix(long layer) { return "layers." + std::to_string(layer) + "."; }

  /// The elements of tensor `layers.<layer>.<name>` as float32, row-major, after checking that the layer
  /// exists, that the tensor is there, is F32 and has shape `shape`. Throws kvmem::invalid_argument naming
  /// the file, the tensor and the shape expected.
  [[nodiscard]] std::vector<float> layer_tensor(long layer, const std::string& name,
                                                const std::vector<std::int64_t>& shape) const {
    expect_layer(layer);
    const std::string full = layer_prefix(layer) + name;
    const std::string expect = "expected dtype F32 and shape " + shape_text(shape);
    require(file_.has(full), where() + " tensor " + full, "(missing)", expect);
    const auto& t = file_.at(full);
    require(t.dtype == "F32" && t.shape == shape, where() + " tensor " + full,
            t.dtype + " " + shape_text(t.shape), expect);
    std::vector<float> out(static_cast<std::size_t>(t.numel()));
    if (!out.empty()) std::memcpy(out.data(), t.bytes.data(), t.bytes.size());
    return out;
  }

 private:
  [[nodiscard]] std::string where() const { return "weights file '" + path_ + "'"; }
  [[nodiscard]] static std::string shape_text(const std::vector<std::int64_t>& shape) {
    std::string s = "[";
    for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
    return s + "]";
  }

  std::string path_, memory_, model_;
  WeightsShape shape_;
  SafetensorsFile file_;
};

}  // namespace kvmem::io
