#pragma once
// Naive float64 reference of the Trellis memory, written from shared/spec/TRELLIS.md (section numbers
// below refer to it) and independent of kvmem's kernels: one (sequence, head) at a time, states as plain
// row-major matrices, every state M_t materialized, phi's VJP through an explicit Jacobian matrix.
//   recurrent():      the exact per-token recurrence (§3.1), readout from M_t after the update (§2.4);
//   stale_gradient(): the loop form of §3.2, every gradient of chunk b taken at S_b, decay/accumulation exact.
// forward() runs both passes (§4): pass 1 over the whole block, p = f(yhat), then pass 2.

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

#include "float64_math.hpp"

namespace kvmem_ref::trellis {

enum class Phi { identity, silu, softmax, tanh, sigmoid };
enum class F { ln_silu, l2_silu, softmax, identity };
enum class Form { recurrent, stale_gradient };

using math::Vec;
using math::sigmoid;
using math::softmax;
/// Row-major matrix rows x cols.
struct Mat {
  long rows = 0, cols = 0;
  Vec a;
  Mat() = default;
  Mat(long r, long c) : rows(r), cols(c), a(static_cast<std::size_t>(r * c), 0.0) {}
  double& operator()(long i, long j) { return a[i * cols + j]; }
  double operator()(long i, long j) const { return a[i * cols + j]; }
};



/// phi(z) (§2.3).
inline Vec phi(Phi f, const Vec& z) {
  if (f == Phi::softmax) return softmax(z);
  Vec out(z.size());
  for (std::size_t i = 0; i < z.size(); ++i) {
    switch (f) {
      case Phi::identity: out[i] = z[i]; break;
      case Phi::silu: out[i] = z[i] * sigmoid(z[i]); break;
      case Phi::tanh: out[i] = std::tanh(z[i]); break;
      case Phi::sigmoid: out[i] = sigmoid(z[i]); break;
      default: break;
    }
  }
  return out;
}

/// The Jacobian J[i][j] = d phi_i / d z_j at z.
inline Mat jacobian(Phi f, const Vec& z) {
  const long n = static_cast<long>(z.size());
  Mat J(n, n);
  if (f == Phi::softmax) {
    const Vec p = softmax(z);
    for (long i = 0; i < n; ++i)
      for (long j = 0; j < n; ++j) J(i, j) = (i == j ? p[i] : 0.0) - p[i] * p[j];
    return J;
  }
  for (long i = 0; i < n; ++i) {
    const double s = sigmoid(z[i]), t = std::tanh(z[i]);
    switch (f) {
      case Phi::identity: J(i, i) = 1; break;
      case Phi::silu: J(i, i) = s + z[i] * s * (1 - s); break;
      case Phi::tanh: J(i, i) = 1 - t * t; break;
      case Phi::sigmoid: J(i, i) = s * (1 - s); break;
      default: break;
    }
  }
  return J;
}

/// J_phi(z)^T e through the explicit Jacobian.
inline Vec vjp(Phi f, const Vec& z, const Vec& e) {
  const Mat J = jacobian(f, z);
  Vec out(z.size(), 0.0);
  for (long j = 0; j < J.cols; ++j)
    for (long i = 0; i < J.rows; ++i) out[j] += J(i, j) * e[i];
  return out;
}

/// Parameters of one layer (§6 TrellisConfig).
struct Params {
  long m = 4, D = 8, Dv = 6;
  Phi phi = Phi::silu;
  F f = F::ln_silu;
  bool readout2_phi = true;
  double grad_scale = 2.0, ln_eps = 1e-5, l2_eps = 1e-12;
  Vec ln_weight, ln_bias;  // [m] or empty (no affine)
};

/// p = f(y) over the m slots (§4.1).
inline Vec activate(const Params& p, const Vec& y) {
  const std::size_t m = y.size();
  Vec a(m);
  switch (p.f) {
    case F::identity: return y;
    case F::softmax: return softmax(y);
    case F::ln_silu: {
      for (std::size_t i = 0; i < m; ++i) a[i] = y[i] * sigmoid(y[i]);
      double mean = 0, var = 0;
      for (double x : a) mean += x;
      mean /= double(m);
      for (double x : a) var += (x - mean) * (x - mean);
      var /= double(m);
      for (std::size_t i = 0; i < m; ++i) {
        a[i] = (a[i] - mean) / std::sqrt(var + p.ln_eps);
        if (!p.ln_weight.empty()) a[i] = a[i] * p.ln_weight[i] + p.ln_bias[i];
      }
      return a;
    }
    case F::l2_silu: {
      double n = 0;
      for (std::size_t i = 0; i < m; ++i) {
        a[i] = y[i] * sigmoid(y[i]);
        n += a[i] * a[i];
      }
      n = std::max(std::sqrt(n), p.l2_eps);
      for (auto& x : a) x /= n;
      return a;
    }
  }
  return a;
}

/// One compress pass (§2) over tokens [0, T): memory M [m x din], keys kin [T][din], targets A [T][m],
/// queries Qr [T][qdim]. Pass 1 (value_pass = false): readout M_t q_t (qdim = din, result [m]).
/// Pass 2 (value_pass = true): readout phi(M_t^T p_t) (qdim = m, result [din]; phi if readout2_phi).
/// Gradients are taken at M_{t-1} (chunk = 1: the recurrence §3.1) or at the state before the token's
/// chunk (chunk = C: the stale-gradient loop §3.2). M is updated in place.
inline std::vector<Vec> compress(Mat& M, const std::vector<Vec>& Qr, const std::vector<Vec>& kin,
                                 const std::vector<Vec>& A, const Vec& beta, const Vec& gamma, const Params& p,
                                 bool value_pass, long chunk) {
  const long T = static_cast<long>(kin.size()), m = M.rows, din = M.cols;
  std::vector<Vec> out(T);
  Mat S = M;  // stale state of the current chunk
  for (long t = 0; t < T; ++t) {
    if (t % chunk == 0) S = M;
    Vec z(m, 0.0);
    for (long s = 0; s < m; ++s)
      for (long c = 0; c < din; ++c) z[s] += S(s, c) * kin[t][c];
    const Vec ph = phi(p.phi, z);
    Vec e(m);
    for (long s = 0; s < m; ++s) e[s] = ph[s] - A[t][s];
    Vec u = vjp(p.phi, z, e);
    for (auto& x : u) x *= p.grad_scale;
    for (long s = 0; s < m; ++s)
      for (long c = 0; c < din; ++c) M(s, c) = beta[t] * M(s, c) - gamma[t] * u[s] * kin[t][c];
    if (!value_pass) {
      Vec r(m, 0.0);
      for (long s = 0; s < m; ++s)
        for (long c = 0; c < din; ++c) r[s] += M(s, c) * Qr[t][c];
      out[t] = r;
    } else {
      Vec r(din, 0.0);
      for (long c = 0; c < din; ++c)
        for (long s = 0; s < m; ++s) r[c] += M(s, c) * Qr[t][s];
      out[t] = p.readout2_phi ? phi(p.phi, r) : r;
    }
  }
  return out;
}

/// One (sequence, head): q, k [T][D], v [T][Dv], alpha [T][m], gates [T].
struct Head {
  std::vector<Vec> q, k, v, alpha;
  Vec beta1, gamma1, beta2, gamma2;
  /// Tokens [a, b) of this head.
  [[nodiscard]] Head slice(long a, long b) const {
    auto cut = [&](const auto& x) { return std::decay_t<decltype(x)>(x.begin() + a, x.begin() + b); };
    return {cut(q), cut(k), cut(v), cut(alpha), cut(beta1), cut(gamma1), cut(beta2), cut(gamma2)};
  }
};

/// Memories of one head: M1 [m x D], M2 [m x Dv]; zero initially (§1).
struct State {
  Mat m1, m2;
  explicit State(const Params& p) : m1(p.m, p.D), m2(p.m, p.Dv) {}
};

/// The two-pass layer (§4) over all tokens of `x`, continuing from `st`: returns y [T][Dv].
/// Form::recurrent ignores `chunk` (C = 1, §3.1); Form::stale_gradient uses chunks of `chunk` tokens
/// starting at token 0 of this call (§3.2).
inline std::vector<Vec> forward(const Head& x, const Params& p, State& st, Form form, long chunk = 1) {
  if (chunk < 1) throw std::invalid_argument("chunk must be >= 1");
  const long C = form == Form::recurrent ? 1 : chunk;
  const auto yhat = compress(st.m1, x.q, x.k, x.alpha, x.beta1, x.gamma1, p, false, C);
  std::vector<Vec> pp(yhat.size());
  for (std::size_t t = 0; t < yhat.size(); ++t) pp[t] = activate(p, yhat[t]);
  return compress(st.m2, pp, x.v, x.alpha, x.beta2, x.gamma2, p, true, C);
}

}  // namespace kvmem_ref::trellis
