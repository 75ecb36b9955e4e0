#pragma once
/// \file kvmem.hpp
/// Umbrella header: everything an engine needs to compose and run a kvmem memory.

#include "config.hpp"
#include "errors.hpp"
#include "memory.hpp"
#include "policy/budget/fixed.hpp"
#include "policy/budget/power_law.hpp"
#include "policy/budget/saturating.hpp"
#include "policy/layer_weights.hpp"
#include "policy/merge/winner_take_all.hpp"
#include "policy/score/novelty.hpp"

namespace kvmem {
/// KVM (kvm-paper): winner-take-all merge, novelty-ranked append, budget schedule of your choice.
template <class ExecSpace, budget::BudgetSchedule Budget>
using KvmMemory = Memory<ExecSpace, merge::WinnerTakeAll, Budget, score::Novelty>;
}  // namespace kvmem
