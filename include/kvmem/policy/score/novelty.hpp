#pragma once
/// \file novelty.hpp
/// score::Novelty — KVM/OVQ redundancy score: maximum similarity to the normalized state keys.

#include <Kokkos_Core.hpp>

#include "../../math/vector_ops.hpp"
#include "append_scorer.hpp"

namespace kvmem::score {

/// score_j = max_i kbar_j · LN_s(K_i) over all rows, sinks included, with the ungated memory key
/// (kvm-paper Sec. 4 "append the least redundant tokens"; spec KVM.md §5.3). The least redundant tokens
/// (lowest score) become new rows. With no rows the score is -inf (every token equally novel).
struct Novelty {
  static constexpr std::string_view name = "novelty";
  /// score is the maximum of dot products with the rows from -inf: the update may compute it for a block
  /// of tokens in register tiles (kernels::token_rows_max), with the same bits.
  static constexpr bool max_similarity = true;
  /// `rows_keys` [rows, dim], row-major. Eight rows are scored at a time as independent chains
  /// (kernels::dot_rows, the same bits as one `dot` per row), then compared in row order.
  /// The rows' read keys may be of any storage type (read through to_float).
  template <class Row>
  KOKKOS_INLINE_FUNCTION static float score(const float* key, const Row* rows_keys, long rows, int dim) {
    constexpr int NR = 8;
    float best = -Kokkos::Experimental::infinity_v<float>;
    float s[NR];
    for (long i = 0; i < rows; i += NR) {
      const long n = Kokkos::min(static_cast<long>(NR), rows - i);
      if (n == NR)
        kernels::dot_rows<NR>(key, 1.0f, rows_keys + i * dim, dim, dim, s);
      else
        for (long r = 0; r < n; ++r) s[r] = kernels::dot(key, rows_keys + (i + r) * dim, dim);
      for (long r = 0; r < n; ++r) best = s[r] > best ? s[r] : best;
    }
    return best;
  }
};
static_assert(AppendScorer<Novelty>);

}  // namespace kvmem::score
