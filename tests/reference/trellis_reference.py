"""Independent float64 reference of the Trellis memory, written from shared/spec/TRELLIS.md.

Section numbers refer to the spec. One (sequence, head) at a time:
  q, k [T, D], v [T, Dv], alpha [T, m], beta1, gamma1, beta2, gamma2 [T]; memories M1 [m, D], M2 [m, Dv].

  trellis_forward(q, k, v, alpha, beta1, gamma1, beta2, gamma2, m, C, phi, f, mode) -> (y [T, Dv], M1, M2)
    mode="recurrent": the exact per-token recurrence (§3.1); C is ignored (C = 1).
    mode="chunk":     the corrected chunkwise matrix form (§3.3) with chunks of C tokens from token 0.
    mode="loop":      the stale-gradient loop (§3.2), the definition the matrix form must reproduce.
  trellis_batch(tensors, m, C, phi, f, mode, lengths) applies it to [B, H, T, ...] tensors.

phi names: identity, silu, softmax, tanh, sigmoid (§2.3). f names: ln_silu, l2_silu, softmax, identity
(§4.1; "ln-silu"/"l2-silu" accepted). The factor 2 of the gradient is kept (grad_scale = 2, §7 A2); the
pass-2 readout applies phi (readout2_phi = True, §7 A6); the LayerNorm of LN-SiLU has no affine unless
ln_weight/ln_bias are given. omega is built from products of the betas and never divided (§3.3).
"""
import numpy as np

from float64_math import sigmoid, softmax  # noqa: F401 (re-exported)

PHIS = ("identity", "silu", "softmax", "tanh", "sigmoid")
FS = ("ln_silu", "l2_silu", "softmax", "identity")


def _fname(f):
    return f.replace("-", "_")




def phi_fn(name, z):
    """phi(z) over the last axis (§2.3)."""
    z = np.asarray(z, dtype=np.float64)
    if name == "identity":
        return z.copy()
    if name == "silu":
        return z * sigmoid(z)
    if name == "softmax":
        return softmax(z)
    if name == "tanh":
        return np.tanh(z)
    if name == "sigmoid":
        return sigmoid(z)
    raise ValueError(f"unknown phi {name!r}")


def vjp(name, z, e):
    """J_phi(z)^T e over the last axis, closed forms of the §2.3 table."""
    z, e = np.asarray(z, np.float64), np.asarray(e, np.float64)
    if name == "identity":
        return e.copy()
    if name == "silu":
        s = sigmoid(z)
        return e * s * (1 + z * (1 - s))
    if name == "tanh":
        return e * (1 - np.tanh(z) ** 2)
    if name == "sigmoid":
        s = sigmoid(z)
        return e * s * (1 - s)
    if name == "softmax":
        p = softmax(z)
        return p * (e - (p * e).sum(axis=-1, keepdims=True))
    raise ValueError(f"unknown phi {name!r}")


def f_act(name, y, ln_eps=1e-5, l2_eps=1e-12, ln_weight=None, ln_bias=None):
    """p = f(y) over the last axis (the m slots, §4.1)."""
    name = _fname(name)
    y = np.asarray(y, np.float64)
    if name == "identity":
        return y.copy()
    if name == "softmax":
        return softmax(y)
    a = y * sigmoid(y)
    if name == "ln_silu":
        mu = a.mean(axis=-1, keepdims=True)
        var = ((a - mu) ** 2).mean(axis=-1, keepdims=True)
        p = (a - mu) / np.sqrt(var + ln_eps)
        if ln_weight is not None:
            p = p * ln_weight + ln_bias
        return p
    if name == "l2_silu":
        n = np.sqrt((a * a).sum(axis=-1, keepdims=True))
        return a / np.maximum(n, l2_eps)
    raise ValueError(f"unknown f {name!r}")


def _grad(M, kin, A, phi, grad_scale):
    """Rows u_t = grad_scale * J^T (phi(M k_t) - alpha_t) for kin [L, din] (§2.2)."""
    Z = kin @ M.T
    return grad_scale * vjp(phi, Z, phi_fn(phi, Z) - A)


def _readout(M, Qr, value_pass, phi, readout_phi):
    """pass 1: Qr M^T ([L, m]); pass 2: phi(Qr M) ([L, din]) (§2.4)."""
    if not value_pass:
        return Qr @ M.T
    r = Qr @ M
    return phi_fn(phi, r) if readout_phi else r


def compress_recurrent(M, Qr, kin, A, beta, gamma, phi, value_pass, readout_phi=True, grad_scale=2.0):
    """§3.1: u_t at M_{t-1}; M_t = beta_t M_{t-1} - gamma_t u_t k_t^T; readout from M_t. Returns (R, M_T)."""
    M = np.array(M, np.float64)
    out = []
    for t in range(kin.shape[0]):
        u = _grad(M, kin[t:t + 1], A[t:t + 1], phi, grad_scale)[0]
        M = beta[t] * M - gamma[t] * np.outer(u, kin[t])
        out.append(_readout(M, Qr[t:t + 1], value_pass, phi, readout_phi)[0])
    return _stack(out, kin.shape[0], M, value_pass, Qr), M


