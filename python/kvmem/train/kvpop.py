"""KVPOP's training form: the learned mLSTM eviction scorer as a differentiable PyTorch forward, its training
masks, the future-attention importance target and the Phase-2 ranking loss.

What :func:`mlstm_scores` computes is what ``kvmem.EvictionMemory(..., scorer="kvpop", weights=...)`` scores
(C++ ``kvmem::score::MLstm``, include/kvmem/policy/score/mlstm.hpp; spec shared/spec/EVICTION.md §2-§3;
kvpop-paper Sec. 2 and App. B), in the dtype of its inputs (float32 or float64), for every sequence and
kv-head at once. Per kv-head, with x_t = [k_t ; v_t] (X = D + Dv channels, as cached), h = D / 2 and the
Hedgehog map HH(y) = [softmax(y) ; softmax(-y)] (h -> D):

- qf_t = HH(x_t W_q), kf_t = HH(x_t W_k) [D], vf_t = x_t W_v [h];
- log input gate i~_t = c tanh((x_t . w_i + b_i) / c), log forget gate log f_t = logsigmoid(c tanh((x_t . w_f
  + b_f) / c)) (soft cap c = 15, the xLSTM default; c <= 0 turns it off);
- the state after token t in the closed parallel form of spec §3 (one masked [tokens x tokens] matrix, no chunks,
  no loop), with F_t = sum_{l <= t} log f_l and the stabiliser m_t = max(F_t, max_{j <= t}(i~_j + F_t - F_j))
  (F_t is the initial state's term, m_0 = 0): C_t = sum_{j <= t} exp(i~_j + F_t - F_j - m_t) kf_j vf_j^T,
  n_t = sum_{j <= t} exp(i~_j + F_t - F_j - m_t) kf_j. This equals the recurrence m_t = max(log f_t + m_{t-1},
  i~_t), C_t = exp(log f_t + m_{t-1} - m_t) C_{t-1} + exp(i~_t - m_t) kf_t vf_t^T (and n likewise) from
  C = 0, n = 0, m = 0 that the C++ scorer runs;
- delayed scoring (spec §2, paper Sec. 2 "u := t - w + 1"): token u is read out with the state after token
  t = u + w - 1, score_u = w_s . SiLU(h_u) + b_s with h_u = (q'^T C_t) / (max(|q' . n_t|, exp(-m_t)) + eps),
  q' = qf_u / sqrt(D) ("xlstm", default; mlstm_kernels) or h_u = (qf_u^T C_t) / (qf_u . n_t) ("plain",
  paper App. B eq. 3). No output gate, no head-wise LayerNorm (App. B, F).

The ranking (spec §4, n = 1): :func:`effective_keys` gives the static key kappa_t = score_t - t log gamma_h with
log gamma_h = log 0.999 + sigmoid(theta_h) (log 0.999999 - log 0.999) (App. E), and :func:`keep_mask` the
attention mask the memory applies with it (spec §5, paper App. C eq. 4 with the causal term): sinks, the
protected window and the top_k eligible tokens by (kappa, position), ties to the newer token. The mask is
built with a vectorised running count instead of the paper's Fenwick tree (the same mask, O(T^2) work on
the device instead of O(T log T) sequential work). :func:`masked_attention` reads it.

Training (paper Sec. 2.1, App. D, E; spec §7): :func:`importance_target` is the future attention mass
m_{h,t} = max_g sum_{d >= t + w} p^{(h,g)}_{d -> t} by the transposed pass (a log-sum-exp over queries of
the log-probabilities s(d, t) - LSE_d), and :func:`kvpop_loss` the pairwise boundary loss of eq. 2 against
it. The top-k selection is not differentiable: the scorer learns from the ranking loss alone. In the paper's
Phase 2 (App. E) the base model is trained too (0.9 cross-entropy + 0.1 KL to the dense teacher through the
sparse mask); with the base model frozen those terms have no path to the scorer and only kvpop_loss trains
it. The paper feeds the scorer detached keys and values (Fig. 1); detach k and v before mlstm_scores to do
the same (the forward is differentiable in k and v too).

Numerics: the prefix sums F are accumulated in float64 and the differences F_t - F_j formed in float64 before
they return to the inputs' dtype (|F| reaches 10^4 at T = 2048 and float32 would lose the small differences
that matter to cancellation); everything else runs in the inputs' dtype. The C++ scorer runs the recurrence
in float32: the two agree to float32 rounding, not bit for bit.

Shapes: B sequences, Hq query heads, Hkv kv-heads (query head hq reads kv-head hq // (Hq / Hkv)), T tokens
per sequence (every sequence has T tokens: no ragged batch), D the key head_dim (even), Dv the value head_dim.
Positions are 0-based token indices.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

import torch

from ._checks import count as _count_arg
import torch.nn.functional as F_

#: Decay range of log gamma_h (kvpop-paper App. E, Table 2: "decay min 0.999, decay max 0.999999").
GAMMA_MIN, GAMMA_MAX = 0.999, 0.999999
#: Gate soft cap c (the xLSTM default gate_soft_cap; spec EVICTION.md §3).
SOFT_CAP = 15.0
#: The xlstm normaliser's epsilon (spec EVICTION.md §3; score::MLstm::eps).
EPS = 1e-6
#: The scorer's tensors in the order of the C++ MLstmWeights table (include/kvmem/policy/score/mlstm_weights.hpp).
WEIGHT_NAMES = ("w_q", "w_k", "w_v", "w_i", "b_i", "w_f", "b_f", "w_s", "b_s", "theta")
#: Rows of a [B, Hkv, rows, T] work matrix per chunk of the no-gradient passes (keeps them near 2^24 elements).
_CHUNK_ELEMENTS = 1 << 24


def weight_shapes(kv_heads: int, head_dim: int, value_dim: int | None = None) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the scorer's tensors for ``kv_heads`` kv-heads, key head_dim D (even) and value head_dim
    Dv (default D), X = D + Dv, h = D / 2 (spec EVICTION.md §3, Q5; C++ MLstmWeights):
    w_q, w_k, w_v [Hkv, X, h]; w_i, w_f [Hkv, X]; b_i, b_f, b_s, theta [Hkv]; w_s [Hkv, h].
    Raises TypeError for a non-integer and ValueError for a count < 1 or an odd head_dim, naming it."""
    H = _count_arg("kv_heads", kv_heads, 1)
    D = _count_arg("head_dim", head_dim, 1)
    Dv = D if value_dim is None else _count_arg("value_dim", value_dim, 1)
    if D % 2:
        raise ValueError(f"head_dim = {D}: must be even for the mLSTM scorer (h = D / 2; spec EVICTION.md §3)")
    X, h = D + Dv, D // 2
    return dict(w_q=(H, X, h), w_k=(H, X, h), w_v=(H, X, h), w_i=(H, X), b_i=(H,), w_f=(H, X), b_f=(H,),
                w_s=(H, h), b_s=(H,), theta=(H,))


