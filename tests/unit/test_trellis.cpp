// The Trellis memory (spec TRELLIS.md): closed-form VJPs against finite differences, the kernels against
// the naive float64 reference (tests/reference/trellis_reference.hpp) over every phi x f, chunk boundaries
// and the spec's edge cases, prefill/decode continuation, the spec's worked example, bad inputs, and the
// same bits on one and on many threads.
#include <catch2/catch_template_test_macros.hpp>
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <kvmem/trellis_memory.hpp>

#include "../reference/trellis_reference.hpp"
#include "worst_error.hpp"

namespace ref = kvmem_ref::trellis;
using Catch::Matchers::ContainsSubstring;
using host_exec = Kokkos::DefaultHostExecutionSpace;

namespace {

/// Tolerance of the float32 kernels against the float64 reference (the acceptance criterion).
constexpr double tolerance = 1e-4;

constexpr kvmem::merge::Phi all_phi[] = {kvmem::merge::Phi::identity, kvmem::merge::Phi::silu,
                                         kvmem::merge::Phi::softmax, kvmem::merge::Phi::tanh,
                                         kvmem::merge::Phi::sigmoid};
constexpr kvmem::merge::Activation all_f[] = {kvmem::merge::Activation::ln_silu, kvmem::merge::Activation::l2_silu,
                                              kvmem::merge::Activation::softmax, kvmem::merge::Activation::identity};

ref::Phi to_ref(kvmem::merge::Phi p) { return static_cast<ref::Phi>(static_cast<int>(p)); }
ref::F to_ref(kvmem::merge::Activation f) {
  switch (f) {
    case kvmem::merge::Activation::ln_silu: return ref::F::ln_silu;
    case kvmem::merge::Activation::l2_silu: return ref::F::l2_silu;
    case kvmem::merge::Activation::softmax: return ref::F::softmax;
    default: return ref::F::identity;
  }
}

/// A batch of random Trellis inputs, row-major [B, H, T, ...] float32 as in the kvmem-run contract.
struct TrellisCase {
  long B = 2, H = 2, T = 23, D = 8, Dv = 6, m = 4, chunk = 4;
  kvmem::merge::Phi phi = kvmem::merge::Phi::silu;
  kvmem::merge::Activation f = kvmem::merge::Activation::ln_silu;
  bool readout2_phi = true;
  unsigned seed = 1;
  long zero_beta_every = 0;   // beta = 0 at tokens t % n == n - 1 (erase)
  long zero_gamma_every = 0;  // gamma = 0 at tokens t % n == n - 2 (pure decay)
  bool initial_state = false; // start from a random state (set_state) instead of zero
  bool affine = false;        // LN-SiLU affine weights
  std::vector<long> lengths;  // empty = all T
  std::vector<float> q, k, v, alpha, beta1, gamma1, beta2, gamma2, m1, m2, ln_weight, ln_bias;

  [[nodiscard]] long length(long b) const { return lengths.empty() ? T : lengths[b]; }

  /// Rounds the token inputs and gates to the storage type S, as a memory of that type receives them.
  template <kvmem::StorageType S>
  void round_inputs() {
    for (auto* x : {&q, &k, &v, &alpha, &beta1, &gamma1, &beta2, &gamma2})
      for (auto& e : *x) e = kvmem::to_float(kvmem::from_float<S>(e));
  }
  void generate() {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal;
    std::uniform_real_distribution<float> uni(0.0f, 1.0f);
    // Unit-norm q, k, v per token (spec §5 recommends it; gamma ||k||^2 = O(1) keeps the steps stable).
    auto tokens = [&](std::vector<float>& x, long dim) {
      x.resize(B * H * T * dim);
      for (long i = 0; i < B * H * T; ++i) {
        float n = 0.0f;
        for (long c = 0; c < dim; ++c) n += (x[i * dim + c] = normal(rng)) * x[i * dim + c];
        for (long c = 0; c < dim; ++c) x[i * dim + c] /= std::sqrt(n) + 1e-6f;
      }
    };
    tokens(q, D);
    tokens(k, D);
    tokens(v, Dv);
    alpha.resize(B * H * T * m);
    for (auto& a : alpha) a = 0.7f * normal(rng);
    auto gates = [&](std::vector<float>& x, float lo, float hi, long zero_every, long at) {
      x.resize(B * H * T);
      for (long i = 0; i < B * H * T; ++i) {
        x[i] = lo + (hi - lo) * uni(rng);
        if (zero_every > 0 && (i % T) % zero_every == (at + zero_every) % zero_every) x[i] = 0.0f;
      }
    };
    gates(beta1, 0.6f, 1.0f, zero_beta_every, zero_beta_every - 1);
    gates(gamma1, 0.05f, 0.6f, zero_gamma_every, zero_gamma_every - 2);
    gates(beta2, 0.6f, 1.0f, zero_beta_every, zero_beta_every - 1);
    gates(gamma2, 0.05f, 0.6f, zero_gamma_every, zero_gamma_every - 2);
    m1.assign(B * H * m * D, 0.0f);
    m2.assign(B * H * m * Dv, 0.0f);
    if (initial_state) {
      for (auto& x : m1) x = 0.5f * normal(rng);
      for (auto& x : m2) x = 0.5f * normal(rng);
    }
    ln_weight.clear();
    ln_bias.clear();
    if (affine)
      for (long s = 0; s < m; ++s) {
        ln_weight.push_back(1.0f + 0.3f * normal(rng));
        ln_bias.push_back(0.2f * normal(rng));
      }
  }

  [[nodiscard]] kvmem::TrellisConfig config() const {
    kvmem::TrellisConfig c;
    c.slots = static_cast<int>(m);
    c.head_dim = static_cast<int>(D);
    c.value_dim = static_cast<int>(Dv);
    c.heads = static_cast<int>(H);
    c.chunk = static_cast<int>(chunk);
    c.phi = phi;
    c.f = f;
    c.readout2_phi = readout2_phi;
    return c;
  }

  [[nodiscard]] ref::Params params() const {
    ref::Params p;
    p.m = m, p.D = D, p.Dv = Dv, p.phi = to_ref(phi), p.f = to_ref(f), p.readout2_phi = readout2_phi;
    p.ln_weight.assign(ln_weight.begin(), ln_weight.end());
    p.ln_bias.assign(ln_bias.begin(), ln_bias.end());
    return p;
  }