def compress_loop(M, Qr, kin, A, beta, gamma, phi, C, value_pass, readout_phi=True, grad_scale=2.0):
    """§3.2 stale-gradient loop: every token of chunk b takes its gradient at S_b."""
    M = np.array(M, np.float64)
    out, S = [], M
    for t in range(kin.shape[0]):
        if t % C == 0:
            S = M.copy()
        u = _grad(S, kin[t:t + 1], A[t:t + 1], phi, grad_scale)[0]
        M = beta[t] * M - gamma[t] * np.outer(u, kin[t])
        out.append(_readout(M, Qr[t:t + 1], value_pass, phi, readout_phi)[0])
    return _stack(out, kin.shape[0], M, value_pass, Qr), M


def compress_chunk(M, Qr, kin, A, beta, gamma, phi, C, value_pass, readout_phi=True, grad_scale=2.0):
    """§3.3 chunkwise matrix form with omega from products of betas (no division)."""
    S = np.array(M, np.float64)
    T = kin.shape[0]
    out = []
    for b0 in range(0, T, C):
        K, Q, Al = kin[b0:b0 + C], Qr[b0:b0 + C], A[b0:b0 + C]
        bet, gam = beta[b0:b0 + C], gamma[b0:b0 + C]
        L = K.shape[0]
        U = _grad(S, K, Al, phi, grad_scale)                    # L x m, stale state S_b
        omega = np.zeros((L, L))
        for r in range(L):
            omega[r, r] = 1.0
            if r > 0:
                omega[r, :r] = omega[r - 1, :r] * bet[r]        # prod_{j=i+1..r} beta_j
        mu = bet[0] * omega[:, 0]                               # prod_{j=0..r} beta_j
        Gam = gam[None, :] * omega                              # lower triangular
        if not value_pass:
            R = mu[:, None] * (Q @ S.T) - (Gam * (Q @ K.T)) @ U      # L x m
        else:
            R = mu[:, None] * (Q @ S) - (Gam * (Q @ U.T)) @ K        # L x din
            if readout_phi:
                R = phi_fn(phi, R)
        out.append(R)
        S = mu[L - 1] * S - U.T @ (Gam[L - 1][:, None] * K)
    width = kin.shape[1] if value_pass else S.shape[0]
    return (np.concatenate(out) if out else np.zeros((0, width))), S


def _stack(rows, T, M, value_pass, Qr):
    if T:
        return np.array(rows)
    return np.zeros((0, M.shape[1] if value_pass else M.shape[0]))


def trellis_forward(q, k, v, alpha, beta1, gamma1, beta2, gamma2, m, C=16, phi="silu", f="ln_silu",
                    mode="chunk", M1=None, M2=None, readout2_phi=True, grad_scale=2.0, ln_eps=1e-5,
                    l2_eps=1e-12, ln_weight=None, ln_bias=None):
    """The two-pass layer (§4) for one (sequence, head). Returns (y [T, Dv], M1 [m, D], M2 [m, Dv])."""
    q, k, v, alpha = (np.asarray(x, np.float64) for x in (q, k, v, alpha))
    beta1, gamma1, beta2, gamma2 = (np.asarray(x, np.float64) for x in (beta1, gamma1, beta2, gamma2))
    M1 = np.zeros((m, k.shape[1])) if M1 is None else np.array(M1, np.float64)
    M2 = np.zeros((m, v.shape[1])) if M2 is None else np.array(M2, np.float64)
    if C < 1:
        raise ValueError("C must be >= 1")

    def run(M, Qr, kin, beta, gamma, value_pass):
        if mode == "recurrent":
            return compress_recurrent(M, Qr, kin, alpha, beta, gamma, phi, value_pass, readout2_phi, grad_scale)
        if mode == "loop":
            return compress_loop(M, Qr, kin, alpha, beta, gamma, phi, C, value_pass, readout2_phi, grad_scale)
        if mode == "chunk":
            return compress_chunk(M, Qr, kin, alpha, beta, gamma, phi, C, value_pass, readout2_phi, grad_scale)
        raise ValueError(f"unknown mode {mode!r}")

    yhat, M1 = run(M1, q, k, beta1, gamma1, False)
    p = f_act(f, yhat, ln_eps, l2_eps, ln_weight, ln_bias)
    y, M2 = run(M2, p, v, beta2, gamma2, True)
    return y, M1, M2


def trellis_batch(t, m, C=16, phi="silu", f="ln_silu", mode="chunk", lengths=None, **kw):
    """trellis_forward over tensors t (q, k [B,H,T,D], v [B,H,T,Dv], alpha [B,H,T,m], gates [B,H,T]).
    Sequence b uses tokens [0, lengths[b]); y past it is zero. Returns dict y, m1, m2 (float64)."""
    g = {n: np.asarray(t[n], np.float64) for n in
         ("q", "k", "v", "alpha", "beta1", "gamma1", "beta2", "gamma2")}
    B, H, T, D = g["q"].shape
    Dv = g["v"].shape[3]
    lens = [T] * B if lengths is None else [int(x) for x in lengths]
    out = dict(y=np.zeros((B, H, T, Dv)), m1=np.zeros((B, H, m, D)), m2=np.zeros((B, H, m, Dv)))
    for b in range(B):
        n = lens[b]
        for h in range(H):
            y, M1, M2 = trellis_forward(*(g[x][b, h, :n] for x in ("q", "k", "v", "alpha", "beta1", "gamma1",
                                                                   "beta2", "gamma2")),
                                        m=m, C=C, phi=phi, f=f, mode=mode, **kw)
            out["y"][b, h, :n], out["m1"][b, h], out["m2"][b, h] = y, M1, M2
    return out