# ------------------------------------------------------------------------------------------------ checks


def _real(name: str, value, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} = {value!r}: must be a float")
    x = float(value)
    if not math.isfinite(x) or (positive and x <= 0):
        raise ValueError(f"{name} = {value!r}: must be finite{' and > 0' if positive else ''}")
    return x


def _tensor(name: str, t, rank: int, layout: str, dtypes=(torch.float32, torch.float64)) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} = {type(t).__name__}: must be a torch.Tensor {layout}")
    if t.dim() != rank:
        raise ValueError(f"{name}.shape = {tuple(t.shape)}: must be {layout}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}.dtype = {t.dtype}: must be one of {', '.join(str(d) for d in dtypes)}")
    return t


def _like(name: str, t: torch.Tensor, shape: tuple, ref: torch.Tensor, ref_name: str) -> torch.Tensor:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}.shape = {tuple(t.shape)}: must be {tuple(shape)} (as {ref_name}'s)")
    if t.dtype != ref.dtype:
        raise TypeError(f"{name}.dtype = {t.dtype}: must be {ref_name}'s dtype {ref.dtype} (no casts)")
    if t.device != ref.device:
        raise ValueError(f"{name}.device = {t.device}: must be {ref_name}'s device {ref.device}")
    return t


def _weights(weights, k: torch.Tensor, Dv: int) -> dict[str, torch.Tensor]:
    """The scorer's tensors of ``weights`` checked against weight_shapes and k's dtype and device."""
    if not hasattr(weights, "keys") or not hasattr(weights, "__getitem__"):
        raise TypeError(f"weights = {type(weights).__name__}: must map {', '.join(WEIGHT_NAMES)} to tensors")
    H, D = k.shape[1], k.shape[3]
    shapes = weight_shapes(H, D, Dv)
    names = set(weights.keys())
    surplus = sorted(str(n) for n in names - set(WEIGHT_NAMES))
    if surplus:
        raise ValueError(f"weights[{surplus[0]!r}]: not a KVPOP scorer tensor (expected {', '.join(WEIGHT_NAMES)})")
    out = {}
    for name in WEIGHT_NAMES:
        if name not in names:
            raise ValueError(f"weights: no {name!r}; the kvpop scorer needs {', '.join(WEIGHT_NAMES)} (spec EVICTION.md §3)")
        t = weights[name]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"weights[{name!r}] = {type(t).__name__}: must be a torch.Tensor")
        want = shapes[name]
        if tuple(t.shape) != want:
            raise ValueError(f"weights[{name!r}].shape = {tuple(t.shape)}: must be {list(want)} (Hkv = {H}, X = D + Dv = "
                             f"{D + Dv}, h = D / 2 = {D // 2}; spec EVICTION.md §3)")
        if t.dtype != k.dtype:
            raise TypeError(f"weights[{name!r}].dtype = {t.dtype}: must be k's dtype {k.dtype} (no casts)")
        if t.device != k.device:
            raise ValueError(f"weights[{name!r}].device = {t.device}: must be k's device {k.device}")
        out[name] = t
    return out