  /// Tokens [0, length(b)) of (b, h), widened to double.
  [[nodiscard]] ref::Head head(long b, long h) const {
    ref::Head x;
    const long n = length(b), base = b * H + h;
    auto rows = [&](const std::vector<float>& src, long dim) {
      std::vector<ref::Vec> out(n);
      for (long t = 0; t < n; ++t) out[t].assign(&src[(base * T + t) * dim], &src[(base * T + t) * dim] + dim);
      return out;
    };
    // data() + offset, not &src[offset]: with T = 0 the vector is empty and operator[] binds a null reference (UBSan)
    auto scalars = [&](const std::vector<float>& src) { return ref::Vec(src.data() + base * T, src.data() + base * T + n); };
    x.q = rows(q, D), x.k = rows(k, D), x.v = rows(v, Dv), x.alpha = rows(alpha, m);
    x.beta1 = scalars(beta1), x.gamma1 = scalars(gamma1), x.beta2 = scalars(beta2), x.gamma2 = scalars(gamma2);
    return x;
  }

  [[nodiscard]] ref::State initial(long b, long h) const {
    ref::State s(params());
    const long base = b * H + h;
    s.m1.a.assign(&m1[base * m * D], &m1[base * m * D] + m * D);
    s.m2.a.assign(&m2[base * m * Dv], &m2[base * m * Dv] + m * Dv);
    return s;
  }
};

/// What the kernels produced: y [B, H, T, Dv], M1 [B, H, m, D], M2 [B, H, m, Dv].
struct Output {
  std::vector<float> y, m1, m2;
};

enum class Mode {
  prefill,              ///< one prefill call
  decode,               ///< T decode calls
  prefill_split,        ///< prefill [0, split), then prefill [split, T)
  prefill_then_decode,  ///< prefill [0, split), then decode token by token
};

/// x on the device as a rank-R view of the storage type S (rounded by kvmem::from_float).
template <class MemorySpace, int R, kvmem::StorageType S = float>
auto device_copy(const std::vector<float>& x, const std::array<long, R>& ext, const std::string& name) {
  using data_t = std::conditional_t<R == 3, S***, S****>;
  Kokkos::View<data_t, Kokkos::LayoutRight, MemorySpace> v;
  std::vector<S> xs(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) xs[i] = kvmem::from_float<S>(x[i]);
  if constexpr (R == 3) {
    v = decltype(v)(name, ext[0], ext[1], ext[2]);
    Kokkos::deep_copy(v, Kokkos::View<const S***, Kokkos::LayoutRight, Kokkos::HostSpace, Kokkos::MemoryUnmanaged>(
                             xs.data(), ext[0], ext[1], ext[2]));
  } else {
    v = decltype(v)(name, ext[0], ext[1], ext[2], ext[3]);
    Kokkos::deep_copy(v, Kokkos::View<const S****, Kokkos::LayoutRight, Kokkos::HostSpace, Kokkos::MemoryUnmanaged>(
                             xs.data(), ext[0], ext[1], ext[2], ext[3]));
  }
  return v;
}

/// The elements of v widened to float.
template <class View>
std::vector<float> host_copy(const View& v) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  std::vector<float> out(h.size());
  for (std::size_t i = 0; i < h.size(); ++i) out[i] = kvmem::to_float(h.data()[i]);
  return out;
}

/// Runs TrellisMemory<ExecSpace, S> over case `c` in `mode` (`split` for the split modes); inputs rounded
/// to the storage type S.
template <class ExecSpace, kvmem::StorageType S = float>
Output run_trellis(const TrellisCase& c, Mode mode, long split = 0, const ExecSpace& exec = ExecSpace()) {
  using space = typename ExecSpace::memory_space;
  const long B = c.B, H = c.H, T = c.T;
  const auto q = device_copy<space, 4, S>(c.q, {B, H, T, c.D}, "q"), k = device_copy<space, 4, S>(c.k, {B, H, T, c.D}, "k");
  const auto v = device_copy<space, 4, S>(c.v, {B, H, T, c.Dv}, "v"), a = device_copy<space, 4, S>(c.alpha, {B, H, T, c.m}, "alpha");
  const auto b1 = device_copy<space, 3, S>(c.beta1, {B, H, T}, "beta1"), g1 = device_copy<space, 3, S>(c.gamma1, {B, H, T}, "gamma1");
  const auto b2 = device_copy<space, 3, S>(c.beta2, {B, H, T}, "beta2"), g2 = device_copy<space, 3, S>(c.gamma2, {B, H, T}, "gamma2");
  Kokkos::View<S****, Kokkos::LayoutRight, space> y("y", B, H, T, c.Dv);
  kvmem::TrellisWeights<space> w;
  if (c.affine) {
    Kokkos::View<float*, space> lw("ln_weight", c.m), lb("ln_bias", c.m);
    Kokkos::deep_copy(lw, Kokkos::View<const float*, Kokkos::HostSpace, Kokkos::MemoryUnmanaged>(c.ln_weight.data(), c.m));
    Kokkos::deep_copy(lb, Kokkos::View<const float*, Kokkos::HostSpace, Kokkos::MemoryUnmanaged>(c.ln_bias.data(), c.m));
    w.ln_weight = lw;
    w.ln_bias = lb;
  }
  kvmem::TrellisMemory<ExecSpace, S> mem(c.config(), w, static_cast<int>(B), exec);
  if (c.initial_state)
    mem.set_state(device_copy<space, 4>(c.m1, {B, H, c.m, c.D}, "m1"), device_copy<space, 4>(c.m2, {B, H, c.m, c.Dv}, "m2"));
  std::vector<long> len(B);
  for (long b = 0; b < B; ++b) len[b] = c.length(b);
  auto part = [&](long t0, long t1) {  // prefill tokens [t0, t1)
    const auto at = std::make_pair(t0, t1);
    auto s4 = [&](const auto& x) { return Kokkos::subview(x, Kokkos::ALL, Kokkos::ALL, at, Kokkos::ALL); };
    auto s3 = [&](const auto& x) { return Kokkos::subview(x, Kokkos::ALL, Kokkos::ALL, at); };
    std::vector<long> l(B);
    for (long b = 0; b < B; ++b) l[b] = std::clamp(len[b] - t0, 0L, t1 - t0);
    mem.prefill(s4(q), s4(k), s4(v), s4(a), s3(b1), s3(g1), s3(b2), s3(g2), s4(y), l);
  };
  long decoded_from = T;
  if (mode == Mode::prefill) part(0, T);
  if (mode == Mode::decode) decoded_from = 0;
  if (mode == Mode::prefill_split) {
    part(0, split);
    part(split, T);
  }
  if (mode == Mode::prefill_then_decode) {
    part(0, split);
    decoded_from = split;
  }
  std::vector<unsigned char> active(B);
  for (long t = decoded_from; t < T; ++t) {
    for (long b = 0; b < B; ++b) active[b] = t < len[b];
    const auto at = std::make_pair(t, t + 1);
    auto s4 = [&](const auto& x) { return Kokkos::subview(x, Kokkos::ALL, Kokkos::ALL, at, Kokkos::ALL); };
    auto s3 = [&](const auto& x) { return Kokkos::subview(x, Kokkos::ALL, Kokkos::ALL, at); };
    mem.decode(s4(q), s4(k), s4(v), s4(a), s3(b1), s3(g1), s3(b2), s3(g2), s4(y), active);
  }
  for (long b = 0; b < B; ++b) REQUIRE(mem.tokens(b) == len[b]);
  return {host_copy(y), host_copy(mem.m1()), host_copy(mem.m2())};
}

