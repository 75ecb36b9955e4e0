"""KVM's training form: the chunk-parallel prefill of kvmem's KVM memory as a differentiable PyTorch forward.

What it computes is what ``kvmem.KvmMemory(...).prefill`` computes (spec KVM.md §2-§5, kvm-paper Sec. 4 and
App. A), in the dtype of its inputs (float32 or float64), batched over sequences and kv-heads with a loop over
chunks only:

- memory keys ``kbar = LN_s(k with channels [0, rope_dims) zeroed)`` (§2), merge gates ``g = 1 + ELU(z)``;
- the front block (the first ``window_chunks * chunk`` tokens) reads exact causal attention (§4);
- the state starts with the first chunk's rows (ungated), and each later chunk's queries read the state rows
  (keys ``LN_s(K)`` at ``tau_state / sqrt(D)``, values ``rho * V / |V|``) and the block sliding window (raw
  keys at ``tau_window / sqrt(D)``, causal) with one softmax (§3);
- after each chunk the overflow block leaves the window and folds into the state (§5): the budget grants
  ``n_app`` new rows to the block's most novel tokens (lowest arg-max score against ``LN_s(K)``; ties by
  token index), and every other token joins, gated, the row ``argmax_{i >= sinks} g kbar . LN_s(K_i)``
  (winner-take-all; the first maximum wins).

The decisions (which tokens append, which row each merged token joins) are made on detached values, as the
paper trains it (routing by arg-max); gradients flow through the folded sums K and V, the LayerNorm affine,
the gates and both temperatures into ``q``, ``k``, ``v``, ``gate``, ``ln_weight``, ``ln_bias``, ``tau_state``
and ``tau_window``. ``rule="proportional"`` is kvmem's merge::Proportional (raw keys, ungated folds, rows
read as ``K / n`` and ``V / n`` with the logit bias ``log n``). Row eviction (``evict_rows_above``) has no
training form.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .. import budget as budgets


class KvmForward(NamedTuple):
    """What :func:`kvm_prefill` returns: the attention output and the final state, as the C++ memory holds it.

    - ``y`` [B, Hq, T, Dv]: the attention output of every query;
    - ``keys`` [B, Hkv, M, D], ``values`` [B, Hkv, M, Dv]: the rows' running sums K and V (not ``LN_s(K)``
      nor the read values), rows in creation order;
    - ``radius`` [B, Hkv, M]: each row's value radius ``rho`` (the norm of its first value);
    - ``counts`` [B, Hkv, M]: tokens folded into each row (1 for a row that never merged);
    - ``rows``: M, the live rows of every sequence and kv-head."""

    y: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    radius: torch.Tensor
    counts: torch.Tensor
    rows: int


def window_begin(n: int, chunk: int, window: int) -> int:
    """First token of the block sliding window once ``n`` tokens exist: max(0, ceil(n / C) * C - L), in tokens
    (spec KVM.md §2; kvmem::state::window_begin)."""
    return max(0, -(-n // chunk) * chunk - window)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LN_s over the last axis: biased variance, then the affine ``weight``, ``bias`` [D] (spec KVM.md §2)."""
    mu = x.mean(-1, keepdim=True)
    var = (x - mu).square().mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * weight + bias


def merge_gate(z: torch.Tensor) -> torch.Tensor:
    """g = 1 + ELU(z): 1 + z for z > 0, exp(z) otherwise (spec KVM.md §2); its derivative at z = 0 is 1 (both
    sides agree), which training from the neutral gate z = 0 needs."""
    return 1.0 + torch.nn.functional.elu(z)


def _check(name: str, t, shape: tuple, dtype: torch.dtype | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} = {type(t).__name__}: must be a torch.Tensor")
    if t.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{name}.dtype = {t.dtype}: the training forms run float32 or float64")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name}.dtype = {t.dtype}: must be q's dtype {dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}.shape = {tuple(t.shape)}: must be {shape}")
    return t