def _policy(sinks, window, top_k=None) -> tuple[int, int, int | None]:
    s = _count_arg("sinks", sinks, 0)
    w = _count_arg("window", window, 1)
    k = None if top_k is None else _count_arg("top_k", top_k, 0)
    return s, w, k


def _keys(name: str, t) -> torch.Tensor:
    """A [B, Hkv, T] tensor of keys or scores, float32 or float64, without NaN."""
    t = _tensor(name, t, 3, "[B, Hkv, T]")
    if t.numel() and bool(torch.isnan(t.detach()).any()):
        first = torch.isnan(t.detach()).nonzero()[0].tolist()
        raise ValueError(f"{name}[{', '.join(map(str, first))}] = nan: keys must not be NaN")
    return t


# ------------------------------------------------------------------------------------------- the scorer
def _cap(z: torch.Tensor, c: float) -> torch.Tensor:
    return c * torch.tanh(z / c) if c > 0 else z


def _hedgehog(y: torch.Tensor) -> torch.Tensor:
    """HH(y) = [softmax(y) ; softmax(-y)] over the last axis (h -> 2h; paper App. B)."""
    return torch.cat([torch.softmax(y, dim=-1), torch.softmax(-y, dim=-1)], dim=-1)


def log_decay(theta: torch.Tensor) -> torch.Tensor:
    """log gamma_h = log 0.999 + sigmoid(theta_h) (log 0.999999 - log 0.999) (spec EVICTION.md §4, kvpop-paper
    Sec. 2 "fixed log-decay range" and App. E; score::MLstm::log_decay), elementwise in theta's dtype: a value
    in [log 0.999, log 0.999999] ~ [-1.0005e-3, -1.0e-6], differentiable in theta."""
    if not isinstance(theta, torch.Tensor):
        raise TypeError(f"theta = {type(theta).__name__}: must be a torch.Tensor [Hkv]")
    if not theta.is_floating_point():
        raise TypeError(f"theta.dtype = {theta.dtype}: must be a floating-point dtype")
    lo, hi = math.log(GAMMA_MIN), math.log(GAMMA_MAX)
    return lo + torch.sigmoid(theta) * (hi - lo)


