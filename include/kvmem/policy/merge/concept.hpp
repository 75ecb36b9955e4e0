#pragma once
/// \file concept.hpp
/// The MergePolicy concept: how tokens become state rows, how rows are read, and how overflow tokens fold in.

#include <concepts>
#include <string_view>

#include "../../config.hpp"
#include "../layer_weights.hpp"
#include "row.hpp"

namespace kvmem::merge {

/// A merge policy is a stateless type of static hooks and traits (vectors are contiguous; state rows float32).
/// Derive from merge::Defaults and override what differs; see docs/writing-a-policy.md.
///
/// Traits (static constexpr bool):
/// - `first_chunk_verbatim`: the first chunk's tokens become rows as they arrive (KVM) instead of being
///   committed like any later block (OVQ);
/// - `route_after_append`: merged tokens pick among the rows including those just appended (KVM) or only
///   among the rows that existed before the block (OVQ);
/// - `commit_eagerly`: a full block is folded in as soon as it is complete (OVQ), not when the next token
///   pushes it out of the window (KVM); only the final state differs;
/// - `rows_in_score_order`: appended tokens take consecutive rows in ascending score order (OVQ), not in
///   token order (KVM);
/// - `uses_layer_norm`: the policy reads LayerWeights::ln_weight/ln_bias (they must be [D]).
/// Device hooks:
/// - `window_key(cfg, k, out)`: token key [D] as stored in the window (and read by window attention);
/// - `memory_key(cfg, w, window_key, out)`: window key -> the key a row stores and scoring/routing use;
/// - `read_key(cfg, w, row, out)`, `read_value(cfg, row, out)`: what attention reads from a row;
/// - `logit_scale(tau, q, D)`: factor of q · key for the query q [D] of a head with temperature tau;
/// - `row_bias(row)`: additive logit bias of a row;
/// - `gate(z)`: fold weight of a token from its merge-gate pre-activation z;
/// - `new_row(cfg, row, key, value)`: a token founds a row;
/// - `begin_fold(cfg, row)`, `fold(cfg, row, key, value, g)`, `end_fold(cfg, row)`: the tokens routed to a
///   row are folded in token order between begin_fold and end_fold.
/// The concept checks the hooks with float32 tokens. A memory whose storage type T (kvmem/dtype.hpp) is
/// bfloat16 or float16 passes T pointers where tokens are read or written (window_key's k and out,
/// memory_key's window key, read_key's and read_value's out, logit_scale's q, new_row's and fold's value):
/// a policy used with such a memory declares those hooks as templates over the element type, reads through
/// kvmem::to_float and stores through kvmem::from_float, as merge::Defaults does.
template <class M>
concept MergePolicy = requires(const MemoryConfig& cfg, const LayerWeightsRef& w, const float* x, float* out,
                               const Row& row, float z, int n) {
  { M::name } -> std::convertible_to<std::string_view>;
  { M::first_chunk_verbatim } -> std::convertible_to<bool>;
  { M::route_after_append } -> std::convertible_to<bool>;
  { M::commit_eagerly } -> std::convertible_to<bool>;
  { M::rows_in_score_order } -> std::convertible_to<bool>;
  { M::uses_layer_norm } -> std::convertible_to<bool>;
  { M::window_key(cfg, x, out) } -> std::same_as<void>;
  { M::memory_key(cfg, w, x, out) } -> std::same_as<void>;
  { M::read_key(cfg, w, row, out) } -> std::same_as<void>;
  { M::read_value(cfg, row, out) } -> std::same_as<void>;
  { M::logit_scale(z, x, n) } -> std::same_as<float>;
  { M::row_bias(row) } -> std::same_as<float>;
  { M::gate(z) } -> std::same_as<float>;
  { M::new_row(cfg, row, x, x) } -> std::same_as<void>;
  { M::begin_fold(cfg, row) } -> std::same_as<void>;
  { M::fold(cfg, row, x, x, z) } -> std::same_as<void>;
  { M::end_fold(cfg, row) } -> std::same_as<void>;
};

}  // namespace kvmem::merge
