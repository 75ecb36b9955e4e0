// KVPOP (score::MLstm): long positions where the decay term dominates, and missing or misshapen mLSTM
// weights named.
#include <catch2/catch_approx.hpp>
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include "eviction_harness.hpp"

using namespace kvmem_test::eviction;
using Catch::Matchers::ContainsSubstring;

TEST_CASE("eviction: kvpop over long positions, where the decay term dominates (§4, Q9)", "[eviction][reference]") {
  // theta = -30: log gamma = log 0.999 (to 1e-13), so (q - t) log gamma reaches -2 against scores of O(1).
  for (auto norm : {kvmem_ref::MLstmNorm::xlstm, kvmem_ref::MLstmNorm::plain})
    for (int n : {1, 3}) {
      EvictCase c;
      c.kind = Kind::kvpop, c.norm = norm, c.decay = n;
      c.T = 2000, c.Hq = 2, c.Hkv = 1, c.D = 8, c.Dv = 8, c.sinks = 4, c.window = 8, c.top_k = 8;
      c.theta_all = -30.0f, c.w_s_scale = 0.5f;
      c.seed = 31 + n;
      c.generate();
      INFO(c.describe());
      REQUIRE(c.policy(0, 0).mlstm.log_gamma() == Catch::Approx(std::log(0.999)).epsilon(1e-12));
      const auto whole = run_evict(c, Mode::prefill);
      const auto ref = kvmem_ref::evict_decode(c.head(0, 0), c.policy(0, 0));
      REQUIRE(whole.kept[0] == ref.kept);
      std::vector<float> y(whole.y.begin(), whole.y.end());  // [Hq = G, T, Dv]
      CHECK(kvmem_test::relative_error(y, ref.y) <= tolerance);
      require_same_bits(whole, run_evict(c, Mode::two_prefills, 1234));
      if (n == 1) {  // the decay matters: with log gamma = log 0.999999 the policy keeps other tokens
        auto no_decay = c;
        no_decay.theta_all = 80.0f;
        no_decay.generate();
        REQUIRE(kvmem_ref::evict_decode(no_decay.head(0, 0), no_decay.policy(0, 0)).kept != ref.kept);
      }
    }
}

TEST_CASE("eviction: missing and misshapen mLSTM weights are named", "[eviction][errors]") {
  EvictCase c;
  c.kind = Kind::kvpop, c.Hq = 4, c.Hkv = 2, c.D = 8, c.Dv = 6;
  c.generate();
  const auto cfg = c.config();
  REQUIRE_NOTHROW(kvmem::score::load_mlstm_weights<host_mem>(c.weights_file(), cfg));
  auto throws = [&](auto call, const std::vector<std::string>& texts) {
    REQUIRE_THROWS_AS(call(), kvmem::invalid_argument);
    for (const auto& text : texts) REQUIRE_THROWS_WITH(call(), ContainsSubstring(text));
  };
  for (const char* name : {"w_q", "w_k", "w_v", "w_i", "b_i", "w_f", "b_f", "w_s", "b_s", "theta"}) {
    INFO("missing " << name);
    auto file = c.weights_file();
    file.tensors.erase(name);
    throws([&] { kvmem::score::load_mlstm_weights<host_mem>(file, cfg); }, {std::string("'") + name + "'", "missing"});
  }
  {  // a misshapen tensor: w_s [Hkv, h + 1]
    auto file = c.weights_file();
    const std::vector<float> bad(2 * 5, 0.5f);
    file.put("w_s", {2, 5}, bad.data());
    throws([&] { kvmem::score::load_mlstm_weights<host_mem>(file, cfg); }, {"mLSTM weight 'w_s' shape = [2, 5]", "[2, 4]"});
  }
  {  // w_k with X = D instead of D + Dv
    auto file = c.weights_file();
    const std::vector<float> bad(2 * 8 * 4, 0.5f);
    file.put("w_k", {2, 8, 4}, bad.data());
    throws([&] { kvmem::score::load_mlstm_weights<host_mem>(file, cfg); }, {"mLSTM weight 'w_k' shape = [2, 8, 4]"});
  }
  {  // theta for one kv-head only
    auto file = c.weights_file();
    const float one = 0.0f;
    file.put("theta", {1}, &one);
    throws([&] { kvmem::score::load_mlstm_weights<host_mem>(file, cfg); }, {"'theta'"});
  }
  {  // wrong rank
    auto file = c.weights_file();
    const std::vector<float> bad(2, 0.5f);
    file.put("b_i", {2, 1}, bad.data());
    throws([&] { kvmem::score::load_mlstm_weights<host_mem>(file, cfg); }, {"'b_i' rank = 2"});
  }
  {  // an integer tensor
    auto file = c.weights_file();
    const std::int32_t ints[] = {1, 2};
    file.put("theta", {2}, ints);
    throws([&] { kvmem::score::load_mlstm_weights<host_mem>(file, cfg); }, {"mLSTM weight 'theta' dtype = I32"});
  }
  {  // F64 weights load to the same values
    auto file = c.weights_file();
    std::vector<double> wide(c.w_q.begin(), c.w_q.end());
    file.put("w_q", {2, c.X(), c.h()}, wide.data());
    const auto w = kvmem::score::load_mlstm_weights<host_mem>(file, cfg);
    REQUIRE(w.w_q(1, 3, 2) == c.w_q[(1 * c.X() + 3) * c.h() + 2]);
  }
  // odd head_dim
  auto odd = cfg;
  odd.head_dim = 7;
  throws([&] { kvmem::score::load_mlstm_weights<host_mem>(c.weights_file(), odd); }, {"head_dim = 7", "even"});
  const auto w = kvmem::score::load_mlstm_weights<host_mem>(c.weights_file(), cfg);
  using MLstm = kvmem::score::MLstm<host_mem>;
  throws([&] { kvmem::EvictionMemory<host_exec, MLstm>(odd, 1, MLstm(w)); }, {"head_dim = 7", "even"});
  // weights for another shape, or none at all, are rejected when the memory is built
  auto other = cfg;
  other.value_dim = 8;
  throws([&] { kvmem::EvictionMemory<host_exec, MLstm>(other, 1, MLstm(w)); }, {"mLSTM weight 'w_q' shape = [2, 14, 4]"});
  throws([&] { kvmem::EvictionMemory<host_exec, MLstm>(cfg, 1); }, {"mLSTM weight 'w_q' shape"});
  throws([&] { kvmem::training::eviction_masks(host_exec(), other, MLstm(w), view4<host_mem>("k", 1, 2, 3, 8),
                                               view4<host_mem>("v", 1, 2, 3, 8)); },
         {"mLSTM weight 'w_q' shape"});
}