def mlstm_scores(k: torch.Tensor, v: torch.Tensor, weights: Mapping[str, torch.Tensor], *, window: int,
                 normalizer: str = "xlstm", soft_cap: float = SOFT_CAP, eps: float = EPS) -> torch.Tensor:
    """KVPOP's delayed mLSTM scores of every token, differentiable in every weight (and in k and v); the
    closed parallel form of spec EVICTION.md §3 (module docstring; kvpop-paper Sec. 2, App. B).

    Shapes: k [B, Hkv, T, D] (D even), v [B, Hkv, T, Dv] (any strides), both float32 or float64 of one dtype and
    device; ``weights`` maps w_q, w_k, w_v [Hkv, X, h], w_i, w_f [Hkv, X], b_i, b_f, b_s, theta [Hkv], w_s [Hkv, h]
    (X = D + Dv, h = D / 2; :func:`weight_shapes`; the names and layouts of the C++ MLstmWeights and of
    ``kvmem.EvictionMemory(scorer="kvpop", weights=...)``) to tensors of k's dtype and device (theta is checked
    but not used here: :func:`effective_keys`). ``window`` (w >= 1, tokens) is the protected window;
    ``normalizer`` "xlstm" or "plain" (spec §3, Q4); ``soft_cap`` the gate cap c (<= 0: no cap); ``eps`` the
    xlstm normaliser's epsilon.

    Returns score [B, Hkv, T] in k's dtype: score_u read out with the state after token u + w - 1 (delayed
    scoring, spec §2), for u = 0 .. T - w (sink tokens included, as the C++ scorer scores them), and -inf for
    the last w - 1 tokens (u + w - 1 >= T: never scored; they are never eligible either, as the C++
    kernels::static_scores leaves them). Every finite entry carries gradient. Work and memory: O(T^2 (D + h))
    and a few [B, Hkv, T - w + 1, T] matrices.

    Raises TypeError for a non-tensor, a dtype other than float32/float64 or k's, a non-integer window, a
    weights object that is not a mapping; ValueError for an odd D (h = D / 2 must be integral), window < 1, v
    not [B, Hkv, T, Dv] of k's B, Hkv, T, an unknown normalizer, a non-finite soft_cap or eps <= 0, and a missing,
    surplus or misshapen weight (naming the tensor and the shape expected)."""
    k = _tensor("k", k, 4, "[B, Hkv, T, D]")
    v = _tensor("v", v, 4, "[B, Hkv, T, Dv]")
    B, H, T, D = k.shape
    Dv = v.shape[3]
    _like("v", v, (B, H, T, Dv), k, "k")
    if D % 2:
        raise ValueError(f"k.shape[3] = head_dim = {D}: must be even for the mLSTM scorer (h = D / 2; spec EVICTION.md §3)")
    w = _count_arg("window", window, 1)
    if normalizer not in ("xlstm", "plain"):
        raise ValueError(f"normalizer = {normalizer!r}: must be 'xlstm' or 'plain'")
    c = _real("soft_cap", soft_cap)
    eps = _real("eps", eps, positive=True)
    W = _weights(weights, k, Dv)
    dt, dev = k.dtype, k.device

    x = torch.cat([k, v], dim=-1)  # x_t = [k_t ; v_t], [B, H, T, X]
    qf = _hedgehog(torch.einsum("bhtx,hxa->bhta", x, W["w_q"]))  # [B, H, T, D]
    kf = _hedgehog(torch.einsum("bhtx,hxa->bhta", x, W["w_k"]))  # [B, H, T, D]
    vf = torch.einsum("bhtx,hxa->bhta", x, W["w_v"])  # [B, H, T, h]
    ig = _cap(torch.einsum("bhtx,hx->bht", x, W["w_i"]) + W["b_i"][:, None], c)  # log input gate
    logf = F_.logsigmoid(_cap(torch.einsum("bhtx,hx->bht", x, W["w_f"]) + W["b_f"][:, None], c))

    U = max(0, T - w + 1)  # tokens scored: u = 0 .. U - 1, each with the state after t = u + w - 1
    never = torch.full((B, H, T - U), float("-inf"), dtype=dt, device=dev)
    if U == 0:
        return never
    F = torch.cumsum(logf.to(torch.float64), dim=-1)  # F_t = sum_{l <= t} log f_l (float64, see the module docstring)
    t_of = torch.arange(w - 1, T, device=dev)  # [U]
    F_t = F[..., t_of]  # [B, H, U]
    decay = (F_t[..., None] - F[..., None, :]).to(dt)  # F_t - F_j = sum_{j < l <= t} log f_l, [B, H, U, T]
    causal = torch.arange(T, device=dev)[None, :] <= t_of[:, None]  # j <= t, [U, T]
    a = (ig[..., None, :] + decay).masked_fill(~causal, float("-inf"))  # i~_j + F_t - F_j
    m = torch.maximum(F_t.to(dt), a.amax(dim=-1))  # the stabiliser m_t (F_t: the initial state, m_0 = 0)
    gains = torch.exp(a - m[..., None])  # exp(i~_j + F_t - F_j - m_t), 0 for j > t
    qu = qf[:, :, :U]
    if normalizer == "xlstm":
        qu = qu / math.sqrt(D)
    S = (qu @ kf.transpose(-1, -2)) * gains  # [B, H, U, T]: q'_u . kf_j with its gain
    num = S @ vf  # q'^T C_t, [B, H, U, h]
    den = S.sum(dim=-1)  # q' . n_t, [B, H, U]
    if normalizer == "xlstm":
        den = torch.maximum(den.abs(), torch.exp(-m)) + eps
    hv = num / den[..., None]
    score = (F_.silu(hv) * W["w_s"][:, None, :]).sum(dim=-1) + W["b_s"][:, None]
    return torch.cat([score, never], dim=-1)


