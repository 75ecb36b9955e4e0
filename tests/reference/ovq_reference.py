"""Independent float64 reference of OVQ (Online Vector-Quantized attention).

Written from shared/spec/OVQ.md (section numbers below refer to it), one sequence at a time:
  q, k [H,T,D], v [H,T,Dv], beta [H] (logit scale beta * sqrt(D)).
Both entry points return (y [H,T,Dv], centroid_keys [H,m,D], centroid_values [H,m,Dv],
counts [H,m], m) with m = size of the final committed state (the same for every head).
Conventions: only full chunks are committed; the m == 0, num_new == 0 quirk of §5 is reproduced
(the chunk is folded into row 0 before row 0 is live); new-centroid ties (score asc, token index
asc), argmax ties lowest centroid (§9.1-9.2); normalize_centroids rescales every row of Dk and Dv
to x / max(||x||, 1e-12) after the update. A custom `budget(t)` replaces the growth formula;
sizes[c] is then also capped at sizes[c-1] + C (never binds for plateau or min, spec: num_new <= C).
"""
import math
from dataclasses import dataclass, fields
from typing import Callable, Optional

import numpy as np

from float64_math import fsum_dot, fsum_norm


@dataclass
class OVQParams:
    chunk: int = 128                # C
    max_centroids: int = 2048       # N
    growth: str = "plateau"         # plateau: floor(tN/(t+N)); min: min(t, N)
    normalize_centroids: bool = False
    count_bias: bool = True         # log(counts) bias on the centroid logits
    budget: Optional[Callable[[int], int]] = None   # replaces the growth formula when set


_GROWTH = {"plateau": "plateau", "min": "min"}


def make_params(p=None, **kw):
    """OVQParams from an OVQParams, a dict or keyword arguments."""
    d = {} if p is None else (dict(p) if isinstance(p, dict) else
                              {f.name: getattr(p, f.name) for f in fields(OVQParams)})
    d.update(kw)
    p = OVQParams(**d)
    p.growth = _GROWTH[p.growth]
    if p.chunk < 1 or p.max_centroids < 1:
        raise ValueError("chunk and max_centroids must be >= 1")
    return p


def _next_size(p, prev, t):
    """sizes[c] from sizes[c-1] = prev and t = min(T, c*C) (§3)."""
    N = p.max_centroids
    if p.budget is not None:
        s = int(p.budget(t))
    elif p.growth == "plateau":
        s = min(int(math.floor((float(t) * float(N)) / float(t + N))), N)
    else:
        s = min(t, N)
    return min(max(s, prev), N, prev + p.chunk)