std::string describe(const TrellisCase& c) {
  std::string l;
  for (long x : c.lengths) l += std::to_string(x) + ",";
  return "B=" + std::to_string(c.B) + " H=" + std::to_string(c.H) + " T=" + std::to_string(c.T) + " D=" +
         std::to_string(c.D) + " Dv=" + std::to_string(c.Dv) + " m=" + std::to_string(c.m) + " C=" +
         std::to_string(c.chunk) + " phi=" + std::string(kvmem::merge::name_of(c.phi)) + " f=" +
         std::string(kvmem::merge::name_of(c.f)) + " readout2_phi=" + std::to_string(c.readout2_phi) +
         " zero_beta_every=" + std::to_string(c.zero_beta_every) + " zero_gamma_every=" +
         std::to_string(c.zero_gamma_every) + " initial_state=" + std::to_string(c.initial_state) +
         " affine=" + std::to_string(c.affine) + " seed=" + std::to_string(c.seed) + " lengths=" + l;
}

/// Reference output of case `c` when tokens [0, split) go through `first` (chunk C) and [split, T) through
/// `second` (chunk C, restarting at split), per (b, h), in the kernels' layout.
struct Expected {
  std::vector<double> y, m1, m2;
};
Expected reference(const TrellisCase& c, ref::Form first, long split, ref::Form second) {
  Expected e;
  e.y.assign(c.B * c.H * c.T * c.Dv, 0.0);
  const auto p = c.params();
  for (long b = 0; b < c.B; ++b)
    for (long h = 0; h < c.H; ++h) {
      const auto x = c.head(b, h);
      const long n = c.length(b), s = std::min(split, n);
      auto st = c.initial(b, h);
      auto y = ref::forward(x.slice(0, s), p, st, first, c.chunk);
      const auto y2 = ref::forward(x.slice(s, n), p, st, second, c.chunk);
      y.insert(y.end(), y2.begin(), y2.end());
      for (long t = 0; t < n; ++t)
        for (long d = 0; d < c.Dv; ++d) e.y[((b * c.H + h) * c.T + t) * c.Dv + d] = y[t][d];
      e.m1.insert(e.m1.end(), st.m1.a.begin(), st.m1.a.end());
      e.m2.insert(e.m2.end(), st.m2.a.begin(), st.m2.a.end());
    }
  return e;
}

void check_close(const Output& got, const Expected& want, double tol = tolerance) {
  const auto ey = kvmem_test::relative_error(got.y, want.y), e1 = kvmem_test::relative_error(got.m1, want.m1),
             e2 = kvmem_test::relative_error(got.m2, want.m2);
  INFO("relative errors: y " << ey << ", m1 " << e1 << ", m2 " << e2);
  CHECK(ey <= tol);
  CHECK(e1 <= tol);
  CHECK(e2 <= tol);
}

void require_same_bits(const Output& a, const Output& b) {
  REQUIRE(a.y == b.y);
  REQUIRE(a.m1 == b.m1);
  REQUIRE(a.m2 == b.m2);
}