def effective_keys(score: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """The static ranking key kappa_t = score_t - t log gamma_h of spec EVICTION.md §4 for decay interval n = 1
    (kvpop-paper Sec. 2: eff_t(q) = score_t + (q - t) log gamma_h = kappa_t + q log gamma_h, so one order for
    every query; spec Q1, Q2), with log gamma_h from theta as :func:`log_decay`; the key the C++ memory ranks by
    (kernels::effective_score).

    score [B, Hkv, T] (float32 or float64; -inf entries stay -inf), theta [Hkv] of score's dtype and device.
    Returns kappa [B, Hkv, T] in score's dtype, differentiable in score and theta. t is the 0-based token index;
    a common offset of every position would not change the order nor any difference kappa_t - kappa_t', which
    is all the mask and :func:`kvpop_loss` use (spec Q9: in float32, t log gamma ~ 1 at t = 1000 keeps ~1e-7
    absolute precision). Raises TypeError / ValueError naming score or theta for a bad tensor."""
    score = _tensor("score", score, 3, "[B, Hkv, T]")
    theta = _tensor("theta", theta, 1, "[Hkv]")
    _like("theta", theta, (score.shape[1],), score, "score")
    t = torch.arange(score.shape[2], device=score.device, dtype=score.dtype)
    return score - t * log_decay(theta)[:, None]


# ---------------------------------------------------------------------------------------- masks, attention
def _order(kappa: torch.Tensor) -> torch.Tensor:
    """Tokens in the descending order of (kappa_t, t) (higher key first; among equal keys the newer token first),
    [B, H, T] int64: order[..., r] is the token at rank r (spec §5 rank)."""
    T = kappa.shape[-1]
    idx = torch.sort(kappa.detach().flip(-1), dim=-1, descending=True, stable=True).indices
    return (T - 1) - idx


def _row_chunk(B: int, H: int, T: int) -> int:
    return max(1, _CHUNK_ELEMENTS // max(1, B * H * T))


def keep_mask(kappa: torch.Tensor, *, sinks: int, window: int, top_k: int) -> torch.Tensor:
    """The attention mask of the eviction policy for static keys (spec EVICTION.md §5 with its causal term, Q8;
    kvpop-paper App. C eq. 4), equal to what the decode state machine of kvmem.EvictionMemory attends with
    n = 1 (spec §1, §4) and to the C++ training::RunningTopK:

        mask[b, h, q, t] = t <= q and (t < s or q - t < w or (s <= t <= q - w and t is among the top_k of
                           E(q) = {s .. q - w} by (kappa_t, t), higher first, ties to the newer token)).

    kappa [B, Hkv, T] (float32 or float64, no NaN; -inf allowed: such tokens rank last); sinks s >= 0, window w
    >= 1, top_k k >= 0 (tokens). Returns a bool tensor [B, Hkv, T, T] (query, key), no gradient; each row holds
    at most s + w + k ones. Computed by a running count over the ranks (a token is kept at q iff at most k
    eligible tokens rank at or above it), O(T^2) per head, rows in chunks. Raises TypeError / ValueError naming
    kappa, sinks, window or top_k."""
    kappa = _keys("kappa", kappa)
    s, w, k = _policy(sinks, window, top_k)
    B, H, T = kappa.shape
    dev = kappa.device
    order = _order(kappa)
    rank = torch.argsort(order, dim=-1)  # rank[t]
    pos = torch.arange(T, device=dev)
    out = torch.empty(B, H, T, T, dtype=torch.bool, device=dev)
    step = _row_chunk(B, H, T)
    for q0 in range(0, T, step):
        q = pos[q0:q0 + step]  # [n]
        last = (q - w)[:, None]  # the newest eligible token of each query
        tok = order[:, :, None, :]  # [B, H, 1, T] token at each rank
        eligible_at_rank = (tok >= s) & (tok <= last)  # [B, H, n, T]
        count = torch.cumsum(eligible_at_rank, dim=-1, dtype=torch.int32)  # eligible tokens ranked <= r
        within = count.gather(-1, rank[:, :, None, :].expand(B, H, q.shape[0], T)) <= k  # by key t
        t = pos[None, :]
        eligible = (t >= s) & (t <= last)
        out[:, :, q0:q0 + step] = (t <= q[:, None]) & ((t < s) | (q[:, None] - t < w) | (eligible & within))
    return out


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over the keys ``mask`` keeps (spec EVICTION.md §1 step 4: one softmax of q . k / sqrt(D),
    no temperature): y = softmax_{t: mask}(q_q . k_t / sqrt(D)) v, and its log-normalizer (the LSE~ of
    kvpop-paper App. D's first, sparse pass).

    q [B, Hq, T, D], k [B, Hkv, T, D], v [B, Hkv, T, Dv] (float32 or float64, one dtype and device; Hq a multiple
    of Hkv, query head hq reads kv-head hq // (Hq / Hkv)), mask [B, Hkv, T, T] bool (query, key; every row must
    keep a key, as :func:`keep_mask`'s rows keep the query's own token). Returns (y [B, Hq, T, Dv], lse
    [B, Hq, T]) in q's dtype, differentiable in q, k, v. Raises TypeError / ValueError naming the argument."""
    q = _tensor("q", q, 4, "[B, Hq, T, D]")
    k = _tensor("k", k, 4, "[B, Hkv, T, D]")
    v = _tensor("v", v, 4, "[B, Hkv, T, Dv]")
    B, Hq, T, D = q.shape
    H = k.shape[1]
    _like("k", k, (B, H, T, D), q, "q")
    _like("v", v, (B, H, T, v.shape[3]), q, "q")
    if H < 1 or Hq % H:
        raise ValueError(f"q.shape[1] = {Hq}: the query heads must be a multiple of k's kv-heads ({H})")
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"mask = {getattr(mask, 'dtype', type(mask).__name__)}: must be a bool tensor [B, Hkv, T, T]")
    if tuple(mask.shape) != (B, H, T, T):
        raise ValueError(f"mask.shape = {tuple(mask.shape)}: must be [B, Hkv, T, T] = {(B, H, T, T)}")
    G = Hq // H
    logits = (q.reshape(B, H, G, T, D) @ k[:, :, None].transpose(-1, -2)) / math.sqrt(D)
    logits = logits.masked_fill(~mask[:, :, None], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    y = torch.exp(logits - lse[..., None]) @ v[:, :, None]
    return y.reshape(B, Hq, T, v.shape[3]), lse.reshape(B, Hq, T)


# ---------------------------------------------------------------------------------------- training target
def importance_target(q: torch.Tensor, k: torch.Tensor, *, sinks: int, window: int, lse: torch.Tensor | None = None,
                      log: bool = False) -> torch.Tensor:
    """KVPOP's future-attention importance target (kvpop-paper Sec. 2.1 eq. 1, App. D eqs. 5-9; spec EVICTION.md
    §7), per kv-head, without gradient:

        m_{h,t} = max_g sum_{d = t + w}^{T - 1} p^{(h,g)}_{d -> t},  p_{d -> t} = exp(s(d, t) - LSE_d),
        s(d, t) = q^{(h,g)}_d . k^{(h)}_t / sqrt(D),

    the attention that the queries after the protected window pay to key t, for the G query heads of kv-head h
    pooled by the maximum ("existential aggregation", App. D). Computed by the transposed pass of App. D: the
    logits of each query head, turned into log-probabilities by subtracting each query's LSE_d, are reduced by
    a log-sum-exp over the queries d >= t + w (per key t: keys act as queries). One query head and a block of
    rows (LSE) or key columns (the transposed pass) at a time, [B, Hkv, T, n] with B Hkv T n near 2^24, as a
    FlexAttention kernel works blockwise; O(T^2 D) work per query head.

    q [B, Hq, T, D], k [B, Hkv, T, D] (float16, bfloat16, float32 or float64 of one dtype; Hq a multiple of Hkv):
    the base model's queries and keys as its attention uses them (post-RoPE). ``lse`` None: the dense causal
    LSE_d (the exact target); or a [B, Hq, T] tensor of per-query log-normalizers from a first, sparse pass
    (App. D's LSE~: :func:`masked_attention`'s lse, or kvmem's ``prefill(..., lse=...)``), which gives the
    paper's approximation. ``window`` w >= 1 as the memory's; ``sinks`` s >= 0: sink tokens are always kept and
    never ranked (spec §1), so their target is set to 0 like that of the tokens t > T - 1 - w that no query
    after the window reads (spec §7).

    Returns m [B, Hkv, T] (``log=False``; each in [0, T - t - w]) or log m (``log=True``: the transposed pass's
    log-sum-exp itself, finite for every eligible token even where m underflows; -inf where m = 0), float32
    (float64 for float64 inputs), with no gradient. Raises TypeError / ValueError naming q, k, lse, sinks or
    window."""
    dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    q = _tensor("q", q, 4, "[B, Hq, T, D]", dtypes)
    k = _tensor("k", k, 4, "[B, Hkv, T, D]", dtypes)
    B, Hq, T, D = q.shape
    H = k.shape[1]
    _like("k", k, (B, H, T, D), q, "q")
    if H < 1 or Hq % H:
        raise ValueError(f"q.shape[1] = {Hq}: the query heads must be a multiple of k's kv-heads ({H})")
    s, w, _ = _policy(sinks, window)
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    if lse is not None:
        lse = _tensor("lse", lse, 3, "[B, Hq, T]", dtypes)
        if tuple(lse.shape) != (B, Hq, T):
            raise ValueError(f"lse.shape = {tuple(lse.shape)}: must be [B, Hq, T] = {(B, Hq, T)}")
        if lse.device != q.device:
            raise ValueError(f"lse.device = {lse.device}: must be q's device {q.device}")
    G = Hq // H
    with torch.no_grad():
        qg = q.detach().to(work).reshape(B, H, G, T, D)
        kT = k.detach().to(work).transpose(-1, -2) / math.sqrt(D)  # [B, H, D, T]
        lse_g = None if lse is None else lse.detach().to(work).reshape(B, H, G, T)
        pos = torch.arange(T, device=q.device)
        out = torch.full((B, H, T), float("-inf"), dtype=work, device=q.device)
        step = _row_chunk(B, H, T)  # [B, H, T, step] work matrices
        for g in range(G):
            qh = qg[:, :, g]  # [B, H, T, D]
            if lse_g is None:  # LSE_d over the keys t <= d (eq. 5), query rows in chunks
                norm = torch.empty(B, H, T, dtype=work, device=q.device)
                for d0 in range(0, T, step):
                    d = pos[d0:d0 + step]
                    logits = (qh[:, :, d0:d0 + step] @ kT).masked_fill(pos[None, :] > d[:, None], float("-inf"))
                    norm[..., d0:d0 + step] = torch.logsumexp(logits, dim=-1)
            else:
                norm = lse_g[:, :, g]
            for t0 in range(0, T, step):  # the transposed pass (eq. 9), key columns in chunks
                t = pos[t0:t0 + step]
                logp = (qh @ kT[..., t0:t0 + step]) - norm[..., None]  # log p_{d -> t}, [B, H, T (d), n (t)]
                logp = logp.masked_fill(pos[:, None] < t[None, :] + w, float("-inf"))  # keep d >= t + w
                out[..., t0:t0 + step] = torch.maximum(out[..., t0:t0 + step], torch.logsumexp(logp, dim=-2))  # max over g
        out[..., :s] = float("-inf")
        return out if log else torch.exp(out)


class BoundaryPairs(NamedTuple):
    """The teacher's eviction decisions that :func:`kvpop_loss` supervises (kvpop-paper eq. 2), one per query
    q = u + w at which token u = q - w leaves the protected window while more than top_k tokens are eligible,
    u = s + k .. T - 1 - w (Q = max(0, T - s - w - k) decisions; the same u for every sequence and kv-head):

    - ``new`` [Q] int64: u (t_new);
    - ``boundary`` [B, Hkv, Q] int64: t_bnd, the teacher's boundary token of E(q) = {s .. u}: its k-th best
      (the weakest kept) when the teacher evicts u, its (k + 1)-th best (the strongest evicted) when it keeps u;
    - ``keep`` [B, Hkv, Q] bool: the teacher keeps u (y_q = +1) or evicts it (y_q = -1);
    - ``margin`` [B, Hkv, Q]: |kappa^tgt_u - kappa^tgt_bnd|, the teacher margin (target's dtype)."""

    new: torch.Tensor
    boundary: torch.Tensor
    keep: torch.Tensor
    margin: torch.Tensor


def boundary_pairs(target_kappa: torch.Tensor, *, sinks: int, window: int, top_k: int) -> BoundaryPairs:
    """The teacher's decisions at every query where a token leaves the window and competes (:class:`BoundaryPairs`;
    kvpop-paper Sec. 2.1 "Importance Score Loss"), from the teacher's static keys target_kappa [B, Hkv, T]
    (float32 or float64, no NaN; e.g. ``effective_keys(importance_target(..., log=True), theta.detach())``),
    ranked as :func:`keep_mask` ranks (by (key, t), ties to the newer token). No gradient. Raises TypeError /
    ValueError naming target_kappa, sinks, window or top_k, and for a non-finite key of an eligible token
    (s <= t <= T - 1 - w) of a decision."""
    tk = _keys("target_kappa", target_kappa).detach()
    s, w, k = _policy(sinks, window, top_k)
    B, H, T = tk.shape
    dev = tk.device
    u = torch.arange(s + k, max(s + k, T - w), device=dev) if k > 0 else torch.arange(0, device=dev)
    Q = u.shape[0]
    if Q == 0:
        empty = torch.zeros(B, H, 0, dtype=torch.long, device=dev)
        return BoundaryPairs(u, empty, empty.bool(), tk.new_zeros(B, H, 0))
    band = tk[..., s:T - w]
    if not bool(torch.isfinite(band).all()):
        b, h, t = (~torch.isfinite(band)).nonzero()[0].tolist()
        raise ValueError(f"target_kappa[{b}, {h}, {t + s}] = {band[b, h, t].item()}: the key of an eligible token "
                         f"(sinks <= t <= T - 1 - window) must be finite")
    order = _order(tk)
    rank = torch.argsort(order, dim=-1)
    kth, nxt = [], []
    step = _row_chunk(B, H, T)
    for i0 in range(0, Q, step):
        last = u[i0:i0 + step][:, None]  # E(q) = {s .. u}
        tok = order[:, :, None, :]
        count = torch.cumsum((tok >= s) & (tok <= last), dim=-1, dtype=torch.int32)  # [B, H, n, T]
        kth.append((count < k).sum(-1))  # rank of the k-th best eligible token
        nxt.append((count < k + 1).sum(-1))  # rank of the (k + 1)-th
    r_k, r_k1 = torch.cat(kth, dim=-1), torch.cat(nxt, dim=-1)  # [B, H, Q]
    keep = rank[..., u] <= r_k
    boundary = torch.where(keep, order.gather(-1, r_k1), order.gather(-1, r_k))
    new_key, bnd_key = tk[..., u], tk.gather(-1, boundary)
    margin = torch.where(new_key == bnd_key, torch.zeros_like(new_key), (new_key - bnd_key).abs())
    return BoundaryPairs(u, boundary, keep, margin)


def kvpop_loss(kappa: torch.Tensor, target_kappa: torch.Tensor, *, sinks: int, window: int, top_k: int,
               temperature: float = 1.0, margin_weighting: bool = True) -> torch.Tensor:
    """KVPOP's scorer loss (kvpop-paper Sec. 2.1 eq. 2, App. E: temperature 1, margin weighting on):

        L = E_q[ softplus(-y_q (kappa_new - kappa_bnd) / temperature) ],

    over every query q at which token t_new = q - w leaves the window while more than top_k tokens are eligible
    (:func:`boundary_pairs`), y_q = +1 when the teacher keeps t_new and -1 when it evicts it. kappa_new -
    kappa_bnd is the difference of the predicted *effective* scores eff_t(q) = score_t + (q - t) log gamma (the
    q-term cancels, so the static keys of :func:`effective_keys` give it exactly and the decay parameter theta is
    trained through it). With ``margin_weighting`` the mean is weighted by the teacher margin |kappa^tgt_new -
    kappa^tgt_bnd| (down-weighting ambiguous decisions; App. E "Pairwise loss margin weighting: true"), normalised
    by the weights' sum (an unweighted mean when every margin is 0).

    Where the paper is ambiguous, this chooses (and the docstring of BoundaryPairs states) what a practitioner
    would expect:
    - the teacher ranks by target *effective* scores (Sec. 2.1: "computed from target effective scores"):
      pass ``target_kappa = effective_keys(log_m, theta.detach())`` with ``log_m = importance_target(...,
      log=True)`` (log mass: App. D's transposed pass yields log m, and the decay is a log-scale term), or
      ``log_m`` alone for a teacher without decay. The teacher is a target: it carries no gradient;
    - t_bnd, "the boundary key at rank tau_q among eligible keys", is the teacher's k-th best eligible token
      (the weakest kept) when it evicts t_new, but the (k + 1)-th (the strongest evicted) when it keeps t_new:
      the paper's choice would pair t_new with itself whenever t_new is the k-th best (a constant softplus(0)),
      and a kept token must outrank the evicted ones, not the weakest kept one;
    - decisions with at most top_k eligible tokens (nothing is evicted) and top_k = 0 (everything is) carry no
      decision and are left out; the expectation is the mean over every remaining (sequence, kv-head, query),
      all of them rather than a sample ("O(1) per sampled query position").

    kappa [B, Hkv, T] (float32 or float64, the student's keys, differentiable; -inf only where never eligible),
    target_kappa of the same shape (any float dtype; detached). sinks, window, top_k as the memory's; temperature
    > 0. Returns a scalar in kappa's dtype (0, still attached to kappa, when there is no decision). Raises
    TypeError / ValueError naming the argument (shapes, NaN keys, a non-finite key of an eligible token)."""
    kappa = _keys("kappa", kappa)
    target_kappa = _keys("target_kappa", target_kappa)
    if tuple(target_kappa.shape) != tuple(kappa.shape):
        raise ValueError(f"target_kappa.shape = {tuple(target_kappa.shape)}: must be kappa's {tuple(kappa.shape)}")
    if target_kappa.device != kappa.device:
        raise ValueError(f"target_kappa.device = {target_kappa.device}: must be kappa's device {kappa.device}")
    tau = _real("temperature", temperature, positive=True)
    pairs = boundary_pairs(target_kappa, sinks=sinks, window=window, top_k=top_k)
    if pairs.new.numel() == 0:  # attached to kappa, without 0 * -inf
        return torch.where(torch.isfinite(kappa), kappa, torch.zeros_like(kappa)).sum() * 0.0
    band = kappa.detach()[..., sinks:kappa.shape[2] - window]
    if not bool(torch.isfinite(band).all()):
        b, h, t = (~torch.isfinite(band)).nonzero()[0].tolist()
        raise ValueError(f"kappa[{b}, {h}, {t + sinks}] = {band[b, h, t].item()}: the key of an eligible token "
                         f"(sinks <= t <= T - 1 - window) must be finite")
    new = kappa[..., pairs.new]
    bnd = kappa.gather(-1, pairs.boundary)
    y = pairs.keep.to(kappa.dtype) * 2.0 - 1.0
    losses = F_.softplus(-y * (new - bnd) / tau)
    if margin_weighting:
        weight = pairs.margin.to(kappa.dtype)
        total = weight.sum()
        if bool(total > 0):
            return (weight * losses).sum() / total
    return losses.mean()
