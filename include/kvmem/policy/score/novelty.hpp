#pragma once
/// \file novelty.hpp
/// score::Novelty — KVM/OVQ redundancy score: maximum similarity to the normalized state keys.

#include <Kokkos_Core.hpp>

#include "../../kernels/vector_ops.hpp"
#include "append_scorer.hpp"

namespace kvmem::score {

/// score_j = max_i kbar_j · LN_s(K_i) over all rows, sinks included, with the ungated memory key
/// (kvm-paper Sec. 4 "append the least redundant tokens"; spec KVM.md §5.3). The least redundant tokens
/// (lowest score) become new rows. With no rows the score is -inf (every token equally novel).
struct Novelty {
  static constexpr std::string_view name = "novelty";
  KOKKOS_INLINE_FUNCTION static float score(const float* key, const float* rows_keys, long rows, int dim) {
    float best = -Kokkos::Experimental::infinity_v<float>;
    for (long i = 0; i < rows; ++i) {
      const float s = kernels::dot(key, rows_keys + i * dim, dim);
      best = s > best ? s : best;
    }
    return best;
  }
};
static_assert(AppendScorer<Novelty>);

}  // namespace kvmem::score
