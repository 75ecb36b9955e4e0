#!/usr/bin/env python3
"""Independent float64 reference of fixed-budget KV eviction, written from shared/spec/EVICTION.md.

Section numbers refer to the spec. One (sequence, KV head) at a time, a GQA group of G query heads:
  q [G, T, D], k [T, D], v [T, Dv].

  simulate_decode(q, k, v, s, w, top_k, scorer, ...)   the §1 per-step state machine for every scorer
      -> Decode(y [G,T,Dv], sets (attended set A of every query, ascending), kept (A of the last step),
                min_gap (smallest non-zero relative gap of an eviction decision, see `Gap`))
  kvpop_scores(k, v, p, w, normalizer)                   §2 + §3 delayed mLSTM scores (recurrent form)
  kvpop_scores_parallel(...)                             the same from the closed parallel form (§3)
  static_key / ranks / fenwick_mask / brute_mask         §4 + §5 (n = 1 static keys, running top-k mask)
  snapkv_keep(q, k, W_obs, C_max)                        §6 SnapKV selection after a T-token prompt
  simulate_decode_tova_layer(q, k, v, s, w, top_k)       §6 TOVA layer mean (the original): all KV heads
      of one sequence at once, q [Hq,T,D], k [Hkv,T,D], v [Hkv,T,Dv]; one shared set of kept positions
  evict_reference(tensors, scorer, sinks, window, top_k, ...)
      the `kvmem-run evict` mapping over [B, H, T, ...] tensors with optional ragged `lengths`:
      dict y, kept_positions, kept_rows (and mask), plus the smallest decision gap.

Conventions: eviction removes the minimum of (eff, t) (ties: the newer token wins, §4); training-free
scorers use log γ = 0; H2O is the raw sum over the group from insertion (normalize: divided by G times
the number of queries that attended the token); TOVA is the group mean of the previous query's row
(tova_layer_mean: the mean over all Hq query heads of the layer, so every KV head evicts the same token);
SnapKV pools with avg_pool1d(5, stride 1, pad 2) counting the pads and averages over the group.

`python3 eviction_reference.py` runs the self-test (worked example, decode == Fenwick == brute force,
recurrent == parallel mLSTM, the H2O / TOVA / StreamingLLM mapping claims, SnapKV pooling).
"""
import math
import sys
from dataclasses import dataclass, field

import numpy as np

from float64_math import logsigmoid, sigmoid, softmax  # noqa: F401 (re-exported)

SCORERS = ("streaming", "knorm", "h2o", "tova", "snapkv", "kvpop")
STATIC = ("streaming", "knorm", "kvpop")
MASK_SCORERS = ("streaming", "knorm", "kvpop")   # --mask is defined for these (with n = 1)
GAMMA_MIN, GAMMA_MAX = 0.999, 0.999999             # App. E
SOFT_CAP, EPS = 15.0, 1e-6                         # §3
KVPOP_WEIGHTS = ("w_q", "w_k", "w_v", "w_i", "b_i", "w_f", "b_f", "w_s", "b_s", "theta")


# ---------------------------------------------------------------------------------------------- basics



def silu(z):
    return z * sigmoid(z)


def soft_cap(z, c=SOFT_CAP):
    """c * tanh(z / c); no cap when c <= 0 (§3)."""
    return c * np.tanh(z / c) if c > 0 else np.asarray(z, dtype=np.float64)


def hedgehog(y):
    """HH(y) = [softmax(y); softmax(-y)] over the last axis (h -> 2h)."""
    return np.concatenate([softmax(y), softmax(-y)], axis=-1)


def log_gamma(theta):
    """log γ_h = log γ_min + σ(θ_h)(log γ_max − log γ_min) (§4, App. E)."""
    lo, hi = math.log(GAMMA_MIN), math.log(GAMMA_MAX)
    return lo + sigmoid(theta) * (hi - lo)


def exact_attention(q, k, v):
    """Causal softmax attention: q [G,T,D], k [T,D], v [T,Dv] -> y [G,T,Dv]."""
    G, T, D = q.shape
    if T == 0:
        return np.zeros((G, 0, v.shape[1]))
    s = q @ k.T / math.sqrt(D)
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    return softmax(s) @ v


# ------------------------------------------------------------------------------------- §3 KVPOP mLSTM
def kvpop_head(weights, h):
    """The §3 parameters of KV head h from the weights file layout (w_q [Hkv, X, h], ..., theta [Hkv])."""
    return {n: np.asarray(weights[n], np.float64)[h] for n in KVPOP_WEIGHTS}


def _kvpop_inputs(k, v, p, cap):
    x = np.concatenate([k, v], axis=1)                                  # x_t = [k_t ; v_t]
    qf, kf, vf = hedgehog(x @ p["w_q"]), hedgehog(x @ p["w_k"]), x @ p["w_v"]
    ig = soft_cap(x @ p["w_i"] + p["b_i"], cap)
    logf = logsigmoid(soft_cap(x @ p["w_f"] + p["b_f"], cap))
    return qf, kf, vf, ig, logf


def _readout(qf_u, C, n, m, p, normalizer, eps):
    d = qf_u.shape[0]
    if normalizer == "xlstm":
        qq = qf_u / math.sqrt(d)
        h = (qq @ C) / (max(abs(float(qq @ n)), math.exp(-m)) + eps)
    elif normalizer == "plain":
        h = (qf_u @ C) / float(qf_u @ n)
    else:
        raise ValueError(f"unknown normalizer {normalizer!r}")
    return float(p["w_s"] @ silu(h) + p["b_s"])