def ovq_sizes(p, T):
    """sizes[0 .. ceil(T/C)] of §3."""
    p = make_params(p)
    C = p.chunk
    sizes = [0]
    for c in range(1, -(-T // C) + 1):
        sizes.append(_next_size(p, sizes[-1], min(T, c * C)))
    return sizes


def _unit(x):
    """x / (||x||_2 + 1e-5) over the last axis (§2)."""
    return x / (fsum_norm(x) + 1e-5)


# Two scores closer than this (relative) but not equal are a near-tie: equal in exact arithmetic (a row
# normalized after a fold against a row founded by a copy of the same key), they are decided by rounding,
# which a float32 implementation does differently from this float64 reference.
NEAR_TIE = 1e-5


class Dictionary:
    """One head's dictionary: N rows; the caller tracks how many are live. `near_ties`, if a list, receives
    the gap of every decision of commit() between two scores that form a near-tie (NEAR_TIE)."""

    def __init__(self, N, D, Dv, near_ties=None):
        self.keys = np.zeros((N, D))
        self.values = np.zeros((N, Dv))
        self.counts = np.zeros(N)
        self.near_ties = near_ties

    def _note(self, a, b):
        if (self.near_ties is not None and a != b and math.isfinite(a) and math.isfinite(b)
                and abs(a - b) <= NEAR_TIE * max(1.0, abs(a), abs(b))):
            self.near_ties.append(abs(a - b))

    def _note_order(self, scores, order, count):
        """Near-ties among the first count + 1 entries of `order` (which tokens become rows, and in which
        order)."""
        for r in range(min(count, len(order) - 1)):
            self._note(scores[order[r]], scores[order[r + 1]])

    def commit(self, m, num_new, khat, v, normalize=False):
        """§5: fold one full chunk (khat [n,D] normalized keys, v [n,Dv]) into a dictionary of
        live size m, creating rows m .. m+num_new-1. Returns the assignments a [n]."""
        n = khat.shape[0]
        assert 0 <= num_new <= n and m + num_new <= self.keys.shape[0]
        a = np.zeros(n, dtype=np.int64)
        if m == 0:
            if num_new > 1:
                sim0 = [fsum_dot(khat[j], khat[0]) for j in range(n)]
                sim0[0] = math.inf
                order = sorted(range(n), key=lambda j: (sim0[j], j))
                self._note_order(sim0, order, num_new - 1)
                for r in range(num_new - 1):
                    a[order[r]] = r + 1
        else:
            best = []
            for j in range(n):
                sims = [fsum_dot(khat[j], self.keys[i]) for i in range(m)]
                bv = max(sims)
                a[j] = sims.index(bv)           # first (lowest) index of the maximum
                for sv in sims:
                    self._note(bv, sv)
                best.append(bv)
            if num_new > 0:
                order = sorted(range(n), key=lambda j: (best[j], j))
                self._note_order(best, order, num_new)
                for r in range(num_new):
                    a[order[r]] = m + r
        new_counts = self.counts.copy()
        for j in range(n):
            new_counts[a[j]] += 1.0
        old_k, old_v = self.keys.copy(), self.values.copy()
        for j in range(n):
            i = a[j]
            lr = 1.0 / new_counts[i]
            self.keys[i] += lr * (khat[j] - old_k[i])
            self.values[i] += lr * (v[j] - old_v[i])
        self.counts = new_counts
        if normalize:
            self.keys /= np.maximum(fsum_norm(self.keys), 1e-12)
            self.values /= np.maximum(fsum_norm(self.values), 1e-12)
        return a

    def attend(self, m, qs, tok_k, tok_v, count_bias=True):
        """§4: softmax(qs . [Dk[:m]; tok_k] + [log counts; 0]) . [Dv[:m]; tok_v]."""
        keys = np.concatenate([self.keys[:m], tok_k])
        vals = np.concatenate([self.values[:m], tok_v])
        with np.errstate(divide="ignore"):
            cb = np.log(self.counts[:m]) if count_bias else np.zeros(m)
        logits = keys @ qs + np.concatenate([cb, np.zeros(len(tok_k))])
        w = np.exp(logits - logits.max())
        return (w @ vals) / w.sum()


def _check(q, k, v, beta):
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    beta = np.asarray(beta, dtype=np.float64).reshape(-1)
    H, T, D = q.shape
    assert k.shape == (H, T, D) and v.shape[:2] == (H, T) and beta.shape == (H,)
    return q, k, v, beta


def _result(dicts, rows, y, D, Dv):
    H = len(dicts)
    keys = np.array([d.keys[:rows] for d in dicts]).reshape(H, rows, D)
    vals = np.array([d.values[:rows] for d in dicts]).reshape(H, rows, Dv)
    cnts = np.array([d.counts[:rows] for d in dicts]).reshape(H, rows)
    return y, keys, vals, cnts, rows


def ovq_prefill(q, k, v, beta, p, near_ties=None):
    """§4-§5 chunk by chunk: attend, then commit the chunk if it is full. `near_ties`: see Dictionary."""
    p = make_params(p)
    q, k, v, beta = _check(q, k, v, beta)
    H, T, D = q.shape
    Dv, C = v.shape[2], p.chunk
    sizes = ovq_sizes(p, T)
    y = np.zeros((H, T, Dv))
    dicts = []
    for h in range(H):
        qs = _unit(q[h]) * (beta[h] * math.sqrt(D))
        kh = _unit(k[h])
        d = Dictionary(p.max_centroids, D, Dv, near_ties)
        for c in range(len(sizes) - 1):
            s, e, m = c * C, min(T, (c + 1) * C), sizes[c]
            for u in range(s, e):
                y[h, u] = d.attend(m, qs[u], kh[s:u + 1], v[h, s:u + 1], p.count_bias)
            if e - s == C:
                d.commit(m, sizes[c + 1] - m, kh[s:e], v[h, s:e], p.normalize_centroids)
        dicts.append(d)
    return _result(dicts, sizes[T // C], y, D, Dv)


def ovq_decode(q, k, v, beta, p):
    """§6 token by token from an empty cache: append -> attend -> commit if the chunk is full."""
    p = make_params(p)
    q, k, v, beta = _check(q, k, v, beta)
    H, T, D = q.shape
    Dv, C = v.shape[2], p.chunk
    y = np.zeros((H, T, Dv))
    dicts, rows = [], ovq_sizes(p, T)[T // C] if H == 0 else 0
    for h in range(H):
        d = Dictionary(p.max_centroids, D, Dv)
        size, committed, pk, pv = 0, 0, [], []
        for u in range(T):
            qs = _unit(q[h, u]) * (beta[h] * math.sqrt(D))
            pk.append(_unit(k[h, u]))
            pv.append(v[h, u])
            y[h, u] = d.attend(size, qs, np.array(pk), np.array(pv), p.count_bias)
            if len(pk) == C:
                nxt = _next_size(p, size, (committed + 1) * C)
                d.commit(size, nxt - size, np.array(pk), np.array(pv), p.normalize_centroids)
                size, committed, pk, pv = nxt, committed + 1, [], []
        dicts.append(d)
        rows = size
    return _result(dicts, rows, y, D, Dv)
