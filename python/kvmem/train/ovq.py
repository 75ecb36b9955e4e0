"""OVQ's training form: the chunk-parallel prefill of kvmem's OVQ memory as a differentiable PyTorch forward.

What it computes is what ``kvmem.OvqMemory(...).prefill`` computes (ovq-paper Sec. 3.2 eqs. 15-19 and App. 8.3;
spec OVQ.md §2-§5, which resolves the paper's ambiguities and is followed where they differ), in the dtype of
its inputs (float32 or float64), batched over sequences, kv-heads and query heads with a loop over chunks only:

- keys and queries are unit-normalized, ``khat = k / (||k|| + 1e-5)``, and a query's logits are
  ``beta * sqrt(D) * qhat . key`` (spec §2; the paper's beta is ``beta * sqrt(D)``, spec §8);
- each kv-head holds a dictionary of centroids: keys ``Dk`` [m, D], values ``Dv`` [m, Dv] and counts [m]. Its
  live size while chunk c (tokens ``[c C, min(T, (c + 1) C))``) is read is ``sizes[c]`` (:func:`dictionary_sizes`:
  the budget's rows after each full chunk, as the C++ memory's plan, spec §3 and ovq-paper eqs. 17-18);
- the queries of chunk c read, with one softmax, the live centroids (logit bias ``log(count)``) and the chunk's
  own normalized keys up to their own position (causal; tokens of earlier chunks are never read raw), spec §4,
  ovq-paper eq. 15;
- after its readout a *full* chunk is committed (spec §5, ovq-paper eq. 19): with live rows (m > 0) every token
  is assigned its nearest centroid (largest ``khat . Dk_i``; the lowest row wins a tie) and the ``num_new``
  tokens of smallest best similarity found new rows ``m, m + 1, ...`` in order of (similarity, token index);
  with no live row (m == 0) the chunk's first token seeds row 0, the ``num_new - 1`` tokens least similar to it
  found rows ``1, 2, ...`` and every other token joins row 0 (also when ``num_new == 0``: the spec's m == 0
  quirk, row 0 then fills before it is live). Every touched row becomes the running mean
  ``(c_old D_old + sum x) / c_new`` of its keys and values (optionally L2-normalized); a final partial chunk is
  never committed.

The discrete decisions (assignments and which tokens found rows) are made on detached values, as the paper
trains OVQ (routing by arg-max, new centroids by top-k); gradients flow through the centroid means and both
softmaxes into ``q``, ``k``, ``v`` and ``beta``. GQA: query head h reads kv-head ``h // (Hq / Hkv)`` with its own
``beta[h]``; the dictionary of a kv-head is built from that kv-head's keys and values alone (it does not depend
on beta) and is shared by its query heads, as the C++ memory holds it ([B, Hkv, rows, .]).

Numerics follow the C++ memory (merge::KMeansCount, kernels/update/update.hpp): ``khat = k * (1 / (||k|| + 1e-5))``, a
fold ``(c_old * D_old + sum of the tokens in token order) * (1 / c_new)``, normalization
``x * (1 / max(||x||, 1e-12))`` of the touched rows only. Decision scores are matmul products, recomputed with
the channel products summed in channel order for every (sequence, kv-head) where a decision lies within rounding
of a tie (a matmul rounds one product differently at different positions), so that exact ties, such as repeated
keys or centroids founded by copies of one key, go to the lower index as in the C++ memory and the float64
reference. Scores that are equal only in exact arithmetic (the mean of several copies of a key against a copy
of it) are decided by rounding, as the C++ memory decides them, not as the reference (incremental folds, exactly
rounded dot products) does; the reference reports those as near-ties.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ._checks import count as _count_arg

from .. import budget as budgets

#: epsilon added to the norm of q and k: x / (||x|| + 1e-5) (spec OVQ.md §2, §9 #6; merge::KMeansCount::key_eps).
KEY_EPS = 1e-5
#: epsilon of the centroid normalization x / max(||x||, 1e-12) (spec OVQ.md §5.5; MemoryConfig::norm_eps).
NORM_EPS = 1e-12


class OvqForward(NamedTuple):
    """What :func:`ovq_prefill` returns: the attention output and the final committed dictionary, as the C++
    memory exports it (``kvmem.OvqMemory.state()`` rows ``[0, rows)``).

    - ``y`` [B, Hq, T, Dv]: the attention output of every query (ovq-paper eq. 15, spec OVQ.md §4);
    - ``keys`` [B, Hkv, M, D], ``values`` [B, Hkv, M, Dv]: the centroids ``Dk``, ``Dv`` of every sequence and
      kv-head (running means of the keys ``khat`` and values folded into them; L2-normalized with
      ``normalize_centroids``), rows in creation order;
    - ``counts`` [B, Hkv, M]: tokens folded into each centroid (a float tensor of the inputs' dtype, no gradient);
    - ``rows``: M, the live rows of every sequence and kv-head after the last full chunk
      (``dictionary_sizes(T, ...)[T // chunk]``, spec OVQ.md §5 end)."""

    y: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    counts: torch.Tensor
    rows: int


def _validate_budget(budget) -> budgets.Schedule:
    """Checks a schedule's type and parameters as the C++ constructor does (kvmem::budget::*::validate)."""
    if not isinstance(budget, (budgets.Fixed, budgets.PowerLaw, budgets.Saturating, budgets.Plateau)):
        raise TypeError(f"budget = {budget!r}: must be None or kvmem.budget.Fixed, PowerLaw, Saturating or Plateau")
    checks = []
    if hasattr(budget, "min_rows"):
        checks.append(("min_rows", budget.min_rows >= -1, "must be >= -1"))
    if hasattr(budget, "round_down"):
        checks.append(("round_down", budget.round_down >= 1, "must be >= 1"))
    if isinstance(budget, budgets.PowerLaw):
        checks.append(("growth_factor", math.isfinite(budget.growth_factor) and budget.growth_factor >= 0,
                       "must be finite and >= 0"))
        checks.append(("growth_exponent", math.isfinite(budget.growth_exponent) and budget.growth_exponent >= 0,
                       "must be finite and >= 0"))
    if isinstance(budget, budgets.Saturating):
        checks.append(("saturation_n", math.isfinite(budget.saturation_n) and budget.saturation_n > 0,
                       "must be finite and > 0"))
    if isinstance(budget, budgets.Plateau):
        checks.append(("n", math.isfinite(budget.n) and budget.n >= 1, "must be finite and >= 1"))
    for field, ok, what in checks:
        if not ok:
            raise ValueError(f"budget.{field} = {getattr(budget, field)!r}: {what}")
    return budget




def dictionary_sizes(tokens: int, *, chunk: int, max_centroids: int, budget: budgets.Schedule | None = None) -> list[int]:
    """Live dictionary rows while each chunk is read: ``sizes[c]`` for c = 0 .. tokens // chunk (a list of
    ``tokens // chunk + 1`` ints, in rows; chunk c is tokens ``[c chunk, (c + 1) chunk)``, the last one possibly
    partial), ``sizes[0] = 0``.

    After the full chunk c the memory plans, as kvmem::state::plan_update for OVQ (window = one chunk, so the
    budget's context is ``t = (c + 1) * chunk`` tokens): ``target = max(m, min(B(t), t, max_centroids))`` and
    ``sizes[c + 1] = m + min(target - m, chunk)`` with ``m = sizes[c]`` and B the schedule's ``rows(t)``
    (``budget`` None: ``kvmem.budget.Plateau(max_centroids)``, B(t) = floor(t N / (t + N)), ovq-paper eq. 17;
    ``sizes[c + 1] - sizes[c]`` is eq. 18's n_new). Spec OVQ.md §3 (its float64 reference caps
    ``min(max(B(t), m), N, m + chunk)``, the same sizes since m <= c * chunk).

    ``tokens`` (>= 0), ``chunk`` (tokens, >= 1) and ``max_centroids`` (rows, >= 1) are ints. Raises TypeError for
    a non-integer count or a budget that is not a kvmem.budget schedule, ValueError for a count out of range or
    a schedule parameter the C++ constructor refuses (naming the field)."""
    tokens = _count_arg("tokens", tokens, 0)
    chunk = _count_arg("chunk", chunk, 1)
    max_centroids = _count_arg("max_centroids", max_centroids, 1)
    schedule = budgets.Plateau(float(max_centroids)) if budget is None else _validate_budget(budget)
    sizes = [0]
    for c in range(tokens // chunk):
        m, t = sizes[-1], (c + 1) * chunk
        target = max(m, min(schedule.rows(t), t, max_centroids))
        sizes.append(m + min(target - m, chunk))
    return sizes


def _unit(x: torch.Tensor) -> torch.Tensor:
    """x / (||x||_2 + 1e-5) over the last axis (spec OVQ.md §2), as x times the reciprocal like the C++ memory."""
    return x * (1.0 / (torch.linalg.vector_norm(x, dim=-1, keepdim=True) + KEY_EPS))


def _attend(qs, keys, values, counts, kc, vc):
    """Spec OVQ.md §4 for one chunk of n tokens: qs [B, Hkv, G, n, D] scaled unit queries, live centroids keys
    [B, Hkv, m, D], values [B, Hkv, m, Dv], counts [B, Hkv, m], the chunk's unit keys kc [B, Hkv, n, D] and
    values vc [B, Hkv, n, Dv]. Returns y [B, Hkv, G, n, Dv]."""
    n = kc.shape[2]
    logits = qs @ kc[:, :, None].transpose(-1, -2)  # [B, Hkv, G, n, n]
    future = torch.ones(n, n, dtype=torch.bool, device=qs.device).triu(1)
    logits = logits.masked_fill(future, float("-inf"))
    vals = vc
    if keys.shape[2]:
        dictionary = qs @ keys[:, :, None].transpose(-1, -2) + torch.log(counts)[:, :, None, None, :]
        logits = torch.cat([dictionary, logits], dim=-1)
        vals = torch.cat([values, vc], dim=2)
    return torch.softmax(logits, dim=-1) @ vals[:, :, None]


def _ordered_dots(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x [P, n, D] . rows [P, m, D]^T -> [P, n, m], each entry the channel products summed in channel order: the
    same roundings for every entry, so equal vectors score equal wherever they sit. (A matmul's blocking rounds
    the same product differently at different positions, which would decide exact ties, such as repeated keys
    or two centroids founded by copies of one key, by position instead of by index.)"""
    P, n, D = x.shape
    if D == 0:
        return x.new_zeros(P, n, rows.shape[1])
    xt, rt = x.transpose(-1, -2).contiguous(), rows.transpose(-1, -2).contiguous()
    out = xt[:, 0, :, None] * rt[:, 0, None, :]
    for d in range(1, D):
        out += xt[:, d, :, None] * rt[:, d, None, :]
    return out


def _similarities(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Decision scores x [B, H, n, D] . rows [B, H, m, D]^T -> [B, H, n, m] (detached inputs, m >= 1): a matmul,
    recomputed by _ordered_dots for every (sequence, kv-head) where a decision is within rounding of a tie: a
    token's two best rows, or two tokens' best scores, closer than 4 D eps |x| max|row|, four times the most two
    roundings of one dot product can differ (2 gamma_D |x| |row| ~ D eps |x| |row|). Elsewhere the matmul's
    decisions are those of any rounding, and within a recomputed (sequence, kv-head) exact ties go to the lower
    index as in the C++ memory and the reference."""
    B, H, n, D = x.shape
    m = rows.shape[2]
    sim = x @ rows.transpose(-1, -2)
    bound = 4.0 * max(D, 1) * torch.finfo(x.dtype).eps
    tol = bound * torch.linalg.vector_norm(x, dim=-1) * torch.linalg.vector_norm(rows, dim=-1).amax(-1, keepdim=True)
    best = sim.amax(-1)
    near_best = (sim >= (best - tol)[..., None]).sum(-1) > 1  # [B, H, n]
    ranked = torch.sort(best, dim=-1).values
    near_rank = (ranked[..., 1:] - ranked[..., :-1] <= tol.amax(-1, keepdim=True)).any(-1)  # [B, H]
    redo = (near_best.any(-1) | near_rank).reshape(-1).nonzero().squeeze(1)
    if redo.numel():
        flat = sim.reshape(B * H, n, m)
        flat[redo] = _ordered_dots(x.reshape(B * H, n, D)[redo], rows.reshape(B * H, m, D)[redo])
        sim = flat.reshape(B, H, n, m)
    return sim


def _assign(keys, kc, m: int, num_new: int) -> torch.Tensor:
    """Spec OVQ.md §5.1 on detached values: the row [0, m + num_new) (or [0, max(num_new, 1)) when m == 0) each
    token of the full chunk kc [B, H, C, D] folds into, [B, H, C] int64."""
    B, H, C, D = kc.shape
    with torch.no_grad():
        kd = kc.detach()
        if m == 0:  # seeding: row 0 from the first token; the least similar to it found rows 1 ..
            assign = torch.zeros(B, H, C, dtype=torch.long, device=kc.device)
            if num_new > 1:
                sim0 = _ordered_dots(kd.reshape(B * H, C, D), kd[:, :, :1].reshape(B * H, 1, D)).reshape(B, H, C)
                sim0[..., 0] = float("inf")
                order = torch.sort(sim0, dim=-1, stable=True).indices[..., : num_new - 1]
                ids = torch.arange(1, num_new, device=kc.device).expand(B, H, num_new - 1)
                assign = assign.scatter(-1, order, ids)
            return assign
        sim = _similarities(kd, keys[:, :, :m].detach())  # [B, H, C, m]
        assign = sim.argmax(dim=-1)  # the first (lowest) row of the maximum
        if num_new > 0:
            best = sim.amax(dim=-1)
            order = torch.sort(best, dim=-1, stable=True).indices[..., :num_new]  # (similarity, token index) ascending
            ids = torch.arange(m, m + num_new, device=kc.device).expand(B, H, num_new)
            assign = assign.scatter(-1, order, ids)
        return assign


def _normalize_rows(x: torch.Tensor) -> torch.Tensor:
    """x / max(||x||, 1e-12) over the last axis (spec OVQ.md §5.5)."""
    return x * (1.0 / torch.clamp(torch.linalg.vector_norm(x, dim=-1, keepdim=True), min=NORM_EPS))


def _commit(keys, values, counts, kc, vc, m: int, num_new: int, normalize: bool):
    """Spec OVQ.md §5 (ovq-paper eq. 19): folds the full chunk kc [B, H, C, D], vc [B, H, C, Dv] into the
    dictionary keys [B, H, R, D], values [B, H, R, Dv], counts [B, H, R] (R rows hold data: the m live ones, or
    row 0 alone under the m == 0 quirk). Returns the new (keys, values, counts) with R' >= R rows; out of place."""
    B, H, C, D = kc.shape
    Dv = vc.shape[3]
    assign = _assign(keys, kc, m, num_new)
    R_old = keys.shape[2]
    R = max(R_old, m + num_new, 1)
    if R > R_old:  # rows founded by this chunk start empty (count 0): the fold makes them their tokens' mean
        keys = torch.cat([keys, keys.new_zeros(B, H, R - R_old, D)], dim=2)
        values = torch.cat([values, values.new_zeros(B, H, R - R_old, Dv)], dim=2)
        counts = torch.cat([counts, counts.new_zeros(B, H, R - R_old)], dim=2)
    flat = (assign + R * torch.arange(B * H, device=kc.device).reshape(B, H, 1)).reshape(-1)
    new_counts = counts.reshape(-1).index_add(0, flat, counts.new_ones(flat.shape[0])).reshape(B, H, R)
    touched = (new_counts > counts)[..., None]
    inverse = (1.0 / torch.clamp(new_counts, min=1.0))[..., None]
    k_sum = (keys * counts[..., None]).reshape(B * H * R, D).index_add(0, flat, kc.reshape(-1, D))
    v_sum = (values * counts[..., None]).reshape(B * H * R, Dv).index_add(0, flat, vc.reshape(-1, Dv))
    k_new = k_sum.reshape(B, H, R, D) * inverse
    v_new = v_sum.reshape(B, H, R, Dv) * inverse
    if normalize:
        k_new, v_new = _normalize_rows(k_new), _normalize_rows(v_new)
    # rows no token joined stay as they were (the C++ memory neither refolds nor renormalizes them)
    return torch.where(touched, k_new, keys), torch.where(touched, v_new, values), new_counts


def _tensor(name: str, t, layout: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} = {type(t).__name__}: must be a torch.Tensor {layout}")
    if t.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{name}.dtype = {t.dtype}: the training forms run float32 or float64")
    if t.dim() != len(layout.split(",")):
        raise ValueError(f"{name}.shape = {tuple(t.shape)}: must be {layout}")
    return t


def ovq_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, *, chunk: int,
                max_centroids: int, budget: budgets.Schedule | None = None,
                normalize_centroids: bool = False) -> OvqForward:
    """OVQ's chunk-parallel prefill of T tokens per sequence from an empty dictionary, differentiable (module
    docstring; ovq-paper Sec. 3.2 eqs. 15-19 and App. 8.3, spec OVQ.md §2-§5).

    Shapes (Hugging Face layout, any strides): q [B, Hq, T, D], k [B, Hkv, T, D], v [B, Hkv, T, Dv], beta [Hq]
    (each query head's learned logit scale: logits ``beta * sqrt(D) * cos(q, k)``). Every tensor float32 or
    float64, all of one dtype and device; the computation runs in that dtype. Every sequence has T tokens
    (T >= 0). Hq must be a multiple of Hkv; query head h reads kv-head ``h // (Hq // Hkv)``.
    Arguments as kvmem.OvqMemory's: ``chunk`` in tokens (C), ``max_centroids`` in rows (N, the row cap),
    ``budget`` a kvmem.budget schedule of the dictionary's rows after t tokens (None: Plateau(max_centroids),
    t N / (t + N)), ``normalize_centroids`` to L2-normalize every centroid key and value after each fold.

    Returns an :class:`OvqForward` (y [B, Hq, T, Dv]; keys [B, Hkv, M, D], values [B, Hkv, M, Dv], counts
    [B, Hkv, M] and rows = M of the dictionary committed after the last full chunk) equal to what
    ``kvmem.OvqMemory(...).prefill`` writes and holds on the same inputs, within the rounding of the dtype.
    Gradients flow from y, keys and values to q, k, v and beta (not through the discrete decisions).

    Raises TypeError for a q, k, v or beta that is not a tensor or not float32/float64, a k, v or beta of
    another dtype than q, a non-integer chunk or max_centroids, or a budget that is not a kvmem.budget schedule;
    ValueError for a shape that disagrees with q's (q, k, v not rank 4, k or v with another B or T, k with
    another D, v with another Hkv, beta not [Hq]), Hq not a multiple of Hkv, tensors on different devices,
    chunk or max_centroids < 1, or a schedule parameter the C++ constructor refuses. Each message names the
    argument and its value."""
    q = _tensor("q", q, "[B, Hq, T, D]")
    k = _tensor("k", k, "[B, Hkv, T, D]")
    v = _tensor("v", v, "[B, Hkv, T, Dv]")
    beta = _tensor("beta", beta, "[Hq]")
    B, Hq, T, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[3]
    for name, t in (("k", k), ("v", v), ("beta", beta)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}.dtype = {t.dtype}: must be q's dtype {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}.device = {t.device}: must be q's device {q.device}")
    if tuple(k.shape) != (B, Hkv, T, D):
        raise ValueError(f"k.shape = {tuple(k.shape)}: must be [B, Hkv, T, D] with q's B = {B}, T = {T}, D = {D}")
    if tuple(v.shape) != (B, Hkv, T, Dv):
        raise ValueError(f"v.shape = {tuple(v.shape)}: must be [B, Hkv, T, Dv] with B = {B}, Hkv = {Hkv}, T = {T}")
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"q heads = {Hq}: must be a multiple of k's kv-heads ({Hkv}), which must be >= 1")
    if tuple(beta.shape) != (Hq,):
        raise ValueError(f"beta.shape = {tuple(beta.shape)}: must be [Hq] = ({Hq},)")
    sizes = dictionary_sizes(T, chunk=chunk, max_centroids=max_centroids, budget=budget)
    C, G, normalize = int(chunk), Hq // Hkv, bool(normalize_centroids)

    scale = (beta * math.sqrt(D)).reshape(Hkv, G, 1, 1)
    qs = _unit(q).reshape(B, Hkv, G, T, D) * scale  # spec §2: logits are then plain dot products
    khat = _unit(k)
    keys, values, counts = k.new_zeros(B, Hkv, 0, D), v.new_zeros(B, Hkv, 0, Dv), k.new_zeros(B, Hkv, 0)
    outputs = []
    for c, s in enumerate(range(0, T, C)):
        e, m = min(T, s + C), sizes[c]
        kc, vc = khat[:, :, s:e], v[:, :, s:e]
        outputs.append(_attend(qs[:, :, :, s:e], keys[:, :, :m], values[:, :, :m], counts[:, :, :m], kc, vc))
        if e - s == C:  # only full chunks are committed (spec §5 end)
            keys, values, counts = _commit(keys, values, counts, kc, vc, m, sizes[c + 1] - m, normalize)
    y = torch.cat(outputs, dim=3).reshape(B, Hq, T, Dv) if outputs else v.new_zeros(B, Hq, 0, Dv)
    rows = sizes[-1]
    return OvqForward(y, keys[:, :, :rows], values[:, :, :rows], counts[:, :, :rows], rows)