def _rank4(name: str, t, layout: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} = {type(t).__name__}: must be a torch.Tensor {layout}")
    if t.dim() != 4:
        raise ValueError(f"{name}.shape = {tuple(t.shape)}: must be {layout}")
    if t.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{name}.dtype = {t.dtype}: the training forms run float32 or float64")
    return t


class _State:
    """The rows of every sequence and kv-head: running sums K [B, Hkv, m, D], V [B, Hkv, m, Dv], radii and
    counts [B, Hkv, m]. Updates are out of place, so autograd keeps every chunk's version."""

    def __init__(self, keys, values, counts):
        self.K, self.V = keys, values
        self.rho = torch.linalg.vector_norm(values, dim=-1)
        self.n = counts

    @property
    def rows(self) -> int:
        return self.K.shape[2]

    def append(self, keys, values):
        self.K = torch.cat([self.K, keys], dim=2)
        self.V = torch.cat([self.V, values], dim=2)
        self.rho = torch.cat([self.rho, torch.linalg.vector_norm(values, dim=-1)], dim=2)
        self.n = torch.cat([self.n, torch.ones_like(values[..., 0])], dim=2)


class _Kvm:
    """One prefill's constants and learned weights; methods follow spec KVM.md's sections."""

    def __init__(self, *, chunk, window_chunks, sinks, max_rows, budget, rule, ln_weight, ln_bias, ln_eps, norm_eps):
        self.C, self.L, self.sinks, self.max_rows, self.budget = chunk, chunk * window_chunks, sinks, max_rows, budget
        self.proportional = rule == "proportional"
        self.w, self.b, self.ln_eps, self.norm_eps = ln_weight, ln_bias, ln_eps, norm_eps

    def read(self, st: _State):
        """What the readout reads of the rows (§3): keys [B, Hkv, m, D], values [B, Hkv, m, Dv], logit bias
        [B, Hkv, m] or None."""
        if self.proportional:
            return st.K / st.n[..., None], st.V / st.n[..., None], torch.log(st.n)
        norm = torch.clamp(torch.linalg.vector_norm(st.V, dim=-1, keepdim=True), min=self.norm_eps)
        return layer_norm(st.K, self.w, self.b, self.ln_eps), st.rho[..., None] * st.V / norm, None

    def update(self, st: _State, kbar, v, g, ctx: int, avail: int) -> None:
        """§5: folds one overflow block (kbar, v [B, Hkv, C, .], gates g [B, Hkv, C]) into the state."""
        m, n_block = st.rows, kbar.shape[2]
        target = max(m, min(self.budget.rows(ctx), avail, self.max_rows))
        n_app = min(target - m, n_block)
        if 0 < n_app < n_block:  # the most novel tokens append: lowest best score, then lowest index (§5.3)
            with torch.no_grad():
                score = (kbar @ self.read(st)[0].transpose(-1, -2)).amax(-1)  # ungated, every row
                order = torch.sort(score, dim=-1, stable=True).indices
                appended = torch.zeros_like(score, dtype=torch.bool).scatter(-1, order[..., :n_app], True)
        else:
            appended = torch.full(kbar.shape[:3], n_app == n_block, dtype=torch.bool, device=kbar.device)
        # token indices in increasing order: appended ones, then the others (stable sort of the mask)
        by_mask = torch.sort((~appended).to(torch.int8), dim=-1, stable=True).indices
        app, rest = by_mask[..., :n_app], by_mask[..., n_app:]
        if n_app:
            st.append(_take(kbar, app), _take(v, app))
        if rest.shape[-1] == 0:
            return
        P = min(self.sinks, st.rows)
        if st.rows <= P:
            raise ValueError(f"sinks = {self.sinks}: a merge needs more than {P} rows (sinks must be below the chunk)")
        g_rest = _take(g[..., None], rest)
        kg, vg = g_rest * _take(kbar, rest), g_rest * _take(v, rest)
        with torch.no_grad():  # winner-take-all against one snapshot of the rows, taken after the appends (§5.5)
            row = P + (kg @ self.read(st)[0][:, :, P:].transpose(-1, -2)).argmax(-1)
        B, H, m = st.K.shape[:3]
        flat = (row + m * torch.arange(B * H, device=row.device).reshape(B, H, 1)).reshape(-1)
        st.K = st.K.reshape(B * H * m, -1).index_add(0, flat, kg.reshape(flat.numel(), -1)).reshape(st.K.shape)
        st.V = st.V.reshape(B * H * m, -1).index_add(0, flat, vg.reshape(flat.numel(), -1)).reshape(st.V.shape)
        st.n = st.n.reshape(-1).index_add(0, flat, torch.ones_like(flat, dtype=st.n.dtype)).reshape(st.n.shape)