def kvpop_scores(k, v, p, w, normalizer="xlstm", cap=SOFT_CAP, eps=EPS):
    """Delayed scores (§2): score_u read out with the state after absorbing token u+w-1.
    k [T,D], v [T,Dv], p = kvpop_head(...). Returns [T]; NaN for tokens never scored (u+w-1 >= T)."""
    T, D = k.shape
    qf, kf, vf, ig, logf = _kvpop_inputs(k, v, p, cap)
    C, n, m = np.zeros((D, vf.shape[1] if T else D // 2)), np.zeros(D), 0.0
    scores = np.full(T, np.nan)
    for t in range(T):
        m_new = max(logf[t] + m, ig[t])
        a, b = math.exp(logf[t] + m - m_new), math.exp(ig[t] - m_new)
        C = a * C + b * np.outer(kf[t], vf[t])
        n = a * n + b * kf[t]
        m = m_new
        u = t - w + 1
        if u >= 0:
            scores[u] = _readout(qf[u], C, n, m, p, normalizer, eps)
    return scores


def kvpop_scores_parallel(k, v, p, w, normalizer="xlstm", cap=SOFT_CAP, eps=EPS):
    """The same scores from the closed parallel form C_t = Σ_j exp(i~_j + F_t − F_j − m_t) kf_j vf_jᵀ,
    m_t = max(F_t, max_j(i~_j + F_t − F_j)) (§3); O(T²), for the self-test."""
    T, D = k.shape
    qf, kf, vf, ig, logf = _kvpop_inputs(k, v, p, cap)
    F = np.cumsum(logf)
    scores = np.full(T, np.nan)
    for u in range(T - w + 1):
        t = u + w - 1
        a = ig[:t + 1] + F[t] - F[:t + 1]
        m = max(F[t], a.max())
        e = np.exp(a - m)
        C = (kf[:t + 1] * e[:, None]).T @ vf[:t + 1]
        n = e @ kf[:t + 1]
        scores[u] = _readout(qf[u], C, n, m, p, normalizer, eps)
    return scores


def knorm_scores(k):
    """KNorm: −‖k_t‖₂ of the key as stored (§6)."""
    return -np.linalg.norm(k, axis=1)


# --------------------------------------------------------------------------------- §1 state machine
@dataclass
class Gap:
    """The smallest relative gap of an eviction (or selection) decision: (eff of the runner-up − eff of
    the evicted) / max |eff| over the candidates, over decisions where it is not exactly 0 (exact ties are
    settled by position and are safe). A tiny gap is a near-tie that float32 may not resolve. Decisions
    with a gap below RECORD are listed in `near` as (rel, b, h, q, text), b and h filled in by merge."""
    RECORD = 1e-4
    rel: float = math.inf
    where: str = ""
    near: list = field(default_factory=list)

    def update(self, effs, pos, i_min, q, label):
        if len(effs) < 2:
            return
        effs, pos = np.asarray(effs), np.asarray(pos)
        rest, rpos = np.delete(effs, i_min), np.delete(pos, i_min)
        j = int(np.argmin(rest))
        gap = float(rest[j] - effs[i_min])
        if gap == 0.0 or not np.isfinite(gap):
            return
        scale = float(np.max(np.abs(effs)))
        rel = gap / scale if scale > 0 else math.inf
        text = (f"{label} q={q}: evicted t={int(pos[i_min])} eff={effs[i_min]:.9g}, runner-up "
                f"t={int(rpos[j])} eff={rest[j]:.9g}, rel gap {rel:.2e}")
        if rel < self.RECORD and len(self.near) < 100:
            self.near.append((rel, None, None, q, text))
        if rel < self.rel:
            self.rel, self.where = rel, text

    def merge(self, other, b, h):
        self.near += [(r, b, h, q, f"b={b} h={h} {t}") for r, _, _, q, t in other.near]
        if other.rel < self.rel:
            self.rel, self.where = other.rel, f"b={b} h={h} {other.where}"


@dataclass
class Decode:
    y: np.ndarray
    kept: np.ndarray
    sets: list = field(default_factory=list)
    gap: Gap = field(default_factory=Gap)



def evict_min(R, pos, eff, gap, qi, what):
    """Removes from R the token with the lowest (eff, position) (§4: ties evict the older token) and records
    the decision gap."""
    i_min = int(np.lexsort((pos, eff))[0])
    gap.update(eff, pos, i_min, qi, what)
    R.remove(int(pos[i_min]))


def attended_set(R, s, w, qi):
    """Sinks, the retained set R and the window of step qi, in increasing position (§1)."""
    return np.concatenate([np.arange(0, min(s, qi + 1)), np.sort(np.array(R, np.int64)),
                           np.arange(max(s, qi - w + 1), qi + 1)]).astype(np.int64)

def simulate_decode(q, k, v, s, w, top_k, scorer, scores=None, log_gamma=0.0, n=1, h2o_normalize=False,
                    keep_sets=True):
    """The §1 decode state machine for one KV head. q [G,T,D], k [T,D], v [T,Dv].
    Static scorers (streaming, knorm, kvpop) read `scores` [T] (defaults: streaming 0, knorm −‖k‖) with
    eff_t(q) = score_t + floor((q−t)/n)·log γ; h2o and tova keep their statistics from step 4."""
    if w < 1 or top_k < 0 or s < 0 or n < 1:
        raise ValueError("need w >= 1, top_k >= 0, s >= 0, n >= 1")
    G, T, D = q.shape
    Dv = v.shape[1]
    if scorer == "streaming" and scores is None:
        scores = np.zeros(T)
    if scorer == "knorm" and scores is None:
        scores = knorm_scores(k)
    if scorer in STATIC and scores is None:
        raise ValueError(f"{scorer}: scores needed")
    if scorer not in STATIC + ("h2o", "tova"):
        raise ValueError(f"simulate_decode: unknown scorer {scorer!r}")
    y = np.zeros((G, T, Dv))
    acc, cnt, last = np.zeros(T), np.zeros(T), np.zeros(T)
    R, sets, gap, A = [], [], Gap(), np.zeros(0, np.int64)
    for qi in range(T):
        t_new = qi - w                                               # 2. leaves the window
        if t_new >= s:
            R.append(t_new)
        while len(R) > top_k:                                        # 3. evict the min of (eff, t)
            pos = np.array(R)
            if scorer in STATIC:
                sc = scores[pos]
                if np.any(np.isnan(sc)):
                    raise AssertionError(f"score of token {pos[np.isnan(sc)]} not ready at step {qi}")
                eff = sc + np.floor((qi - pos) / n) * log_gamma if log_gamma != 0.0 else sc.copy()
            elif scorer == "h2o":
                eff = acc[pos] / (G * cnt[pos]) if h2o_normalize else acc[pos].copy()
            else:
                eff = last[pos].copy()
            evict_min(R, pos, eff, gap, qi, "eviction at step")
        A = attended_set(R, s, w, qi)
        p = softmax(q[:, qi] @ k[A].T / math.sqrt(D))                 # 4. attend, [G, |A|]
        y[:, qi] = p @ v[A]
        if scorer == "h2o":                                          # 5. dynamic statistics
            acc[A] += p.sum(axis=0)
            cnt[A] += 1
        elif scorer == "tova":
            last[:] = 0.0
            last[A] = p.mean(axis=0)
        if keep_sets:
            sets.append(A)
    return Decode(y=y, kept=A, sets=sets, gap=gap)


def simulate_decode_tova_layer(q, k, v, s, w, top_k, keep_sets=True):
    """TOVA with the original's layer mean (§6), one sequence, all KV heads together.
    q [Hq,T,D], k [Hkv,T,D], v [Hkv,T,Dv], Hq = G·Hkv (query head j reads KV head j // G).
    The score of token t at step q is the mean over ALL Hq query heads of p_{q−1→t} (0 if t was not
    attended at q−1); one R for the sequence, so every KV head evicts the same token: the minimum of
    (score, t) (ties: the older token is evicted). Written as the mean over the Hq rows directly, not as
    a sum of per-KV-head group means (the same order, since every group has G heads).
    Returns Decode(y [Hq,T,Dv], kept (shared by every KV head), sets, gap)."""
    if w < 1 or top_k < 0 or s < 0:
        raise ValueError("need w >= 1, top_k >= 0, s >= 0")
    Hq, T, D = q.shape
    Hkv, Dv = k.shape[0], v.shape[2]
    if Hq % Hkv:
        raise ValueError("Hq must be a multiple of Hkv")
    G = Hq // Hkv
    y = np.zeros((Hq, T, Dv))
    last = np.zeros(T)
    R, sets, gap, A = [], [], Gap(), np.zeros(0, np.int64)
    for qi in range(T):
        t_new = qi - w
        if t_new >= s:
            R.append(t_new)
        while len(R) > top_k:
            pos = np.array(R)
            eff = last[pos].copy()
            evict_min(R, pos, eff, gap, qi, "layer-mean eviction at step")
        A = attended_set(R, s, w, qi)
        rows = np.zeros((Hq, len(A)))
        for j in range(Hq):
            h = j // G
            p = softmax(q[j, qi] @ k[h, A].T / math.sqrt(D))
            y[j, qi] = p @ v[h, A]
            rows[j] = p
        last[:] = 0.0
        last[A] = rows.mean(axis=0)
        if keep_sets:
            sets.append(A)
    return Decode(y=y, kept=A, sets=sets, gap=gap)


def sets_to_mask(sets, T):
    m = np.zeros((T, T), bool)
    for qi, A in enumerate(sets):
        m[qi, A] = True
    return m


# ------------------------------------------------------------------------------------ §4/§5 Fenwick
def static_key(scores, log_gamma=0.0):
    """κ_t = score_t − t·log γ (n = 1); tokens never scored (NaN) get −inf (they are never eligible)."""
    sc = np.where(np.isnan(scores), -np.inf, scores)
    return sc - np.arange(len(sc)) * log_gamma if log_gamma != 0.0 else sc


def ranks(kappa):
    """rank(t): position of t in the descending order of (κ_t, t) (newer first among ties)."""
    S = len(kappa)
    order = np.lexsort((-np.arange(S), -np.asarray(kappa, np.float64)))
    r = np.empty(S, np.int64)
    r[order] = np.arange(S)
    return r


def fenwick_mask(kappa, s, w, top_k):
    """§5: running top-k mask by a Fenwick tree with binary lifting. Returns (mask [S,S] bool, tau [S])."""
    S = len(kappa)
    rank = ranks(kappa)
    tree = np.zeros(S + 1, np.int64)
    top = 1 << (S.bit_length() - 1) if S else 0
    mask, tau, count, t = np.zeros((S, S), bool), np.zeros(S), 0, np.arange(S)
    for qi in range(S):
        t_new = qi - w
        if t_new >= s:
            i = int(rank[t_new]) + 1
            while i <= S:
                tree[i] += 1
                i += i & -i
            count += 1
        if top_k == 0:
            th = -1.0
        elif count <= top_k:
            th = math.inf
        else:
            pos, rem, step = 0, top_k, top
            while step:
                if pos + step <= S and tree[pos + step] < rem:
                    pos += step
                    rem -= tree[pos]
                step >>= 1
            th = float(pos)
        tau[qi] = th
        mask[qi] = (t <= qi) & ((t < s) | (qi - t < w) | ((t >= s) & (t <= qi - w) & (rank <= th)))
    return mask, tau


def brute_mask(kappa, s, w, top_k):
    """Per query: sinks ∪ window ∪ the top-k of E(q) by (κ, t), recomputed from scratch."""
    S = len(kappa)
    mask = np.zeros((S, S), bool)
    for qi in range(S):
        mask[qi, :min(s, qi + 1)] = True
        mask[qi, max(0, qi - w + 1):qi + 1] = True
        E = np.arange(s, qi - w + 1)
        if len(E) and top_k:
            best = E[np.lexsort((-E, -kappa[E]))][:top_k]
            mask[qi, best] = True
    return mask


# ------------------------------------------------------------------------------------------ §6 SnapKV
def snapkv_scores(q, k, W_obs, kernel=5):
    """Pooled votes of the prefix t < T − W_obs: Σ_{i in the last W_obs queries} p_{i→t} (causal
    softmax over all keys), avg-pooled (kernel, stride 1, zero pads counted), mean over the group."""
    G, T, D = q.shape
    P = T - W_obs
    lo = max(P, 0)
    s = q[:, lo:] @ k.T / math.sqrt(D)                                # [G, W, T]
    causal = np.arange(T)[None, :] <= np.arange(lo, T)[:, None]
    p = softmax(np.where(causal[None], s, -np.inf))
    vote = p[:, :, :max(P, 0)].sum(axis=1)                           # [G, P]
    pad = kernel // 2
    padded = np.pad(vote, ((0, 0), (pad, pad)))
    pooled = sum(padded[:, j:j + max(P, 0)] for j in range(kernel)) / kernel
    return pooled.mean(axis=0)


def snapkv_keep(q, k, W_obs, C_max, gap=None):
    """Positions kept after the prompt: all if T <= C_max, else the top C_max − W_obs of the prefix by
    (score, t) (ties: newer kept) plus the last W_obs tokens; ascending."""
    T = k.shape[0]
    if T <= C_max:
        return np.arange(T, dtype=np.int64)
    P, kk = T - W_obs, C_max - W_obs
    sc = snapkv_scores(q, k, W_obs)
    order = np.lexsort((-np.arange(P), -sc))
    if gap is not None and kk > 0:   # decision: the last kept vs the first dropped
        effs, pos = sc[order[kk - 1:kk + 1]][::-1], order[kk - 1:kk + 1][::-1]
        gap.update(effs, pos, 0, T - 1, f"snapkv boundary (C_max={C_max}) after")
    return np.sort(np.concatenate([order[:kk], np.arange(P, T)])).astype(np.int64)


# ------------------------------------------------------------------------------ kvmem-run evict mapping
def evict_reference(t, scorer, sinks, window, top_k, weights=None, decay_interval=1, normalizer="xlstm",
                    h2o_normalize=False, want_mask=False, check_mask=True, tova_layer_mean=False):
    """`kvmem-run evict` over tensors t: q [B,Hq,T,D], k [B,Hkv,T,D], v [B,Hkv,T,Dv], optional lengths [B].
    Returns (outputs, gap): outputs = dict y [B,Hq,T,Dv] float64, kept_positions [B,Hkv,K] int64 (−1 past
    kept_rows), kept_rows [B,Hkv] int64, and mask [B,Hkv,T,T] uint8 when want_mask (the §5 Fenwick mask of
    the static keys; with check_mask it must equal the attended sets of the decode state machine).
    tova_layer_mean (scorer tova only): the original's layer mean, every KV head of a sequence keeps the
    same positions; near-ties are recorded with h = "all"."""
    q, k, v = (np.asarray(t[n], np.float64) for n in ("q", "k", "v"))
    B, Hq, T, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[3]
    if Hq % Hkv:
        raise ValueError("Hq must be a multiple of Hkv")
    G = Hq // Hkv
    lens = [T] * B if t.get("lengths") is None else [int(x) for x in t["lengths"]]
    y = np.zeros((B, Hq, T, Dv))
    mask = np.zeros((B, Hkv, T, T), np.uint8) if want_mask else None
    kept, gap = {}, Gap()
    if tova_layer_mean and scorer != "tova":
        raise ValueError("tova_layer_mean needs scorer tova")
    if tova_layer_mean and want_mask:
        raise ValueError("--mask is defined for streaming, knorm and kvpop with n = 1")
    for b in range(B):
        L = lens[b]
        if tova_layer_mean:
            res = simulate_decode_tova_layer(q[b, :, :L], k[b, :, :L], v[b, :, :L], sinks, window, top_k,
                                             keep_sets=False)
            y[b, :, :L] = res.y
            for h in range(Hkv):
                kept[b, h] = res.kept.copy() if L else np.zeros(0, np.int64)
            gap.merge(res.gap, b, "all")
            continue
        for h in range(Hkv):
            Q, K, V = q[b, h * G:(h + 1) * G, :L], k[b, h, :L], v[b, h, :L]
            if scorer == "snapkv":
                y[b, h * G:(h + 1) * G, :L] = exact_attention(Q, K, V)
                g = Gap()
                kept[b, h] = snapkv_keep(Q, K, window, window + top_k, gap=g)
                gap.merge(g, b, h)
                continue
            scores, lg, n = None, 0.0, 1
            if scorer == "kvpop":
                p = kvpop_head(weights, h)
                scores, lg, n = kvpop_scores(K, V, p, window, normalizer), float(log_gamma(p["theta"])), decay_interval
            res = simulate_decode(Q, K, V, sinks, window, top_k, scorer, scores=scores, log_gamma=lg, n=n,
                                  h2o_normalize=h2o_normalize, keep_sets=want_mask and check_mask)
            y[b, h * G:(h + 1) * G, :L] = res.y
            kept[b, h] = res.kept if L else np.zeros(0, np.int64)
            gap.merge(res.gap, b, h)
            if want_mask:
                if scorer not in MASK_SCORERS or n != 1:
                    raise ValueError("--mask is defined for streaming, knorm and kvpop with n = 1")
                sc = scores if scores is not None else (np.zeros(L) if scorer == "streaming" else knorm_scores(K))
                m, _ = fenwick_mask(static_key(sc, lg), sinks, window, top_k)
                if check_mask and not np.array_equal(m, sets_to_mask(res.sets, L)):
                    raise AssertionError(f"reference: Fenwick mask != decode attended sets at b={b} h={h}")
                mask[b, h, :L, :L] = m
    rows = np.array([[len(kept[b, h]) for h in range(Hkv)] for b in range(B)], np.int64).reshape(B, Hkv)
    Kmax = int(rows.max()) if rows.size else 0
    pos = np.full((B, Hkv, Kmax), -1, np.int64)
    for (b, h), kp in kept.items():
        pos[b, h, :len(kp)] = kp
    out = dict(y=y, kept_positions=pos, kept_rows=rows)
    if want_mask:
        out["mask"] = mask
    return out, gap


def random_kvpop_weights(rng, Hkv, D, Dv, scale=0.3, theta=None, dtype=np.float32):
    """Random weights in the `--weights` layout (h = D/2, X = D + Dv), N(0, scale) entries; theta [Hkv]
    N(0, 2) unless given (a number or an array)."""
    h, X = D // 2, D + Dv
    shapes = dict(w_q=(Hkv, X, h), w_k=(Hkv, X, h), w_v=(Hkv, X, h), w_i=(Hkv, X), b_i=(Hkv,),
                  w_f=(Hkv, X), b_f=(Hkv,), w_s=(Hkv, h), b_s=(Hkv,))
    wts = {n: scale * rng.standard_normal(sh) for n, sh in shapes.items()}
    wts["b_f"] = wts["b_f"] + 2.0          # forget gates mostly open, as after training
    wts["theta"] = 2.0 * rng.standard_normal(Hkv) if theta is None else np.broadcast_to(
        np.asarray(theta, np.float64), (Hkv,)).copy()
    return {n: a.astype(dtype) for n, a in wts.items()}


# -------------------------------------------------------------------------------------------- self-test
def _h2o_original(q, k, v, heavy, recent):
    """H2O's loop (modify_llama.py): attend over the cache plus the new token, add the group-summed row to
    the scores, then keep the last `recent` entries and the top `heavy` of the rest (ties: newer kept).
    Returns (y, attended sets)."""
    G, T, D = q.shape
    y, acc, cache, sets = np.zeros((G, T, v.shape[1])), np.zeros(T), [], []
    for qi in range(T):
        cache.append(qi)
        A = np.array(cache)
        p = softmax(q[:, qi] @ k[A].T / math.sqrt(D))
        y[:, qi] = p @ v[A]
        acc[A] += p.sum(axis=0)
        sets.append(A)
        if len(cache) > heavy + recent:
            old, keep_recent = A[:len(A) - recent], cache[len(cache) - recent:]
            top = old[np.lexsort((-old, -acc[old]))][:heavy]
            cache = sorted(top.tolist()) + keep_recent
    return y, sets


def _tova_original(q, k, v, cache_size):
    """TOVA's loop: attend, then while the cache exceeds its size drop the token with the lowest mean
    (over heads) attention of the current query (ties: newer kept)."""
    G, T, D = q.shape
    y, cache, sets = np.zeros((G, T, v.shape[1])), [], []
    for qi in range(T):
        cache.append(qi)
        A = np.array(cache)
        p = softmax(q[:, qi] @ k[A].T / math.sqrt(D))
        y[:, qi] = p @ v[A]
        sets.append(A)
        if len(cache) > cache_size:
            sc = p.mean(axis=0)
            cache.remove(int(A[np.lexsort((A, sc))[0]]))
    return y, sets


def _tova_layer_original(q, k, v, cache_size):
    """TOVA's loop with its layer mean: q [Hq,T,D] over Hkv = k.shape[0] KV heads; attend every head over
    the one shared cache, then drop the token with the lowest mean over all Hq heads of the current
    query's attention (ties: newer kept). Returns (y [Hq,T,Dv], attended sets)."""
    Hq, T, D = q.shape
    G = Hq // k.shape[0]
    y, cache, sets = np.zeros((Hq, T, v.shape[2])), [], []
    for qi in range(T):
        cache.append(qi)
        A = np.array(cache)
        P = np.stack([softmax(q[j, qi] @ k[j // G, A].T / math.sqrt(D)) for j in range(Hq)])
        for j in range(Hq):
            y[j, qi] = P[j] @ v[j // G, A]
        sets.append(A)
        if len(cache) > cache_size:
            cache.remove(int(A[np.lexsort((A, P.mean(axis=0)))[0]]))
    return y, sets


def self_test(seed=7):
    rng = np.random.default_rng(seed)
    results = []

    def check(name, ok, info=""):
        results.append(bool(ok))
        print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + info if info else ''}", flush=True)

    def rand_head(G, T, D=4, Dv=3):
        return rng.standard_normal((G, T, D)), rng.standard_normal((T, D)), rng.standard_normal((T, Dv))

    # 1. the worked example of §1
    sc = np.array([9, 5, 1, 3, 3, 0, 2], float)
    q, k, v = rand_head(1, 7)
    r = simulate_decode(q, k, v, 1, 2, 2, "kvpop", scores=sc)
    want = [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3, 4], [0, 1, 3, 4, 5], [0, 1, 4, 5, 6]]
    check("worked example: attended sets", [a.tolist() for a in r.sets] == want,
          str([a.tolist() for a in r.sets]))
    check("worked example: kept_positions = [0, 1, 4, 5, 6]", r.kept.tolist() == [0, 1, 4, 5, 6])
    fm, _ = fenwick_mask(static_key(sc), 1, 2, 2)
    check("worked example: Fenwick mask = the same sets", np.array_equal(fm, sets_to_mask(r.sets, 7)))

    # 2. decode == Fenwick == brute force, static scores with many ties, log γ in {0, -0.5, -1}, n = 1
    bad, trials = [], 0
    for _ in range(400):
        T = int(rng.integers(0, 40))
        s, w, kk = int(rng.integers(0, 5)), int(rng.integers(1, 7)), int(rng.integers(0, 8))
        lg = float(rng.choice([0.0, -0.5, -1.0]))
        sc = rng.integers(0, 4, T).astype(float)
        q, k, v = rand_head(2, T)
        r = simulate_decode(q, k, v, s, w, kk, "kvpop", scores=sc, log_gamma=lg)
        kap = static_key(sc, lg)
        dm = sets_to_mask(r.sets, T)
        fm, _ = fenwick_mask(kap, s, w, kk)
        bm = brute_mask(kap, s, w, kk)
        trials += 1
        if not (np.array_equal(dm, fm) and np.array_equal(dm, bm)):
            bad.append((T, s, w, kk, lg))
        if T and not np.array_equal(r.kept, np.flatnonzero(fm[T - 1])):
            bad.append(("kept", T, s, w, kk, lg))
    check(f"decode == Fenwick == brute force ({trials} random heads with ties)", not bad, str(bad[:3]))
    # every mask row has at most B = s + w + k ones; y from the sets = masked attention
    T, s, w, kk = 50, 3, 4, 5
    q, k, v = rand_head(3, T)
    sc = rng.integers(0, 3, T).astype(float)
    r = simulate_decode(q, k, v, s, w, kk, "kvpop", scores=sc, log_gamma=-0.25)
    fm, _ = fenwick_mask(static_key(sc, -0.25), s, w, kk)
    logits = np.where(fm[None], q @ k.T / 2.0, -np.inf)
    check("mask rows have <= s + w + k ones; masked attention = decode y",
          fm.sum(1).max() <= s + w + kk and np.allclose(softmax(logits) @ v, r.y, rtol=0, atol=1e-13))

    # 3. n > 1: eff evaluated at each eviction (the floor); n = 1 with scores equal to the keys is q-invariant
    q, k, v = rand_head(1, 60)
    sc = rng.standard_normal(60)
    r1 = simulate_decode(q, k, v, 2, 3, 6, "kvpop", scores=sc, log_gamma=-0.3, n=3)
    R_prev, ok = set(), True
    for qi, A in enumerate(r1.sets):   # no evicted token comes back; R is within budget
        R = set(A.tolist()) - set(range(2)) - set(range(qi - 2, qi + 1))
        ok &= len(R) <= 6 and (R - R_prev) <= {qi - 3}
        R_prev = R
    check("n = 3: R within budget, evicted tokens never return", ok)

    # 4. mLSTM: recurrent == closed parallel form, both normalisers, with and without the soft cap
    worst = 0.0
    for i in range(24):
        T, w = int(rng.integers(1, 30)), int(rng.integers(1, 6))
        D, Dv = int(rng.choice([2, 4, 8])), int(rng.choice([2, 3, 8]))
        wts = random_kvpop_weights(rng, 1, D, Dv, scale=float(rng.choice([0.3, 1.0, 3.0])), dtype=np.float64)
        p = kvpop_head(wts, 0)
        k, v = rng.standard_normal((T, D)), rng.standard_normal((T, Dv))
        for norm in ("xlstm", "plain"):
            for cap in (SOFT_CAP, 0.0):
                a = kvpop_scores(k, v, p, w, norm, cap)
                b = kvpop_scores_parallel(k, v, p, w, norm, cap)
                same_nan = np.array_equal(np.isnan(a), np.isnan(b)) and np.isnan(a).sum() == min(T, w - 1)
                d = np.abs(a - b)[~np.isnan(a)]
                worst = max(worst, float(d.max() / max(1.0, np.abs(b[~np.isnan(b)]).max())) if d.size else 0.0,
                            0.0 if same_nan else math.inf)
    check("mLSTM recurrence == closed parallel form (xlstm, plain; cap 15 and none)", worst < 1e-10,
          f"worst rel {worst:.1e}")
    # m cancels in the plain form: a huge input gate (no cap) gives the same plain scores
    wts = random_kvpop_weights(rng, 1, 4, 4, dtype=np.float64)
    p = kvpop_head(wts, 0)
    k, v = rng.standard_normal((20, 4)), rng.standard_normal((20, 4))
    p2 = dict(p, b_i=p["b_i"] + 30.0)
    a, b = kvpop_scores(k, v, p, 3, "plain", 0.0), kvpop_scores(k, v, p2, 3, "plain", 0.0)
    check("plain normaliser: a constant shift of the input gate cancels",
          np.allclose(a, b, rtol=1e-11, atol=1e-12, equal_nan=True))
    check("log γ range: θ → −∞ gives log 0.999, θ → +∞ log 0.999999, θ = 0 the midpoint",
          abs(log_gamma(-50) - math.log(0.999)) < 1e-15 and abs(log_gamma(50) - math.log(0.999999)) < 1e-15
          and abs(log_gamma(0.0) - 0.5 * (math.log(0.999) + math.log(0.999999))) < 1e-15)

    # 5. mapping claims of §6: StreamingLLM = sinks + window of w + k; H2O(heavy, recent) = (0, recent+1,
    #    heavy); TOVA(B) = (0, 1, B); k = 0 and s + w >= T
    bad = 0
    for _ in range(40):
        T, s = int(rng.integers(1, 40)), int(rng.integers(0, 4))
        w, kk = int(rng.integers(1, 6)), int(rng.integers(0, 6))
        q, k, v = rand_head(2, T)
        a = simulate_decode(q, k, v, s, w, kk, "streaming")
        b = simulate_decode(q, k, v, s, w + kk, 0, "knorm")
        bad += not (all(np.array_equal(x, y_) for x, y_ in zip(a.sets, b.sets)) and np.allclose(a.y, b.y, atol=1e-14))
    check("StreamingLLM = sinks + sliding window of w + k", bad == 0, f"{bad} mismatches")
    bad = 0
    for G in (1, 3):
        for _ in range(25):
            T, heavy, recent = int(rng.integers(1, 40)), int(rng.integers(0, 6)), int(rng.integers(0, 6))
            q, k, v = rand_head(G, T)
            y0, sets0 = _h2o_original(q, k, v, heavy, recent)
            r = simulate_decode(q, k, v, 0, recent + 1, heavy, "h2o")
            bad += not (all(np.array_equal(x, y_) for x, y_ in zip(sets0, r.sets)) and np.allclose(y0, r.y, atol=1e-13))
    check("H2O(heavy, recent) = policy (s=0, w=recent+1, k=heavy), G = 1 and 3", bad == 0, f"{bad} mismatches")
    bad = 0
    for G in (1, 4):
        for _ in range(25):
            T, Bc = int(rng.integers(1, 40)), int(rng.integers(1, 8))
            q, k, v = rand_head(G, T)
            y0, sets0 = _tova_original(q, k, v, Bc)
            r = simulate_decode(q, k, v, 0, 1, Bc, "tova")
            bad += not (all(np.array_equal(x, y_) for x, y_ in zip(sets0, r.sets)) and np.allclose(y0, r.y, atol=1e-13))
    check("TOVA(cache B) = policy (s=0, w=1, k=B), group mean, G = 1 and 4", bad == 0, f"{bad} mismatches")
    ok = True
    for scorer in ("streaming", "knorm", "h2o", "tova"):
        q, k, v = rand_head(2, 12)
        ex = exact_attention(q, k, v)
        for s, w in ((12, 1), (0, 12), (5, 7), (20, 30)):
            r = simulate_decode(q, k, v, s, w, 3, scorer)
            ok &= np.allclose(r.y, ex, atol=1e-13) and r.kept.tolist() == list(range(12))
        r = simulate_decode(q, k, v, 2, 3, 0, scorer)
        ok &= all(A.tolist() == sorted(set(range(min(2, i + 1))) | set(range(max(0, i - 2), i + 1)))
                  for i, A in enumerate(r.sets))
    check("s + w >= T is causal attention; k = 0 is sinks + window (every scorer)", ok)

    # 5b. TOVA layer mean: the original loop; Hkv = 1 is the group mean; all keys equal -> the oldest goes
    bad = 0
    for Hkv, G in ((1, 1), (2, 1), (2, 2), (3, 2), (3, 1)):
        for _ in range(15):
            T, Bc = int(rng.integers(1, 40)), int(rng.integers(1, 8))
            q, k, v = (rng.standard_normal((Hkv * G, T, 4)), rng.standard_normal((Hkv, T, 4)),
                       rng.standard_normal((Hkv, T, 3)))
            y0, sets0 = _tova_layer_original(q, k, v, Bc)
            r = simulate_decode_tova_layer(q, k, v, 0, 1, Bc)
            bad += not (all(np.array_equal(x, y_) for x, y_ in zip(sets0, r.sets)) and np.allclose(y0, r.y, atol=1e-13))
    check("TOVA layer mean (cache B) = original loop over all heads (s=0, w=1, k=B), Hkv 1-3, G 1-2",
          bad == 0, f"{bad} mismatches")
    bad = 0
    for G in (1, 3):
        for _ in range(20):
            T, s, w, kk = int(rng.integers(1, 40)), int(rng.integers(0, 4)), int(rng.integers(1, 5)), int(rng.integers(0, 7))
            q, k, v = rand_head(G, T)
            a = simulate_decode(q, k, v, s, w, kk, "tova")
            b = simulate_decode_tova_layer(q, k[None], v[None], s, w, kk)
            bad += not (all(np.array_equal(x, y_) for x, y_ in zip(a.sets, b.sets)) and np.allclose(a.y, b.y, atol=1e-14))
    check("TOVA layer mean with Hkv = 1 = group-mean tova", bad == 0, f"{bad} mismatches")
    T, s, w, kk = 30, 1, 2, 4
    q, k, v = rng.standard_normal((4, T, 4)), np.tile(rng.standard_normal((1, 1, 4)), (2, T, 1)), rng.standard_normal((2, T, 3))
    r = simulate_decode_tova_layer(q, k, v, s, w, kk)
    st = simulate_decode(q[:2], k[0], v[0], s, w + kk, 0, "streaming")
    check("TOVA layer mean, all keys equal (every score ties): the older token is evicted (= streaming)",
          all(np.array_equal(x, y_) for x, y_ in zip(r.sets, st.sets)))
    differs = False
    for _ in range(20):
        T = 40
        q, k, v = rng.standard_normal((4, T, 4)), rng.standard_normal((2, T, 4)), rng.standard_normal((2, T, 3))
        lm = simulate_decode_tova_layer(q, k, v, 1, 2, 5)
        g0 = simulate_decode(q[:2], k[0], v[0], 1, 2, 5, "tova")
        g1 = simulate_decode(q[2:], k[1], v[1], 1, 2, 5, "tova")
        differs |= not (np.array_equal(lm.kept, g0.kept) and np.array_equal(lm.kept, g1.kept))
    check("TOVA layer mean differs from the per-KV-head group mean when Hkv > 1", differs)
    q, k, v = rand_head(2, 30)
    a = simulate_decode(q, k, v, 1, 3, 4, "h2o")
    b = simulate_decode(q, k, v, 1, 3, 4, "h2o", h2o_normalize=True)
    check("H2O normalised differs from the raw sum (old tokens favoured by the raw sum)",
          any(not np.array_equal(x, y_) for x, y_ in zip(a.sets, b.sets)))

    # 6. SnapKV: pooling counts the pads; T <= C_max keeps everything; selection = top of the pooled votes
    q, k = rng.standard_normal((2, 30, 4)), rng.standard_normal((30, 4))
    W = 6
    sc = snapkv_scores(q, k, W)
    P = 30 - W
    vote = np.zeros((2, P))
    for g in range(2):
        for i in range(P, 30):
            pr = softmax(q[g, i] @ k[:i + 1].T / 2.0)
            vote[g] += pr[:P]
    direct = np.array([[sum(vote[g, j] for j in range(t - 2, t + 3) if 0 <= j < P) / 5 for t in range(P)]
                       for g in range(2)]).mean(0)
    check("SnapKV scores = avg-pool 5 (pads counted) of the window votes, group mean",
          np.allclose(sc, direct, atol=1e-14))
    kept = snapkv_keep(q, k, W, W + 10)
    top = set(np.argsort(-direct, kind="stable")[:10].tolist())
    check("SnapKV keeps the top C_max - W_obs of the prefix plus the window",
          kept.tolist() == sorted(top | set(range(P, 30))))
    check("SnapKV with T <= C_max keeps all", snapkv_keep(q, k, W, 30).tolist() == list(range(30)))
    check("SnapKV with C_max = W_obs keeps the window", snapkv_keep(q, k, W, W).tolist() == list(range(P, 30)))

    # 7. the batch mapping: ragged lengths, GQA heads, T = 0, mask with every static scorer
    ok = True
    for scorer in ("streaming", "knorm", "kvpop", "h2o", "tova", "snapkv"):
        B, Hkv, G, T, D, Dv = 3, 2, 2, 17, 4, 3
        t = dict(q=rng.standard_normal((B, Hkv * G, T, D)), k=rng.standard_normal((B, Hkv, T, D)),
                 v=rng.standard_normal((B, Hkv, T, Dv)), lengths=np.array([17, 0, 9]))
        wts = random_kvpop_weights(rng, Hkv, D, Dv)
        s_ = 0 if scorer == "snapkv" else 1
        out, _ = evict_reference(t, scorer, s_, 3, 4, weights=wts, want_mask=scorer in MASK_SCORERS)
        for b, L in enumerate((17, 0, 9)):
            for h in range(Hkv):
                sl = slice(h * G, (h + 1) * G)
                if scorer == "snapkv":
                    yy, kp = exact_attention(t["q"][b, sl, :L], t["k"][b, h, :L], t["v"][b, h, :L]), snapkv_keep(
                        t["q"][b, sl, :L], t["k"][b, h, :L], 3, 7)
                else:
                    sc, lg = None, 0.0
                    if scorer == "kvpop":
                        sc = kvpop_scores(t["k"][b, h, :L], t["v"][b, h, :L], kvpop_head(wts, h), 3)
                        lg = float(log_gamma(wts["theta"][h].astype(np.float64)))
                    r = simulate_decode(t["q"][b, sl, :L], t["k"][b, h, :L], t["v"][b, h, :L], 1, 3, 4, scorer,
                                        scores=sc, log_gamma=lg)
                    yy, kp = r.y, r.kept if L else np.zeros(0, np.int64)
                n_ = out["kept_rows"][b, h]
                ok &= np.allclose(out["y"][b, sl, :L], yy, atol=1e-14) and not out["y"][b, sl, L:].any()
                ok &= n_ == len(kp) and out["kept_positions"][b, h, :n_].tolist() == kp.tolist()
                ok &= bool(np.all(out["kept_positions"][b, h, n_:] == -1))
                if "mask" in out:
                    ok &= not out["mask"][b, h, L:].any()
    B, Hkv, G, T, D, Dv = 3, 3, 2, 17, 4, 3
    t = dict(q=rng.standard_normal((B, Hkv * G, T, D)), k=rng.standard_normal((B, Hkv, T, D)),
             v=rng.standard_normal((B, Hkv, T, Dv)), lengths=np.array([17, 0, 9]))
    out, _ = evict_reference(t, "tova", 1, 3, 4, tova_layer_mean=True)
    for b, L in enumerate((17, 0, 9)):
        r = simulate_decode_tova_layer(t["q"][b, :, :L], t["k"][b, :, :L], t["v"][b, :, :L], 1, 3, 4)
        kp = r.kept if L else np.zeros(0, np.int64)
        ok &= np.allclose(out["y"][b, :, :L], r.y, atol=1e-14) and not out["y"][b, :, L:].any()
        for h in range(Hkv):
            n_ = out["kept_rows"][b, h]
            ok &= n_ == len(kp) and out["kept_positions"][b, h, :n_].tolist() == kp.tolist()
            ok &= bool(np.all(out["kept_positions"][b, h, n_:] == -1))
    out, _ = evict_reference(dict(q=np.zeros((1, 2, 0, 4)), k=np.zeros((1, 1, 0, 4)), v=np.zeros((1, 1, 0, 3))),
                             "knorm", 1, 2, 3, want_mask=True)
    ok &= out["y"].shape == (1, 2, 0, 3) and out["kept_positions"].shape == (1, 1, 0)
    ok &= out["kept_rows"].tolist() == [[0]] and out["mask"].shape == (1, 1, 0, 0)
    check("batch mapping: ragged lengths, GQA, -1 padding, zero rows past the length, T = 0, tova layer mean", ok)
    return results


if __name__ == "__main__":
    res = self_test(int(sys.argv[1]) if len(sys.argv) > 1 else 7)
    print(f"{sum(res)} passed, {len(res) - sum(res)} failed")
    sys.exit(0 if all(res) else 1)
