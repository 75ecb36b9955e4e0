#pragma once
/// \file kvmem.hpp
/// Umbrella header: everything an engine needs to compose and run a kvmem memory.

#include "config.hpp"
#include "dtype.hpp"
#include "errors.hpp"
#include "eviction.hpp"
#include "kernels/readout/exact_attention.hpp"
#include "memory.hpp"
#include "memory_concept.hpp"
#include "policy/budget/fixed.hpp"
#include "policy/budget/linear.hpp"
#include "policy/budget/plateau.hpp"
#include "policy/budget/power_law.hpp"
#include "policy/budget/saturating.hpp"
#include "policy/layer_weights.hpp"
#include "policy/merge/k_means_count.hpp"
#include "policy/merge/proportional.hpp"
#include "policy/merge/winner_take_all.hpp"
#include "policy/score/novelty.hpp"
#include "policy/score/row_eviction.hpp"
#include "trellis_memory.hpp"

namespace kvmem {
/// KVM (kvm-paper): winner-take-all merge, novelty-ranked append, budget schedule of your choice; tokens in
/// the storage type T (float, kvmem::bfloat16, kvmem::float16; see Memory).
template <class ExecSpace, budget::BudgetSchedule Budget, StorageType T = float>
using KvmMemory = Memory<ExecSpace, merge::WinnerTakeAll, Budget, score::Novelty, score::KeepRows, T>;
/// KVM whose state rows are also evicted by `RowPolicy` above its cap (e.g. score::RowAccumulatedAttention:
/// winner-take-all merging plus H2O eviction of stale rows; no paper runs this combination).
template <class ExecSpace, budget::BudgetSchedule Budget, score::RowEviction RowPolicy, StorageType T = float>
using KvmMemoryWithRowEviction = Memory<ExecSpace, merge::WinnerTakeAll, Budget, score::Novelty, RowPolicy, T>;
/// OVQ (ovq-paper): online k-means with counts, plateau budget by default. Configure window_chunks = 1,
/// sinks = 0 and max_rows = N for the paper's semantics; tau_state = tau_window = beta. Tokens in the
/// storage type T (see Memory).
template <class ExecSpace, budget::BudgetSchedule Budget = budget::Plateau, StorageType T = float>
using OvqMemory = Memory<ExecSpace, merge::KMeansCount, Budget, score::Novelty, score::KeepRows, T>;
/// Proportional merging (merge::Proportional): rows read as the mean key and value of their tokens with the
/// logit bias log(count), for a pretrained model without training. Configure sinks >= 1 (the attention
/// sink stays its own row) and pass tau_state = tau_window = 1 (the model's own scale 1 / sqrt(D)); ln
/// weights are not read (they may be empty). Tokens in the storage type T (see Memory).
template <class ExecSpace, budget::BudgetSchedule Budget, StorageType T = float>
using ProportionalMemory = Memory<ExecSpace, merge::Proportional, Budget, score::Novelty, score::KeepRows, T>;
}  // namespace kvmem
