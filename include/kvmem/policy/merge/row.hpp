#pragma once
/// \file row.hpp
/// merge::Row — one state row as the merge hooks see it.

namespace kvmem::merge {

/// Pointers into one state row of StateRows: `key` [D], `value` [Dv], and the row's two scalars,
/// `radius` (KVM: value norm fixed at creation) and `count` (OVQ: tokens folded in). A policy uses the
/// scalars it needs and ignores the other.
struct Row {
  float* key = nullptr;
  float* value = nullptr;
  float* radius = nullptr;
  float* count = nullptr;
};

}  // namespace kvmem::merge
