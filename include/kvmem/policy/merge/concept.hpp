#pragma once
/// \file concept.hpp
/// The MergePolicy concept: how tokens become state rows and how overflow tokens fold into rows.

#include <concepts>
#include <string_view>

#include "../../config.hpp"
#include "../layer_weights.hpp"

namespace kvmem::merge {

/// A merge policy is a stateless type with static device hooks (all vectors are contiguous float32):
/// - `memory_key(cfg, w, k, out)`: token key k [D] -> memory key [D] stored in a new row / folded in;
/// - `read_key(cfg, w, K, out)`: state row key K [D] -> key read by attention, routing and scoring;
/// - `read_value(cfg, V, radius, out)`: state row value V [Dv] and its radius -> value read;
/// - `gate(z)`: merge-gate weight of a token from its pre-activation z (> 0);
/// - `fold(row, x, g, n)`: fold a token vector x [n] with weight g into a row accumulator [n].
/// Routing (which row a merged token folds into) and which tokens are appended are decided by the
/// memory's kernels and the EvictionScorer, so a policy stays a handful of lines.
template <class M>
concept MergePolicy = requires(const MemoryConfig& cfg, const LayerWeightsRef& w, const float* x, float* out,
                               float z, int n) {
  { M::name } -> std::convertible_to<std::string_view>;
  { M::memory_key(cfg, w, x, out) } -> std::same_as<void>;
  { M::read_key(cfg, w, x, out) } -> std::same_as<void>;
  { M::read_value(cfg, x, z, out) } -> std::same_as<void>;
  { M::gate(z) } -> std::same_as<float>;
  { M::fold(out, x, z, n) } -> std::same_as<void>;
};

}  // namespace kvmem::merge