/// Prefill against the stale-gradient reference and decode against the recurrence, on ExecSpace.
template <class ExecSpace = host_exec>
void check_both_modes(TrellisCase c) {
  c.generate();
  INFO(describe(c));
  {
    INFO("prefill");
    check_close(run_trellis<ExecSpace>(c, Mode::prefill), reference(c, ref::Form::stale_gradient, c.T, ref::Form::stale_gradient));
  }
  {
    INFO("decode");
    check_close(run_trellis<ExecSpace>(c, Mode::decode), reference(c, ref::Form::recurrent, c.T, ref::Form::recurrent));
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------------
// phi and its vector-Jacobian products (spec §2.3, §8 invariant 1)

TEST_CASE("trellis: closed-form VJPs match finite differences for every phi", "[trellis][vjp]") {
  std::mt19937 rng(7);
  std::normal_distribution<double> normal;
  for (auto phi : all_phi)
    for (int m : {1, 2, 5, 9}) {
      INFO("phi=" << kvmem::merge::name_of(phi) << " m=" << m);
      ref::Vec z(m), e(m), a(m);
      for (int i = 0; i < m; ++i) z[i] = 1.5 * normal(rng), e[i] = normal(rng), a[i] = 0.7 * normal(rng);
      // Finite differences of g(z) = <phi(z), e> (gradient J^T e) and of L(z) = ||phi(z) - a||^2 (2 J^T (phi - a)).
      ref::Vec fd_vjp(m), fd_loss(m);
      const double h = 1e-6;
      for (int j = 0; j < m; ++j) {
        auto zp = z, zm = z;
        zp[j] += h, zm[j] -= h;
        const auto pp = ref::phi(to_ref(phi), zp), pm = ref::phi(to_ref(phi), zm);
        double gp = 0, gm = 0, lp = 0, lm = 0;
        for (int i = 0; i < m; ++i) {
          gp += pp[i] * e[i], gm += pm[i] * e[i];
          lp += (pp[i] - a[i]) * (pp[i] - a[i]), lm += (pm[i] - a[i]) * (pm[i] - a[i]);
        }
        fd_vjp[j] = (gp - gm) / (2 * h);
        fd_loss[j] = (lp - lm) / (2 * h);
      }
      // The float64 reference (explicit Jacobian).
      const auto rv = ref::vjp(to_ref(phi), z, e);
      for (int j = 0; j < m; ++j) CHECK(std::abs(rv[j] - fd_vjp[j]) <= 1e-7 * (1 + std::abs(fd_vjp[j])));
      // The kernels' closed forms (float32).
      std::vector<float> zf(z.begin(), z.end()), ef(e.begin(), e.end()), af(a.begin(), a.end()), out(m);
      kvmem::merge::GradientDescent::vjp(phi, zf.data(), ef.data(), out.data(), m);
      for (int j = 0; j < m; ++j) CHECK(std::abs(out[j] - fd_vjp[j]) <= 1e-5 * (1 + std::abs(fd_vjp[j])));
      auto u = zf;
      kvmem::merge::GradientDescent::loss_gradient(phi, u.data(), af.data(), m, 2.0f);
      for (int j = 0; j < m; ++j) CHECK(std::abs(u[j] - fd_loss[j]) <= 1e-5 * (1 + std::abs(fd_loss[j])));
      // phi itself
      const auto pr = ref::phi(to_ref(phi), z);
      auto pf = zf;
      kvmem::merge::GradientDescent::apply_phi(phi, pf.data(), m);
      for (int j = 0; j < m; ++j) CHECK(std::abs(pf[j] - pr[j]) <= 1e-6 * (1 + std::abs(pr[j])));
    }
}

TEST_CASE("trellis: sigmoid and silu do not overflow; softmax with m = 1 has a zero gradient", "[trellis][vjp]") {
  using GD = kvmem::merge::GradientDescent;
  for (float z : {-1000.0f, -88.0f, 0.0f, 88.0f, 1000.0f}) {
    REQUIRE(std::isfinite(GD::sigmoid(z)));
    REQUIRE(std::isfinite(GD::silu(z)));
  }
  REQUIRE(GD::sigmoid(-1000.0f) == 0.0f);
  REQUIRE(GD::sigmoid(1000.0f) == 1.0f);
  float z[1] = {3.7f}, a[1] = {-0.4f};
  GD::loss_gradient(kvmem::merge::Phi::softmax, z, a, 1, 2.0f);
  REQUIRE(z[0] == 0.0f);
}

TEST_CASE("trellis: the intermediate activations f match the reference", "[trellis][vjp]") {
  std::mt19937 rng(3);
  std::normal_distribution<double> normal;
  for (auto f : all_f)
    for (int m : {1, 3, 8})
      for (bool affine : {false, true}) {
        if (affine && f != kvmem::merge::Activation::ln_silu) continue;
        INFO("f=" << kvmem::merge::name_of(f) << " m=" << m << " affine=" << affine);
        ref::Params p;
        p.m = m, p.f = to_ref(f);
        ref::Vec y(m);
        std::vector<float> yf(m), w(m), b(m);
        for (int i = 0; i < m; ++i) yf[i] = static_cast<float>(y[i] = 2 * normal(rng));
        if (affine) {
          for (int i = 0; i < m; ++i) w[i] = static_cast<float>(1 + 0.3 * normal(rng)), b[i] = static_cast<float>(0.2 * normal(rng));
          p.ln_weight.assign(w.begin(), w.end());
          p.ln_bias.assign(b.begin(), b.end());
        }
        const auto want = ref::activate(p, y);
        kvmem::merge::GradientDescent::activate(f, yf.data(), m, 1e-5f, 1e-12f, affine ? w.data() : nullptr,
                                                affine ? b.data() : nullptr);
        for (int i = 0; i < m; ++i) CHECK(std::abs(yf[i] - want[i]) <= 1e-5 * (1 + std::abs(want[i])));
        if (f == kvmem::merge::Activation::ln_silu && m == 1)
          REQUIRE(yf[0] == (affine ? b[0] : 0.0f));  // spec §4.1: m = 1 gives p = 0 (then the bias)
      }
}

// ---------------------------------------------------------------------------------------------------
// The float64 reference against itself (spec §3, §8 invariant 2)

TEST_CASE("trellis: reference: the stale-gradient loop with C = 1 is the recurrence", "[trellis][reference]") {
  TrellisCase c;
  c.B = 1, c.H = 1, c.T = 17;
  for (bool init : {false, true}) {
    c.initial_state = init;
    c.generate();
    const auto p = c.params();
    auto s1 = c.initial(0, 0), s2 = c.initial(0, 0);
    const auto y1 = ref::forward(c.head(0, 0), p, s1, ref::Form::recurrent);
    const auto y2 = ref::forward(c.head(0, 0), p, s2, ref::Form::stale_gradient, 1);
    REQUIRE(y1 == y2);
    REQUIRE(s1.m1.a == s2.m1.a);
    REQUIRE(s1.m2.a == s2.m2.a);
  }
}

// ---------------------------------------------------------------------------------------------------
// The spec's worked example (§3.3)

namespace {
/// Pass-1 readouts of the worked example through the whole memory: m = D = Dv = 1, phi = identity,
/// f = identity, M1 = 0, k = q = 1, alpha = 1, beta1 = 1 (beta1[1] = `beta_1`), gamma1 = 0.25; pass 2 has
/// M2 = 1, gamma2 = 0, beta2 = 1 and v = 1, so y_t = phi(M2^T f(yhat_t)) = yhat_t exactly.
std::vector<float> worked_example(long C, bool decode, float beta_1 = 1.0f) {
  using space = host_exec::memory_space;
  kvmem::TrellisConfig cfg;
  cfg.slots = cfg.head_dim = cfg.value_dim = cfg.heads = 1;
  cfg.chunk = static_cast<int>(C);
  cfg.phi = kvmem::merge::Phi::identity;
  cfg.f = kvmem::merge::Activation::identity;
  kvmem::TrellisMemory<host_exec> mem(cfg, 1);
  Kokkos::View<float****, space> ones("ones", 1, 1, 3, 1), y("y", 1, 1, 3, 1), m1("m1", 1, 1, 1, 1), m2("m2", 1, 1, 1, 1);
  Kokkos::View<float***, space> beta1("beta1", 1, 1, 3), gamma1("gamma1", 1, 1, 3), beta2("beta2", 1, 1, 3),
      gamma2("gamma2", 1, 1, 3);
  Kokkos::deep_copy(ones, 1.0f);
  Kokkos::deep_copy(beta1, 1.0f);
  beta1(0, 0, 1) = beta_1;
  Kokkos::deep_copy(gamma1, 0.25f);
  Kokkos::deep_copy(beta2, 1.0f);
  Kokkos::deep_copy(m2, 1.0f);
  mem.set_state(m1, m2);
  if (!decode) {
    mem.prefill(ones, ones, ones, ones, beta1, gamma1, beta2, gamma2, y);
  } else {
    for (long t = 0; t < 3; ++t) {
      const auto at = std::make_pair(t, t + 1);
      auto s4 = [&](const auto& x) { return Kokkos::subview(x, Kokkos::ALL, Kokkos::ALL, at, Kokkos::ALL); };
      auto s3 = [&](const auto& x) { return Kokkos::subview(x, Kokkos::ALL, Kokkos::ALL, at); };
      mem.decode(s4(ones), s4(ones), s4(ones), s4(ones), s3(beta1), s3(gamma1), s3(beta2), s3(gamma2), s4(y));
    }
  }
  REQUIRE(mem.m1()(0, 0, 0, 0) == y(0, 0, 2, 0));  // q = 1: the last readout is the final M1
  return {y(0, 0, 0, 0), y(0, 0, 1, 0), y(0, 0, 2, 0)};
}
}  // namespace

TEST_CASE("trellis: the spec's worked example (§3.3)", "[trellis][example]") {
  using V = std::vector<float>;
  REQUIRE(worked_example(1, false) == V{0.5f, 0.75f, 0.875f});
  REQUIRE(worked_example(1, true) == V{0.5f, 0.75f, 0.875f});
  REQUIRE(worked_example(2, true) == V{0.5f, 0.75f, 0.875f});  // decode ignores the chunk size
  REQUIRE(worked_example(2, false) == V{0.5f, 1.0f, 1.0f});
  REQUIRE(worked_example(3, false) == V{0.5f, 1.0f, 1.5f});
  REQUIRE(worked_example(7, false) == V{0.5f, 1.0f, 1.5f});
  REQUIRE(worked_example(3, false, 0.0f) == V{0.5f, 0.5f, 1.0f});  // beta_1 = 0: erase, then write

  // The same numbers from the float64 reference.
  ref::Params p;
  p.m = p.D = p.Dv = 1, p.phi = ref::Phi::identity, p.f = ref::F::identity;
  ref::Head x;
  for (int t = 0; t < 3; ++t) {
    x.q.push_back({1.0}), x.k.push_back({1.0}), x.v.push_back({1.0}), x.alpha.push_back({1.0});
    x.beta1.push_back(1.0), x.gamma1.push_back(0.25), x.beta2.push_back(1.0), x.gamma2.push_back(0.0);
  }
  auto run = [&](ref::Form form, long C) {
    ref::State st(p);
    st.m2(0, 0) = 1.0;
    const auto y = ref::forward(x, p, st, form, C);
    return std::vector<double>{y[0][0], y[1][0], y[2][0]};
  };
  using W = std::vector<double>;
  REQUIRE(run(ref::Form::recurrent, 1) == W{0.5, 0.75, 0.875});
  REQUIRE(run(ref::Form::stale_gradient, 2) == W{0.5, 1.0, 1.0});
  REQUIRE(run(ref::Form::stale_gradient, 3) == W{0.5, 1.0, 1.5});
  x.beta1[1] = 0.0;
  REQUIRE(run(ref::Form::stale_gradient, 3) == W{0.5, 0.5, 1.0});
}

// ---------------------------------------------------------------------------------------------------
// Kernels against the reference (spec §8 invariants 2-5)

TEST_CASE("trellis: kernels match the reference for every phi x f", "[trellis][reference]") {
  unsigned seed = 100;
  for (auto phi : all_phi)
    for (auto f : all_f)
      for (long C : {1L, 4L}) {
        TrellisCase c;
        c.phi = phi, c.f = f, c.chunk = C, c.seed = ++seed;
        check_both_modes(c);
      }
}

TEST_CASE("trellis: kernels match the reference at chunk boundaries", "[trellis][reference]") {
  // T = 23 is not a multiple of 2, 4 or 5; C = T is one chunk; C > T is one short chunk.
  for (long C : {1L, 2L, 4L, 5L, 23L, 40L})
    for (auto phi : {kvmem::merge::Phi::silu, kvmem::merge::Phi::softmax, kvmem::merge::Phi::identity}) {
      TrellisCase c;
      c.chunk = C, c.phi = phi, c.seed = static_cast<unsigned>(C * 7 + static_cast<int>(phi));
      c.f = phi == kvmem::merge::Phi::softmax ? kvmem::merge::Activation::l2_silu : kvmem::merge::Activation::ln_silu;
      check_both_modes(c);
    }
}

TEST_CASE("trellis: kernels match the reference on the spec's edge cases", "[trellis][reference]") {
  auto run = [](auto edit) {
    TrellisCase c;
    edit(c);
    check_both_modes(c);
  };
  SECTION("beta = 0 inside chunks (erase)") {
    run([](TrellisCase& c) { c.zero_beta_every = 3, c.chunk = 5; });
    run([](TrellisCase& c) { c.zero_beta_every = 2, c.chunk = 4, c.phi = kvmem::merge::Phi::tanh; });
  }
  SECTION("gamma = 0 inside chunks (pure decay)") {
    run([](TrellisCase& c) { c.zero_gamma_every = 3, c.chunk = 5; });
    run([](TrellisCase& c) { c.zero_gamma_every = 1, c.chunk = 4, c.initial_state = true; });  // every gamma 0
  }
  SECTION("beta = 0 and gamma = 0 in one chunk") {
    run([](TrellisCase& c) { c.zero_beta_every = 4, c.zero_gamma_every = 4, c.chunk = 3; });
  }
  SECTION("every beta = 0") { run([](TrellisCase& c) { c.zero_beta_every = 1, c.chunk = 4; }); }
  SECTION("m = 1") {
    for (auto f : all_f) run([f](TrellisCase& c) { c.m = 1, c.f = f, c.chunk = 4; });
    run([](TrellisCase& c) { c.m = 1, c.phi = kvmem::merge::Phi::softmax, c.chunk = 3, c.initial_state = true; });
  }
  SECTION("T = 1") {
    run([](TrellisCase& c) { c.T = 1, c.chunk = 4; });
    run([](TrellisCase& c) { c.T = 1, c.chunk = 1, c.initial_state = true; });
  }
  SECTION("T = 0") { run([](TrellisCase& c) { c.T = 0, c.initial_state = true; }); }
  SECTION("non-zero initial state") {
    for (auto phi : all_phi) run([phi](TrellisCase& c) { c.initial_state = true, c.phi = phi, c.chunk = 3; });
  }
  SECTION("readout2_phi off") {
    run([](TrellisCase& c) { c.readout2_phi = false, c.phi = kvmem::merge::Phi::tanh; });
  }
  SECTION("LN-SiLU affine") { run([](TrellisCase& c) { c.affine = true, c.chunk = 3; }); }
  SECTION("ragged batch") {
    run([](TrellisCase& c) { c.B = 3, c.lengths = {23, 0, 11}, c.chunk = 4; });
  }
  SECTION("one sequence, one head, D != Dv, larger m") {
    run([](TrellisCase& c) { c.B = 1, c.H = 1, c.D = 16, c.Dv = 3, c.m = 12, c.T = 41, c.chunk = 8; });
  }
}

// ---------------------------------------------------------------------------------------------------
// One meaning for prefill and decode, continuation, determinism

TEST_CASE("trellis: kernels on the default execution space match the reference", "[trellis][reference][device]") {
  // Kokkos::DefaultExecutionSpace is the GPU in a Cuda build (a host space otherwise).
  unsigned seed = 500;
  for (auto phi : all_phi) {
    TrellisCase c;
    c.phi = phi, c.chunk = 5, c.B = 2, c.lengths = {23, 9}, c.initial_state = true, c.zero_beta_every = 4,
    c.seed = ++seed;
    check_both_modes<Kokkos::DefaultExecutionSpace>(c);
  }
}

TEST_CASE("trellis: prefill with C = 1 and decode give the same bits", "[trellis][modes]") {
  for (auto phi : all_phi) {
    TrellisCase c;
    c.chunk = 1, c.phi = phi, c.seed = 11 + static_cast<unsigned>(phi), c.zero_beta_every = 5, c.initial_state = true;
    c.B = 3, c.lengths = {23, 17, 0};
    c.generate();
    INFO(describe(c));
    require_same_bits(run_trellis<host_exec>(c, Mode::prefill), run_trellis<host_exec>(c, Mode::decode));
  }
}

TEST_CASE("trellis: a prefill split at a multiple of C gives the same bits as one prefill", "[trellis][modes]") {
  for (long C : {1L, 3L, 4L}) {
    TrellisCase c;
    c.chunk = C, c.T = 26, c.seed = 21 + static_cast<unsigned>(C);
    c.generate();
    const auto whole = run_trellis<host_exec>(c, Mode::prefill);
    for (long split = 0; split <= c.T; split += C) {
      INFO(describe(c) << " split=" << split);
      require_same_bits(whole, run_trellis<host_exec>(c, Mode::prefill_split, split));
    }
  }
  // Not at a multiple of C: a different (legitimate) result, which the reference reproduces.
  TrellisCase c;
  c.chunk = 4, c.T = 26, c.seed = 5;
  c.generate();
  check_close(run_trellis<host_exec>(c, Mode::prefill_split, 6),
              reference(c, ref::Form::stale_gradient, 6, ref::Form::stale_gradient));
}

TEST_CASE("trellis: a prefill continued in decode follows the reference", "[trellis][modes]") {
  for (long C : {1L, 4L, 5L})
    for (long split : {0L, 5L, 8L, 20L, 23L}) {
      TrellisCase c;
      c.chunk = C, c.seed = 31 + static_cast<unsigned>(C + split), c.B = 2, c.lengths = {23, 14};
      c.generate();
      INFO(describe(c) << " split=" << split);
      check_close(run_trellis<host_exec>(c, Mode::prefill_then_decode, split),
                  reference(c, ref::Form::stale_gradient, split, ref::Form::recurrent));
      if (C == 1) require_same_bits(run_trellis<host_exec>(c, Mode::prefill_then_decode, split),
                                    run_trellis<host_exec>(c, Mode::decode));
    }
}

TEST_CASE("trellis: reruns give the same bits", "[trellis][determinism]") {
  TrellisCase c;
  c.T = 60, c.chunk = 8, c.B = 3, c.H = 3, c.m = 16;
  c.generate();
  require_same_bits(run_trellis<host_exec>(c, Mode::prefill), run_trellis<host_exec>(c, Mode::prefill));
  require_same_bits(run_trellis<host_exec>(c, Mode::decode), run_trellis<host_exec>(c, Mode::decode));
}

#ifdef KOKKOS_ENABLE_OPENMP
TEST_CASE("trellis: on one OpenMP thread and on every thread give the same bits", "[trellis][backends]") {
  for (long C : {1L, 5L, 16L}) {
    TrellisCase c;
    c.T = 70, c.chunk = C, c.B = 3, c.H = 2, c.m = 8, c.lengths = {70, 33, 1}, c.seed = 41 + static_cast<unsigned>(C);
    c.generate();
    for (Mode mode : {Mode::prefill, Mode::decode, Mode::prefill_then_decode}) {
      INFO("C=" << C << " mode=" << static_cast<int>(mode));
      require_same_bits(run_trellis(c, mode, 2 * C, Kokkos::OpenMP(1)), run_trellis(c, mode, 2 * C, Kokkos::OpenMP()));
    }
  }
}
#endif

#if defined(KOKKOS_ENABLE_SERIAL) && defined(KOKKOS_ENABLE_OPENMP)
TEST_CASE("trellis: on Serial and on OpenMP give the same bits", "[trellis][backends]") {
  TrellisCase c;
  c.T = 40, c.chunk = 6, c.B = 2, c.H = 2, c.m = 8;
  c.generate();
  for (Mode mode : {Mode::prefill, Mode::decode})
    require_same_bits(run_trellis<Kokkos::Serial>(c, mode), run_trellis<Kokkos::OpenMP>(c, mode));
}
#endif

// ---------------------------------------------------------------------------------------------------
// Bad input is answered on the host with an error naming the parameter and value

TEST_CASE("trellis: bad Trellis config fields are named", "[trellis][errors]") {
  auto good = [] {
    kvmem::TrellisConfig c;
    c.slots = 4, c.head_dim = 8, c.value_dim = 6, c.heads = 2, c.chunk = 4;
    return c;
  };
  REQUIRE_NOTHROW(good().validate());
  auto expect = [&](auto edit, const std::string& text) {
    auto c = good();
    edit(c);
    REQUIRE_THROWS_AS(c.validate(), kvmem::invalid_argument);
    REQUIRE_THROWS_WITH(c.validate(), ContainsSubstring(text));
    REQUIRE_THROWS_WITH((kvmem::TrellisMemory<host_exec>(c, 1)), ContainsSubstring(text));
  };
  expect([](auto& c) { c.slots = 0; }, "slots = 0");
  expect([](auto& c) { c.head_dim = 0; }, "head_dim = 0");
  expect([](auto& c) { c.value_dim = -1; }, "value_dim = -1");
  expect([](auto& c) { c.heads = 0; }, "heads = 0");
  expect([](auto& c) { c.chunk = 0; }, "chunk = 0");
  expect([](auto& c) { c.phi = static_cast<kvmem::merge::Phi>(9); }, "phi = 9: unknown phi");
  expect([](auto& c) { c.f = static_cast<kvmem::merge::Activation>(-1); }, "f = -1: unknown activation");
  expect([](auto& c) { c.grad_scale = 0.0f; }, "grad_scale = 0");
  expect([](auto& c) { c.ln_eps = 0.0f; }, "ln_eps = 0");
  expect([](auto& c) { c.l2_eps = -1.0f; }, "l2_eps = -1");
  REQUIRE_THROWS_WITH((kvmem::TrellisMemory<host_exec>(good(), 0)), ContainsSubstring("batch = 0"));
}

TEST_CASE("trellis: phi and f names are parsed or rejected by name", "[trellis][errors]") {
  REQUIRE(kvmem::merge::parse_phi("softmax") == kvmem::merge::Phi::softmax);
  REQUIRE(kvmem::merge::parse_activation("l2-silu") == kvmem::merge::Activation::l2_silu);
  REQUIRE(kvmem::merge::parse_activation("ln_silu") == kvmem::merge::Activation::ln_silu);
  for (auto phi : all_phi) REQUIRE(kvmem::merge::parse_phi(kvmem::merge::name_of(phi)) == phi);
  for (auto f : all_f) REQUIRE(kvmem::merge::parse_activation(kvmem::merge::name_of(f)) == f);
  REQUIRE_THROWS_WITH(kvmem::merge::parse_phi("gelu"), ContainsSubstring("phi = gelu: unknown phi"));
  REQUIRE_THROWS_WITH(kvmem::merge::parse_phi("relu", "--phi"), ContainsSubstring("--phi = relu"));
  REQUIRE_THROWS_WITH(kvmem::merge::parse_activation("ln"), ContainsSubstring("f = ln: unknown activation"));
}

TEST_CASE("trellis: bad Trellis shapes, lengths, gates, weights and states are named", "[trellis][errors]") {
  using space = host_exec::memory_space;
  using V4 = Kokkos::View<float****, space>;
  using V3 = Kokkos::View<float***, space>;
  kvmem::TrellisConfig cfg;
  cfg.slots = 4, cfg.head_dim = 8, cfg.value_dim = 6, cfg.heads = 2, cfg.chunk = 4;
  const long B = 2, H = 2, T = 5;
  V4 q("q", B, H, T, 8), k("k", B, H, T, 8), v("v", B, H, T, 6), a("alpha", B, H, T, 4), y("y", B, H, T, 6);
  V3 b1("beta1", B, H, T), g1("gamma1", B, H, T), b2("beta2", B, H, T), g2("gamma2", B, H, T);
  Kokkos::deep_copy(q, 0.3f);
  Kokkos::deep_copy(k, 0.3f);
  Kokkos::deep_copy(v, 0.3f);
  Kokkos::deep_copy(a, 0.3f);
  Kokkos::deep_copy(b1, 0.9f);
  Kokkos::deep_copy(g1, 0.1f);
  Kokkos::deep_copy(b2, 0.9f);
  Kokkos::deep_copy(g2, 0.1f);
  kvmem::TrellisMemory<host_exec> mem(cfg, static_cast<int>(B));
  REQUIRE_NOTHROW(mem.prefill(q, k, v, a, b1, g1, b2, g2, y));
  auto prefill_throws = [&](auto call, const std::string& text) {
    REQUIRE_THROWS_AS(call(), kvmem::invalid_argument);
    REQUIRE_THROWS_WITH(call(), ContainsSubstring(text));
  };
  prefill_throws([&] { mem.prefill(q, k, v, V4("alpha", B, H, T, 3), b1, g1, b2, g2, y); },
                 "alpha.extent(3) = 3: must equal the slot count m = 4");
  prefill_throws([&] { mem.prefill(q, V4("k", B, H, 4, 8), v, a, b1, g1, b2, g2, y); }, "k.extent(2) = 4");
  prefill_throws([&] { mem.prefill(q, k, V4("v", B, H, T, 5), a, b1, g1, b2, g2, y); }, "v.extent(3) = 5");
  prefill_throws([&] { mem.prefill(q, k, v, a, b1, g1, b2, g2, V4("y", B, H, T, 8)); }, "y.extent(3) = 8");
  prefill_throws([&] { mem.prefill(V4("q", 1, H, T, 8), k, v, a, b1, g1, b2, g2, y); }, "q.extent(0) = 1");
  prefill_throws([&] { mem.prefill(q, k, v, a, b1, V3("gamma1", B, 3, T), b2, g2, y); }, "gamma1.extent(1) = 3");
  prefill_throws([&] { mem.prefill(q, k, v, a, b1, g1, V3("beta2", B, H, 2), g2, y); }, "beta2.extent(2) = 2");
  const std::vector<long> too_long{5, 6}, negative{-1, 2}, one{3};
  prefill_throws([&] { mem.prefill(q, k, v, a, b1, g1, b2, g2, y, too_long); }, "lengths[1] = 6");
  prefill_throws([&] { mem.prefill(q, k, v, a, b1, g1, b2, g2, y, negative); }, "lengths[0] = -1");
  prefill_throws([&] { mem.prefill(q, k, v, a, b1, g1, b2, g2, y, one); }, "lengths.size() = 1");
  // Strided channels
  Kokkos::View<float*****, space> wide("wide", B, H, T, 8, 2);
  Kokkos::View<const float****, Kokkos::LayoutStride, space> strided =
      Kokkos::subview(wide, Kokkos::ALL, Kokkos::ALL, Kokkos::ALL, Kokkos::ALL, 0);
  prefill_throws([&] { mem.prefill(strided, k, v, a, b1, g1, b2, g2, y); }, "q.stride(3) = 2");
  // Gates out of range, reported with their index; the state is untouched.
  const auto before = host_copy(mem.m1());
  g1(1, 0, 3) = -0.5f;
  prefill_throws([&] { mem.prefill(q, k, v, a, b1, g1, b2, g2, y); }, "gamma1[1, 0, 3] = -0.5: a step size must be");
  const std::vector<long> short_lengths{5, 3};
  REQUIRE_NOTHROW(mem.prefill(q, k, v, a, b1, g1, b2, g2, y, short_lengths));  // token 3 of sequence 1 is unused
  g1(1, 0, 3) = 0.1f;
  b2(0, 1, 0) = 1.5f;
  prefill_throws([&] { mem.prefill(q, k, v, a, b1, g1, b2, g2, y); }, "beta2[0, 1, 0] = 1.5: a forget gate must be in [0, 1]");
  b2(0, 1, 0) = std::nanf("");
  prefill_throws([&] { mem.prefill(q, k, v, a, b1, g1, b2, g2, y); }, "beta2[0, 1, 0] = nan");
  b2(0, 1, 0) = 0.9f;
  g2(0, 0, 4) = std::numeric_limits<float>::infinity();
  prefill_throws([&] { mem.prefill(q, k, v, a, b1, g1, b2, g2, y); }, "gamma2[0, 0, 4] = inf");
  g2(0, 0, 4) = 0.1f;
  const auto first = std::make_pair(0L, 1L);
  auto s4 = [&](const V4& x) { return Kokkos::subview(x, Kokkos::ALL, Kokkos::ALL, first, Kokkos::ALL); };
  auto s3 = [&](const V3& x) { return Kokkos::subview(x, Kokkos::ALL, Kokkos::ALL, first); };
  g1(0, 1, 0) = -1.0f;
  prefill_throws([&] { mem.decode(s4(q), s4(k), s4(v), s4(a), s3(b1), s3(g1), s3(b2), s3(g2), s4(y)); },
                 "gamma1[0, 1, 0] = -1");
  const std::vector<unsigned char> only_second{0, 1};
  REQUIRE_NOTHROW(mem.decode(s4(q), s4(k), s4(v), s4(a), s3(b1), s3(g1), s3(b2), s3(g2), s4(y), only_second));
  g1(0, 1, 0) = 0.1f;
  // With check_gates off, nothing is read back and nothing is rejected.
  auto unchecked = cfg;
  unchecked.check_gates = false;
  kvmem::TrellisMemory<host_exec> fast(unchecked, static_cast<int>(B));
  g1(1, 1, 1) = -0.5f;
  REQUIRE_NOTHROW(fast.prefill(q, k, v, a, b1, g1, b2, g2, y));
  g1(1, 1, 1) = 0.1f;
  // Decode shapes
  prefill_throws([&] { mem.decode(q, k, v, a, b1, g1, b2, g2, y); }, "q.extent(2) = 5: decode takes one token");
  prefill_throws([&] { mem.decode(s4(q), s4(k), s4(v), s4(a), s3(b1), s3(g1), s3(b2), s3(g2), y); },
                 "y.extent(2) = 5");
  const std::vector<unsigned char> three{1, 1, 1};
  prefill_throws([&] { mem.decode(s4(q), s4(k), s4(v), s4(a), s3(b1), s3(g1), s3(b2), s3(g2), s4(y), three); },
                 "active.size() = 3");
  // States and weights
  REQUIRE(host_copy(mem.m1()) != before);  // the accepted calls above did run
  prefill_throws([&] { mem.set_state(V4("m1", B, H, 3, 8), V4("m2", B, H, 4, 6)); }, "m1.extent(2) = 3");
  prefill_throws([&] { mem.set_state(V4("m1", B, H, 4, 8), V4("m2", B, H, 4, 7)); }, "m2.extent(3) = 7");
  Kokkos::View<float*, space> w4("w", 4), w3("w", 3);
  prefill_throws([&] { (void)kvmem::TrellisMemory<host_exec>(cfg, {w3, w4}, 1); }, "ln_weight.extent(0) = 3");
  prefill_throws([&] { (void)kvmem::TrellisMemory<host_exec>(cfg, {w4, {}}, 1); }, "ln_weight/ln_bias");
  auto l2 = cfg;
  l2.f = kvmem::merge::Activation::l2_silu;
  prefill_throws([&] { (void)kvmem::TrellisMemory<host_exec>(l2, {w4, w4}, 1); }, "f = l2-silu");
  // reset() zeroes the state
  mem.reset();
  for (float x : host_copy(mem.m1())) REQUIRE(x == 0.0f);
  REQUIRE(mem.tokens(0) == 0);
}

// ---------------------------------------------------------------------------------------------------
// Storage types: inputs and outputs in bfloat16 / float16, the state and every sum float32

TEMPLATE_TEST_CASE("trellis over bfloat16 / float16 tokens matches the reference up to the output's rounding",
                   "[trellis][dtype]", kvmem::bfloat16, kvmem::float16) {
  // The inputs, rounded to the storage type, reach the reference as they reach the memory; the slots M1,
  // M2 and every sum are float32, so the state matches as closely as a float32 memory's does and y differs
  // further only by its own rounding, u relative (docs/numerics.md).
  using S = TestType;
  unsigned seed = 900;
  for (auto phi : {kvmem::merge::Phi::silu, kvmem::merge::Phi::softmax})
    for (long C : {1L, 4L}) {
      TrellisCase c;
      c.phi = phi, c.chunk = C, c.seed = ++seed, c.B = 2, c.lengths = {c.T, c.T / 2};
      c.f = phi == kvmem::merge::Phi::softmax ? kvmem::merge::Activation::l2_silu : kvmem::merge::Activation::ln_silu;
      c.generate();
      c.round_inputs<S>();
      INFO(describe(c));
      const double tol = tolerance + kvmem::unit_roundoff<S>;
      check_close(run_trellis<host_exec, S>(c, Mode::prefill), reference(c, ref::Form::stale_gradient, c.T, ref::Form::stale_gradient), tol);
      const auto decoded = run_trellis<host_exec, S>(c, Mode::decode);
      check_close(decoded, reference(c, ref::Form::recurrent, c.T, ref::Form::recurrent), tol);
      if (C == 1) require_same_bits(run_trellis<host_exec, S>(c, Mode::prefill), decoded);
    }
}
