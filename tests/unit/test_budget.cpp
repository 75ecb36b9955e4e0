// Budget schedules and the host plan of updates (spec KVM.md §4 worked trace, §5.1-§5.2 examples).
#include <catch2/catch_test_macros.hpp>

#include <kvmem/kvmem.hpp>

using namespace kvmem;

TEST_CASE("budget schedules follow spec KVM.md 5.2", "[budget]") {
  CHECK(budget::Fixed{256}.rows(768) == 256);
  CHECK(budget::Fixed{}.rows(1 << 20) == -1);
  CHECK(budget::PowerLaw{256, 16.0, 0.5, 1}.rows(768) == 443);        // floor(16 * sqrt(768)) = 443
  CHECK(budget::PowerLaw{-1, 1.0, 0.5, 1}.rows(1024) == 32);          // exact square
  CHECK(budget::PowerLaw{-1, 16.0, 0.5, 64}.rows(768) == 384);        // rounded down to 64
  CHECK(budget::PowerLaw{500, 16.0, 0.5, 1}.rows(768) == 500);        // min_rows wins
  CHECK(budget::Saturating{1, 1024.0, 1}.rows(768) == 438);           // floor(1024*768/1792)
  CHECK(budget::Saturating{1, 1024.0, 1}.rows(1 << 30) == 1023);      // never reaches N
  CHECK(budget::Saturating{-1, 1024.0, 100}.rows(768) == 400);
}

TEST_CASE("update plans follow spec KVM.md 5.1", "[budget][plan]") {
  MemoryConfig cfg;
  cfg.chunk = 256;
  cfg.window_chunks = 2;
  cfg.max_rows = 256 * 10000;
  // First update at ctx = 768 with 256 rows (C = 256, L = 512).
  CHECK(state::plan_update(cfg, budget::PowerLaw{256, 16.0, 0.5, 1}, 256, 256).append == 187);
  CHECK(state::plan_update(cfg, budget::Saturating{1, 1024.0, 1}, 256, 256).append == 182);
  CHECK(state::plan_update(cfg, budget::Fixed{256}, 256, 256).append == 0);
  // The cap max_rows and the tokens available bound growth.
  cfg.max_rows = 256;
  CHECK(state::plan_update(cfg, budget::PowerLaw{256, 16.0, 0.5, 1}, 256, 256).append == 0);
}

TEST_CASE("the worked trace of spec KVM.md 4: rows 4, 5, 6", "[budget][plan]") {
  MemoryConfig cfg;
  cfg.chunk = 2;
  cfg.window_chunks = 2;
  cfg.max_rows = 200;
  const budget::PowerLaw b{2, 2.0, 0.5, 1};
  long rows = 2;
  const long expected_append[] = {2, 1, 1}, expected_ctx[] = {6, 8, 10};
  for (int u = 0; u < 3; ++u) {
    const auto p = state::plan_update(cfg, b, rows, 2 + 2 * u);
    CHECK(p.ctx == expected_ctx[u]);
    CHECK(p.append == expected_append[u]);
    rows = p.rows_after();
  }
  CHECK(rows == 6);
  CHECK(state::final_rows(cfg, b, 11) == 6);
  CHECK(state::window_begin(11, 2, 4) == 8);
  CHECK(state::window_begin(4, 2, 4) == 0);
  CHECK(state::window_begin(5, 2, 4) == 2);
}