def _take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, H, n, c] at token indices index [B, H, k] -> [B, H, k, c]."""
    return torch.gather(x, 2, index[..., None].expand(*index.shape, x.shape[-1]))


def _attend(q, tau_state, tau_window, rows, wk, wv, qpos: int, wpos: int):
    """§3 for the queries [qpos, qpos + n) of every kv-head's G query heads: q [B, Hkv, G, n, D], tau_* [Hkv,
    G, 1, 1]; rows = (keys, values, bias) or None; window keys and values wk, wv [B, Hkv, w, .] at positions
    [wpos, wpos + w). Returns [B, Hkv, G, n, Dv]."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    n, w = q.shape[3], wk.shape[2]
    logits = (q * (tau_window * scale)) @ wk[:, :, None].transpose(-1, -2)
    causal = torch.arange(wpos, wpos + w, device=q.device)[None, :] <= torch.arange(qpos, qpos + n, device=q.device)[:, None]
    logits = logits.masked_fill(~causal, float("-inf"))
    values = wv[:, :, None]
    if rows is not None:
        keys, row_values, bias = rows
        state = (q * (tau_state * scale)) @ keys[:, :, None].transpose(-1, -2)
        if bias is not None:
            state = state + bias[:, :, None, None, :]
        logits = torch.cat([state, logits], dim=-1)
        values = torch.cat([row_values, wv], dim=2)[:, :, None]
    return torch.softmax(logits, dim=-1) @ values


