"""Independent float64 reference of the KVM (Key-Value Means) attention memory.

Written from shared/spec/KVM.md (section numbers below refer to it), one sequence at a time:
  q [Hq,T,D], k [Hkv,T,D], v [Hkv,T,Dv], z [Hkv,T] (merge-gate pre-activation),
  ln_w/ln_b [D] (shared state-key LayerNorm LN_s), tau_s/tau_b [Hq].
Both entry points return (y [Hq,T,Dv], keys [Hkv,m,D], values [Hkv,m,Dv], radius [Hkv,m], m):
the final state's running sums K, V (not LN_s(K) / Vhat) and radii, rows in creation order.
Merge gates on keys and values, appends ungated, vlens on (spec defaults); r = 0 zeroes nothing.
"""
import math
from dataclasses import dataclass, fields

import numpy as np


@dataclass
class KVMParams:
    chunk: int = 256            # C
    window_chunks: int = 2      # n_b (window L = n_b * C)
    rope_dims: int = 64         # r: key channels [0, r) zeroed before LN_s for memory keys
    sinks: int = 1              # S protected rows
    schedule: str = "fixed"     # fixed | power_law | saturation
    min_len: int = -1
    growth_factor: float = 1.0
    growth_exponent: float = 0.5
    round_down: int = 1
    saturation_n: float = 1024
    max_chunks: int = 1         # budget cap = C * max_chunks
    ln_eps: float = 1e-5
    norm_eps: float = 1e-12
    rule: str = "kvm"           # kvm | proportional (kvmem's merge::Proportional: raw keys, ungated folds,
                                # rows read as K / n, V / n with logit bias log n)


_ALIASES = {"n_bswa_chunks": "window_chunks", "sink_len": "sinks"}
_SCHEDULES = {"fixed": "fixed", "power_law": "power_law", "power-law": "power_law",
              "saturation": "saturation", "kvm_saturation": "saturation",
              "saturating": "saturation"}


def make_params(p=None, **kw):
    """KVMParams from a KVMParams, a dict (spec names n_bswa_chunks/sink_len accepted) or kwargs."""
    d = {} if p is None else (dict(p) if isinstance(p, dict) else
                              {f.name: getattr(p, f.name) for f in fields(KVMParams)})
    d.update(kw)
    d = {_ALIASES.get(k, k): v for k, v in d.items()}
    p = KVMParams(**d)
    p.schedule = _SCHEDULES[p.schedule]
    if p.rule not in ("kvm", "proportional"):
        raise ValueError(f"rule {p.rule!r}: kvm or proportional")
    if p.chunk < 1 or p.window_chunks < 1:
        raise ValueError("chunk and window_chunks must be >= 1")
    return p


def _ln(x, p, w, b):
    """LN_s over the last axis: biased variance, eps = p.ln_eps, affine (w, b)."""
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + p.ln_eps) * w + b


def _gate(z):
    """g = 1 + ELU(z): 1 + z for z > 0, 1 + expm1(z) otherwise (§2)."""
    return np.where(z > 0, 1.0 + z, 1.0 + np.expm1(np.minimum(z, 0.0)))


def _dots(a, b):
    """a [n,d] . b [m,d] -> [n,m], every entry summed in the same order (exact ties stay ties;
    a BLAS matmul may block columns differently)."""
    return (a[:, None, :] * b[None, :, :]).sum(-1)


