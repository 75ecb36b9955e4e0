// TOVA (score::LastQueryAttention): its layer mean against the reference and against the per-head policy.
#include <catch2/catch_test_macros.hpp>

#include "eviction_harness.hpp"

using namespace kvmem_test::eviction;

TEST_CASE("eviction: TOVA's layer mean evicts the same token from every kv-head; with one kv-head it is the group mean",
          "[eviction][reference]") {
  for (long Hkv : {1L, 3L}) {
    EvictCase c;
    c.kind = Kind::tova_layer, c.B = 2, c.T = 70, c.lengths = {70, 44}, c.Hq = 2 * Hkv, c.Hkv = Hkv;
    c.sinks = 1, c.window = 2, c.top_k = 5, c.duplicate_keys = true, c.seed = 90 + static_cast<unsigned>(Hkv);
    c.generate();
    INFO(c.describe());
    const auto layer = run_evict(c, Mode::decode, 0, true);
    check_reference(c, layer);
    for (long b = 0; b < c.B; ++b)
      for (long h = 1; h < c.Hkv; ++h) REQUIRE(layer.steps[b * c.Hkv + h] == layer.steps[b * c.Hkv]);
    auto group = c;
    group.kind = Kind::tova;
    const auto per_head = run_evict(group, Mode::prefill);
    if (Hkv == 1) require_same_bits(layer, per_head);
    else REQUIRE(layer.kept != per_head.kept);  // the layer mean is another policy
  }
}