def kvm_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None = None,
                ln_weight: torch.Tensor | None = None, ln_bias: torch.Tensor | None = None,
                tau_state: torch.Tensor | None = None, tau_window: torch.Tensor | None = None, *, chunk: int = 256,
                window_chunks: int = 2, rope_dims: int = 0, sinks: int = 1, max_rows: int = 256,
                budget: budgets.Schedule = budgets.Fixed(256), rule: str = "kvm", ln_eps: float = 1e-5,
                norm_eps: float = 1e-12) -> KvmForward:
    """KVM's chunk-parallel prefill of T tokens per sequence from an empty memory, differentiable (module
    docstring; spec KVM.md §2-§5, kvm-paper Sec. 4 and App. A).

    Shapes: q [B, Hq, T, D], k [B, Hkv, T, D], v [B, Hkv, T, Dv] (any strides), gate [B, Hkv, T] (merge-gate
    pre-activation z; None: z = 0), ln_weight, ln_bias [D] (default 1 and 0), tau_state, tau_window [Hq]
    (default 1). Every tensor float32 or float64, of q's dtype and device; every sequence has T tokens.
    Arguments as kvmem.KvmMemory's: chunk and window_chunks * chunk (the window) in tokens, sinks and
    max_rows in rows, ``budget`` a kvmem.budget schedule (Plateau is OVQ's), ``rule`` "kvm" or
    "proportional".

    Returns a :class:`KvmForward` equal to what ``kvmem.KvmMemory(...).prefill`` writes and holds on the same
    inputs, within the rounding of q's dtype. Raises TypeError for a non-tensor or a dtype other than
    float32/float64 or q's, ValueError for a shape that disagrees with q's (the message names the argument),
    chunk, window_chunks or max_rows < 1, sinks < 0, rope_dims outside [0, D], an unknown rule or budget, and
    sinks that leave a merge no row."""
    q = _rank4("q", q, "[B, Hq, T, D]")
    B, Hq, T, D = q.shape
    Hkv = _rank4("k", k, "[B, Hkv, T, D]").shape[1]
    k = _check("k", k, (B, Hkv, T, D), q.dtype)
    v = _check("v", v, (B, Hkv, T, _rank4("v", v, "[B, Hkv, T, Dv]").shape[3]), q.dtype)
    Dv = v.shape[3]
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"q heads = {Hq}: must be a multiple of k's kv-heads ({Hkv})")
    for name, value, low in (("chunk", chunk, 1), ("window_chunks", window_chunks, 1), ("max_rows", max_rows, 1),
                             ("sinks", sinks, 0)):
        if not isinstance(value, int) or value < low:
            raise ValueError(f"{name} = {value!r}: must be an int >= {low}")
    if not isinstance(rope_dims, int) or not 0 <= rope_dims <= D:
        raise ValueError(f"rope_dims = {rope_dims!r}: must be in [0, head_dim = {D}]")
    if rule not in ("kvm", "proportional"):
        raise ValueError(f"rule = {rule!r}: must be 'kvm' or 'proportional'")
    if not isinstance(budget, (budgets.Fixed, budgets.PowerLaw, budgets.Saturating, budgets.Plateau)):
        raise TypeError(f"budget = {budget!r}: must be kvmem.budget.Fixed, PowerLaw, Saturating or Plateau")
    dt, dev = q.dtype, q.device

    def weight(name, t, n, default):
        if t is None:
            return torch.full((n,), default, dtype=dt, device=dev)
        return _check(name, t, (n,), dt)

    gate = torch.zeros(B, Hkv, T, dtype=dt, device=dev) if gate is None else _check("gate", gate, (B, Hkv, T), dt)
    w, b = weight("ln_weight", ln_weight, D, 1.0), weight("ln_bias", ln_bias, D, 0.0)
    G = Hq // Hkv
    tau_s = weight("tau_state", tau_state, Hq, 1.0).reshape(Hkv, G, 1, 1)
    tau_w = weight("tau_window", tau_window, Hq, 1.0).reshape(Hkv, G, 1, 1)
    kvm = _Kvm(chunk=chunk, window_chunks=window_chunks, sinks=sinks, max_rows=max_rows, budget=budget, rule=rule,
               ln_weight=w, ln_bias=b, ln_eps=ln_eps, norm_eps=norm_eps)
    if kvm.proportional:  # raw keys, ungated folds
        kbar, g = k, torch.ones_like(gate)
    else:
        kz = torch.cat([torch.zeros_like(k[..., :rope_dims]), k[..., rope_dims:]], dim=-1)
        kbar, g = layer_norm(kz, w, b, ln_eps), merge_gate(gate)
    qg = q.reshape(B, Hkv, G, T, D)
    C, L = chunk, kvm.L
    outputs = []
    front = min(T, L)
    if front:  # the front block: exact causal attention, no state (§4)
        outputs.append(_attend(qg[:, :, :, :front], tau_s, tau_w, None, k[:, :, :front], v[:, :, :front], 0, 0))
    first = min(T, C)
    st = _State(kbar[:, :, :first], v[:, :, :first], torch.ones_like(g[:, :, :first]))
    for s in range(front, T, C):
        e = min(T, s + C)
        bb = window_begin(e, C, L)
        outputs.append(_attend(qg[:, :, :, s:e], tau_s, tau_w, kvm.read(st), k[:, :, bb:e], v[:, :, bb:e], s, bb))
        nb = window_begin(min(T, e + C), C, L)
        if nb > bb:
            kvm.update(st, kbar[:, :, bb:nb], v[:, :, bb:nb], g[:, :, bb:nb], ctx=e, avail=nb)
    y = torch.cat(outputs, dim=3).reshape(B, Hq, T, Dv) if outputs else v.new_zeros(B, Hq, 0, Dv)
    return KvmForward(y, st.K, st.V, st.rho, st.n, st.rows)