def _bswa_begin(n, p):
    C = p.chunk
    return max(0, (n + C - 1) // C * C - p.window_chunks * C)


def _budget(p, ctx):
    """B(ctx) of §5.2 (double arithmetic, then integer)."""
    if p.schedule == "fixed":
        return int(p.min_len)
    if p.schedule == "power_law":
        x = (p.growth_factor * math.sqrt(ctx) if p.growth_exponent == 0.5
             else p.growth_factor * float(ctx) ** p.growth_exponent)
    else:
        n = float(p.saturation_n)
        x = (n * ctx) / (n + ctx)
    R = max(1, int(p.round_down))
    return max(int(math.floor(max(x, 0.0))) // R * R, int(p.min_len))


class _HeadState:
    """State of one KV head: running sums K [m,D], V [m,Dv], radii rho [m]."""

    def __init__(self, D, Dv):
        self.K, self.V, self.rho, self.n = np.zeros((0, D)), np.zeros((0, Dv)), np.zeros(0), np.zeros(0)

    def append(self, kbar, v):  # ungated rows (§4 initial chunk, §5.4, §6 direct append)
        self.K = np.concatenate([self.K, kbar])
        self.V = np.concatenate([self.V, v])
        self.rho = np.concatenate([self.rho, np.linalg.norm(v, axis=-1)])
        self.n = np.concatenate([self.n, np.ones(len(kbar))])


def _read(st, p, w, b):
    """What the readout reads of the rows: keys [m,D], values [m,Dv] and logit biases [m]."""
    if p.rule == "proportional":
        return st.K / st.n[:, None], st.V / st.n[:, None], np.log(st.n)
    vh = st.rho[:, None] * st.V / np.maximum(np.linalg.norm(st.V, axis=-1), p.norm_eps)[:, None]
    return _ln(st.K, p, w, b), vh, np.zeros(len(st.K))


def _update(st, p, w, b, kbar, v, g, ctx, avail, trace=None):
    """§5: fold one overflow block (kbar/v/g of its |O| tokens) into the state."""
    m, nO = len(st.K), len(kbar)
    B = _budget(p, ctx)
    Mstar = max(m, min(B, avail, p.chunk * p.max_chunks))
    n_app = min(Mstar - m, nO)
    if 0 < n_app < nO:
        assert m > 0
        score = _dots(kbar, _read(st, p, w, b)[0]).max(axis=1)       # ungated, all rows
        order = np.lexsort((np.arange(nO), score))                   # score asc, index asc
        app = np.sort(order[:n_app])
    else:
        app = np.arange(nO) if n_app == nO else np.arange(0)
    rest = np.setdiff1d(np.arange(nO), app)
    st.append(kbar[app], v[app])
    if len(rest):
        P = min(p.sinks, len(st.K))
        if not len(st.K) > P:
            raise ValueError(f"merge needs more than {P} rows (sinks={p.sinks} >= chunk?)")
        kg = g[rest, None] * kbar[rest]
        vg = g[rest, None] * v[rest]
        kh = _read(st, p, w, b)[0]                                   # one snapshot, post-append
        pi = P + np.argmax(_dots(kg, kh[P:]), axis=1)                    # first max = lowest row
        np.add.at(st.K, pi, kg)
        np.add.at(st.V, pi, vg)
        np.add.at(st.n, pi, 1.0)
    if trace is not None:
        trace.append(dict(ctx=ctx, avail=avail, B=B, Mstar=Mstar, n_app=len(app),
                          merged=len(rest), rows=len(st.K)))


def _readout(qg, qpos, st, p, w, b, wk, wv, wpos, tau_s, tau_b):
    """§3 for the G query heads of one KV head: qg [G,n,D] at positions qpos [n]."""
    D = qg.shape[-1]
    scale = 1.0 / math.sqrt(D)
    lw = np.einsum("gnd,gjd->gnj", qg, tau_b[:, None, None] * wk[None]) * scale
    lw = np.where(wpos[None, None, :] <= qpos[None, :, None], lw, -np.inf)
    vals = wv[None]
    if st is not None and len(st.K):
        kh, vh, bias = _read(st, p, w, b)
        ls = np.einsum("gnd,gjd->gnj", qg, tau_s[:, None, None] * kh[None]) * scale + bias
        lw = np.concatenate([ls, lw], axis=-1)
        vals = np.concatenate([vh, wv])[None]
    lw = lw - lw.max(axis=-1, keepdims=True)
    a = np.exp(lw)
    a /= a.sum(axis=-1, keepdims=True)
    return a @ vals


def _prep(q, k, v, z, ln_w, ln_b, tau_s, tau_b, p):
    p = make_params(p)
    q, k, v, z, ln_w, ln_b, tau_s, tau_b = (np.asarray(x, dtype=np.float64) for x in
                                            (q, k, v, z, ln_w, ln_b, tau_s, tau_b))
    Hq, T, D = q.shape
    Hkv = k.shape[0]
    assert k.shape == (Hkv, T, D) and v.shape[:2] == (Hkv, T) and z.shape == (Hkv, T)
    assert Hkv >= 1 and Hq % Hkv == 0 and ln_w.shape == ln_b.shape == (D,)
    assert tau_s.shape == tau_b.shape == (Hq,)
    if not 0 <= p.rope_dims <= D:
        raise ValueError(f"rope_dims {p.rope_dims} outside [0, {D}]")
    kz = k.copy()
    kz[..., :p.rope_dims] = 0.0
    kbar = _ln(kz, p, ln_w, ln_b)                  # memory keys, [Hkv,T,D]
    if p.rule == "proportional":                   # the raw keys, ungated
        return p, q, k, v, np.ones_like(z), ln_w, ln_b, tau_s, tau_b, k.copy(), Hq // Hkv
    return p, q, k, v, _gate(z), ln_w, ln_b, tau_s, tau_b, kbar, Hq // Hkv


def _finish(states, y):
    ms = {len(st.K) for st in states}
    assert len(ms) == 1, "row counts differ across KV heads"
    return (y, np.stack([st.K for st in states]), np.stack([st.V for st in states]),
            np.stack([st.rho for st in states]), ms.pop())


def kvm_prefill(q, k, v, z, ln_w, ln_b, tau_s, tau_b, p, trace=None):
    """§4 chunked prefill. `trace` (a list) receives one dict per update (KV head 0 only)."""
    p, q, k, v, g, w, b, tau_s, tau_b, kbar, G = _prep(q, k, v, z, ln_w, ln_b, tau_s, tau_b, p)
    Hq, T, _ = q.shape
    C, L = p.chunk, p.window_chunks * p.chunk
    y = np.zeros((Hq, T, v.shape[-1]))
    states = []
    for j in range(k.shape[0]):
        hs = slice(j * G, (j + 1) * G)
        ts, tb, qg = tau_s[hs], tau_b[hs], q[hs]
        tr = trace if j == 0 else None
        L0 = min(T, L)
        pos = np.arange(T)
        if L0:  # front block: exact causal attention, no state
            y[hs, :L0] = _readout(qg[:, :L0], pos[:L0], None, p, w, b,
                                  k[j, :L0], v[j, :L0], pos[:L0], ts, tb)
        st = _HeadState(k.shape[-1], v.shape[-1])
        n0 = min(T, C)
        st.append(kbar[j, :n0], v[j, :n0])
        cov = n0
        for s in range(L0, T, C):
            e = min(T, s + C)
            bb = _bswa_begin(e, p)
            assert bb == cov
            if tr is not None:
                tr.append(dict(query=(s, e), window=(bb, e), covers=cov))
            y[hs, s:e] = _readout(qg[:, s:e], pos[s:e], st, p, w, b,
                                  k[j, bb:e], v[j, bb:e], pos[bb:e], ts, tb)
            nb = _bswa_begin(min(T, e + C), p)
            if nb > bb:
                _update(st, p, w, b, kbar[j, bb:nb], v[j, bb:nb], g[j, bb:nb],
                        ctx=e, avail=nb, trace=tr)
                cov = nb
        states.append(st)
    return _finish(states, y)


def kvm_decode(q, k, v, z, ln_w, ln_b, tau_s, tau_b, p, trace=None):
    """§6 token-by-token decode from an empty cache (window = tokens [nb, n) of the inputs)."""
    p, q, k, v, g, w, b, tau_s, tau_b, kbar, G = _prep(q, k, v, z, ln_w, ln_b, tau_s, tau_b, p)
    Hq, T, _ = q.shape
    C, L = p.chunk, p.window_chunks * p.chunk
    y = np.zeros((Hq, T, v.shape[-1]))
    states = []
    for j in range(k.shape[0]):
        hs = slice(j * G, (j + 1) * G)
        tr = trace if j == 0 else None
        st = _HeadState(k.shape[-1], v.shape[-1])
        cov = 0
        for n in range(1, T + 1):
            direct = min(n, C)
            if cov < direct:
                st.append(kbar[j, cov:direct], v[j, cov:direct])
                cov = direct
            nb = _bswa_begin(n, p)
            target = max(direct, nb)
            if cov < target:
                if tr is not None:
                    tr.append(dict(n=n, block=(cov, cov + C)))
                _update(st, p, w, b, kbar[j, cov:cov + C], v[j, cov:cov + C], g[j, cov:cov + C],
                        ctx=L + cov, avail=cov + C, trace=tr)
                cov = target
            wpos = np.arange(nb, n)
            y[hs, n - 1:n] = _readout(q[hs, n - 1:n], np.array([n - 1]), st if nb > 0 else None,
                                      p, w, b, k[j, nb:n], v[j, nb:n], wpos, tau_s[hs], tau_b[hs])
        if tr is not None:
            tr.append(dict(final_cov=cov))
        states.append(st)
    return _finish(states, y)
