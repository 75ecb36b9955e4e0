#pragma once
/// \file concept.hpp
/// The AppendScorer concept: which overflow tokens win a new row when the budget lets the state grow.

#include <concepts>
#include <string_view>

namespace kvmem::score {

/// A scorer is a stateless type with one static device hook
/// `score(token_key, read_keys, rows, head_dim) -> float`: the score of an overflow token's memory key
/// [head_dim] against the `rows` current state rows' read keys ([rows, head_dim], row-major). The
/// memory appends the tokens with the lowest scores, ties to the lower token index (spec KVM.md §5.3).
/// The concept checks float read keys; a scorer used by a memory whose storage type is bfloat16 or float16
/// takes the rows as a template (`template <class Row> score(const float*, const Row*, long, int)`, reading
/// each element through kvmem::to_float), as score::Novelty does.
template <class S>
concept AppendScorer = requires(const float* key, const float* rows_keys, long rows, int dim) {
  { S::name } -> std::convertible_to<std::string_view>;
  { S::score(key, rows_keys, rows, dim) } -> std::same_as<float>;
};

}  // namespace kvmem::score
