"""The memories as Python classes: KvmMemory, OvqMemory, EvictionMemory and TrellisMemory.

Each object owns one compiled C++ memory (see docs/python.md for the compositions compiled in) for one
attention layer and a batch of sequences. ``prefill`` and ``decode`` take torch tensors in the layouts
engines hold, wrap them without a copy, and write the attention output into ``y`` (allocated when not
given):

- ``[B, H, T, D]`` (Hugging Face's layout; any strides with contiguous channels), or
- ``[T, H, D]`` (one sequence's tokens, vLLM-style; the memory's batch must be 1).

Token tensors (q, k, v, y and the family's extras) are of the memory's ``dtype`` (torch.float32, the default,
torch.bfloat16 or torch.float16: what the memory stores its window and state rows in; logits, softmax
statistics and merge arithmetic are float32 in every dtype, docs/numerics.md) on the memory's device
(``kvmem.device()``); learned weights are float32. Bad arguments raise TypeError
(type, dtype) or ValueError (device, shape, value) naming the argument, its value and what was expected,
before any kernel runs; nothing is copied or cast silently. Parameter names and messages are the C++
API's (include/kvmem/*.hpp).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from . import _kvmem, budget as budgets, ops
from ._device import device


def _tensor(name: str, t, rank: tuple[int, ...] = (3, 4), dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Checks type, dtype (``dtype``: float32 for learned weights, the memory's for token tensors), device
    and rank of one argument."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} = {type(t).__name__}: must be a torch.Tensor")
    if t.dtype != dtype:
        raise TypeError(f"{name}.dtype = {t.dtype}: must be {dtype} (kvmem does not cast)")
    if t.device != device():
        raise ValueError(f"{name}.device = {t.device}: must be the memory's device {device()} (kvmem does not copy)")
    if t.dim() not in rank:
        raise ValueError(f"{name}.dim() = {t.dim()}: must be one of {rank}")
    return t


#: The C++ call behind each op, for eager calls (no dispatcher).
_DIRECT = {ops.prefill: _kvmem.prefill, ops.extend: _kvmem.extend, ops.decode: _kvmem.decode}


class Memory:
    """What every memory offers: prefill, decode, reset, sizes and state export.

    Subclasses set the shape fields and call ``_adopt(handle)`` with a handle from the C++ module."""

    #: Names of the extra tensors prefill/decode take after q, k, v (their shapes are in the subclass).
    extras: tuple[str, ...] = ()
    #: How many of ``extras`` may be left out (as trailing None).
    optional_extras: int = 0

    def __init__(self, *, batch: int, query_heads: int, kv_heads: int, head_dim: int, value_dim: int,
                 dtype: torch.dtype = torch.float32):
        self._handle = 0
        #: The dtype of the token tensors and of the memory's keys and values (ops.DTYPES).
        self.dtype = dtype
        self._dtype_name = ops.dtype_name(dtype)  # raises TypeError for a dtype kvmem does not store
        self._code = ops.DTYPES[dtype]
        self.batch, self.query_heads, self.kv_heads = batch, query_heads, kv_heads
        self.head_dim, self.value_dim = head_dim, value_dim
        self._device = device()

    def _adopt(self, handle: int) -> None:
        self._handle = handle

    @property
    def handle(self) -> int:
        """The handle the torch ops kvmem::prefill / kvmem::decode take for this memory."""
        return self._handle

    # --- tensors -------------------------------------------------------------------------------------
    def _token(self, name: str, t, heads: int, channels: int, tokens: int | None, out: list[int]) -> int:
        """Checks token tensor ``t`` ([B, H, T, C], or [T, H, C] for batch 1) and appends its descriptor
        (data pointer, extents and strides as [B, H, T, C]; ops.describe) to ``out``. Returns T. This runs at
        every decode step of every layer, so it reads each property once and makes no view."""
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} = {type(t).__name__}: must be a torch.Tensor")
        if t.dtype is not self.dtype:
            raise TypeError(f"{name}.dtype = {t.dtype}: must be the memory's dtype {self.dtype} (kvmem does not cast)")
        if t.device != self._device:
            raise ValueError(f"{name}.device = {t.device}: must be the memory's device {self._device} (kvmem does not copy)")
        shape, stride = t.shape, t.stride()
        if len(shape) == 3:  # [T, H, C]: one sequence, described as [1, H, T, C]
            if self.batch != 1:
                raise ValueError(f"{name}.shape = {tuple(shape)}: the [tokens, heads, channels] layout holds one "
                                 f"sequence, but the memory's batch is {self.batch}; pass [B, H, T, D]")
            shape = (1, shape[1], shape[0], shape[2])
            stride = (shape[2] * stride[0], stride[1], stride[0], stride[2])
        elif len(shape) != 4:
            raise ValueError(f"{name}.dim() = {len(shape)}: must be one of (3, 4)")
        B, H, T, C = shape
        if B != self.batch:
            raise ValueError(f"{name}.shape[0] = {B}: must equal the memory's batch size {self.batch}")
        if H != heads:
            raise ValueError(f"{name} heads = {H}: must equal {heads}")
        if C != channels:
            raise ValueError(f"{name} channels = {C}: must equal {channels}")
        if tokens is not None and T != tokens:
            raise ValueError(f"{name} tokens = {T}: must equal the token count of q ({tokens})")
        if C > 1 and stride[3] != 1:
            raise ValueError(f"{name}.stride(-1) = {stride[3]}: channels must be contiguous (kvmem does not copy)")
        out.append(t.data_ptr())
        out.extend(shape)
        out.extend(stride)
        return T

    def _gate(self, name: str, t, heads: int, tokens: int) -> torch.Tensor:
        t = _tensor(name, t, (2, 3), self.dtype)
        if t.dim() == 2:  # [T, H]
            if self.batch != 1:
                raise ValueError(f"{name}.shape = {tuple(t.shape)}: [tokens, heads] holds one sequence, but the batch is {self.batch}")
            t = t.unsqueeze(0).transpose(1, 2)
        if tuple(t.shape) != (self.batch, heads, tokens):
            raise ValueError(f"{name}.shape = {tuple(t.shape)}: must be [B, H, T] = {(self.batch, heads, tokens)}")
        return t

    def _extras(self, given: Sequence, tokens: int) -> list[torch.Tensor]:
        """Checks the family's extra tensors (subclasses override _extra)."""
        given = list(given)
        while given and given[-1] is None and len(self.extras) - len(given) < self.optional_extras:
            given.pop()
        need = len(self.extras) - self.optional_extras
        if len(given) < need or len(given) > len(self.extras):
            raise TypeError(f"extra tensors = {len(given)}: {type(self).__name__} takes {', '.join(self.extras)} after q, k, v")
        return [self._extra(self.extras[i], x, tokens) for i, x in enumerate(given)]

    def _extra(self, name: str, t, tokens: int) -> torch.Tensor:
        return self._gate(name, t, self.kv_heads, tokens)

    def _lse(self, t, tokens: int) -> list[int]:
        """Checks the log-sum-exp output ``t`` (float32 [B, Hq, T], or [T, Hq] for batch 1; any strides) and
        returns its descriptor (data pointer, extents and strides as [B, Hq, T]), or [] for None."""
        if t is None:
            return []
        t = _tensor("lse", t, (2, 3))
        if t.dim() == 2:  # [T, Hq]: one sequence
            if self.batch != 1:
                raise ValueError(f"lse.shape = {tuple(t.shape)}: [tokens, heads] holds one sequence, but the batch is {self.batch}")
            t = t.unsqueeze(0).transpose(1, 2)
        if tuple(t.shape) != (self.batch, self.query_heads, tokens):
            raise ValueError(f"lse.shape = {tuple(t.shape)}: must be [B, Hq, T] = {(self.batch, self.query_heads, tokens)}")
        return [t.data_ptr(), *t.shape, *t.stride()]

    def _call(self, op, q, k, v, extras, y, control, lse=None):
        tensors: list[int] = []
        T = self._token("q", q, self.query_heads, self.head_dim, None, tensors)
        self._token("k", k, self.kv_heads, self.head_dim, T, tensors)
        self._token("v", v, self.kv_heads, self.value_dim, T, tensors)
        xs = self._extras(extras, T) if extras else []
        if not xs and len(self.extras) > self.optional_extras:
            self._extras(extras, T)  # raises: this family needs its extra tensors
        if y is None:  # inactive sequences of a decode keep their rows: zeros in a new y
            fill = torch.zeros if op is ops.decode and not all(control) else torch.empty
            y = fill(q.shape[:-1] + (self.value_dim,), dtype=self.dtype, device=q.device)
        self._token("y", y, self.query_heads, self.value_dim, T, tensors)  # C++ refuses a y overlapping q, k or v
        lse_descriptor = self._lse(lse, T)
        tensors.append(self._code)
        if op is ops.decode and control:
            control = [1 if a else 0 for a in control]
        if torch.compiler.is_compiling():  # traced: the custom op (on [B, H, T, C] views), which the graph records
            as4 = lambda t: t.unsqueeze(0).transpose(1, 2) if t.dim() == 3 else t
            as3 = lambda t: t.unsqueeze(0).transpose(1, 2) if t is not None and t.dim() == 2 else t
            op(self._handle, as4(q), as4(k), as4(v), xs, as4(y), control, as3(lse))
        else:  # eager: straight to C++ (a custom op's dispatcher costs more than the checks and the call)
            _DIRECT[op](self._handle, tensors, xs, control, lse_descriptor)
        return y

    # --- the memory's contract ---------------------------------------------------------------------------
    def prefill(self, q, k, v, *extras, y: torch.Tensor | None = None, lengths: Sequence[int] | None = None,
                lse: torch.Tensor | None = None) -> torch.Tensor:
        """Runs a prompt: q [B, Hq, T, D], k [B, Hkv, T, D], v [B, Hkv, T, Dv] (or [T, H, C] for B = 1), the
        family's extras, and writes y [B, Hq, T, Dv] (returned; allocated in q's layout when not given).
        Sequence b takes its first lengths[b] tokens (ragged batch; all T when None) after those it holds; y
        rows past a length are zeros. A sequence with lengths[b] = 0 keeps its state (another request's slot),
        and a sequence that holds tokens continues its prompt (chunked prefill, with the bits of one prefill;
        for Trellis when every piece but the last is a multiple of its chunk). With ``lse`` (float32 [B, Hq, T],
        or [T, Hq] for B = 1, any strides) the readout's log-sum-exp is written there too: the natural log of
        each query's softmax normalizer over the keys it read, -inf past a length, to merge y with attention
        over other keys (docs/python.md). Raises ValueError for a length outside [0, T] or an lse of another
        shape, TypeError for an lse that is not float32, and ValueError for an lse on a memory whose readout
        is not one softmax (TrellisMemory)."""
        lengths = [] if lengths is None else [int(n) for n in lengths]
        if lengths and len(lengths) != self.batch:
            raise ValueError(f"len(lengths) = {len(lengths)}: must equal the batch size {self.batch}")
        return self._call(ops.prefill, q, k, v, extras, y, lengths, lse)

    def extend(self, q, k, v, *extras, y: torch.Tensor | None = None, lengths: Sequence[int] | None = None,
               lse: torch.Tensor | None = None) -> torch.Tensor:
        """prefill() that only continues prompts (chunked prefill): sequence b takes lengths[b] tokens after
        the ones it holds. Raises ValueError naming the sequence when one with lengths[b] > 0 holds no token
        (start it with prefill()), before anything changes; otherwise as prefill()."""
        lengths = [] if lengths is None else [int(n) for n in lengths]
        if lengths and len(lengths) != self.batch:
            raise ValueError(f"len(lengths) = {len(lengths)}: must equal the batch size {self.batch}")
        return self._call(ops.extend, q, k, v, extras, y, lengths, lse)

    @property
    def strict_slots(self) -> bool:
        """The strict slot protocol (off by default): when on, prefill() refuses a sequence that holds tokens
        (a request in a busy slot: extend() continues a prompt, reset_sequence() frees the slot) and decode()
        one that holds none (a step of a request that never started), each with a ValueError naming the
        sequence and its state, before anything changes."""
        return _kvmem.strict_slots(self._handle)

    @strict_slots.setter
    def strict_slots(self, on: bool) -> None:
        _kvmem.set_strict_slots(self._handle, bool(on))

    def decode(self, q, k, v, *extras, y: torch.Tensor | None = None, active: Sequence[bool] | None = None,
               lse: torch.Tensor | None = None) -> torch.Tensor:
        """Appends one token per sequence (T = 1) and writes its output row into y [B, Hq, 1, Dv]; with
        ``active`` (one bool per sequence) only those sequences advance and the others' rows of y are left
        as they were. Continues whatever prefill or earlier decodes left. ``lse`` (float32 [B, Hq, 1]) as in
        prefill, written for the active sequences."""
        active = [] if active is None else [bool(a) for a in active]
        if active and len(active) != self.batch:
            raise ValueError(f"len(active) = {len(active)}: must equal the batch size {self.batch}")
        return self._call(ops.decode, q, k, v, extras, y, active, lse)

    def reset(self) -> None:
        """Forgets every sequence; keeps the allocations."""
        _kvmem.reset(self._handle)

    def reset_sequence(self, sequence: int) -> None:
        """Forgets sequence ``sequence`` alone (a finished request frees its slot): its next tokens run as in
        a new memory, and every other sequence keeps its state bit for bit. Raises ValueError for a sequence
        outside [0, batch)."""
        if not 0 <= sequence < self.batch:
            raise ValueError(f"sequence = {sequence}: must be in [0, {self.batch})")
        _kvmem.reset_sequence(self._handle, int(sequence))

    def allocated_bytes(self) -> int:
        """Bytes this memory has allocated on its device (state, caches, scratch)."""
        return _kvmem.allocated_bytes(self._handle)

    def held_bytes(self) -> int:
        """Bytes of keys/values (state rows, window, slots) the batch holds for the tokens seen, in the
        memory's dtype (half of float32's for bfloat16 and float16)."""
        return _kvmem.held_bytes(self._handle)

    def tokens(self, sequence: int = 0) -> int:
        """Tokens sequence ``sequence`` has seen since construction or reset()."""
        if not 0 <= sequence < self.batch:
            raise ValueError(f"sequence = {sequence}: must be in [0, {self.batch})")
        return _kvmem.tokens(self._handle, sequence)

    def state(self) -> dict[str, torch.Tensor | list[int]]:
        """The memory's state as CPU tensors (copies): KVM/OVQ keys [B, Hkv, capacity, D], values, radius or
        counts [B, Hkv, capacity] and rows (live rows per sequence); eviction keys/values per slot, slot
        positions, kept_positions [B, Hkv, K] and kept_rows [B, Hkv]; Trellis m1 [B, H, m, D], m2 [B, H, m, Dv].
        Keys, values, m1 and m2 of a bfloat16 or float16 memory come as float32 (widened exactly)."""
        out = {}
        for name, value in _kvmem.state(self._handle).items():
            out[name] = torch.from_numpy(value) if hasattr(value, "shape") else list(value)
        return out

    def close(self) -> None:
        """Frees the C++ memory now (also done when the object is collected)."""
        if self._handle:
            _kvmem.release(self._handle)
            self._handle = 0

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: kvmem already finalized every memory
            pass


def _weight(name: str, t, n: int, default: float) -> torch.Tensor:
    if t is None:
        return torch.full((n,), default, dtype=torch.float32, device=device())
    t = _tensor(name, t, (1,))
    if t.shape[0] != n:
        raise ValueError(f"{name}.shape = {tuple(t.shape)}: must be [{n}]")
    return t


def _config(native_type, **fields):
    cfg = native_type()
    for key, value in fields.items():
        setattr(cfg, key, value)
    return cfg


class KvmMemory(Memory):
    """KVM (kvm-paper Sec. 4; spec KVM.md): state rows merged by gated winner-take-all, a block sliding
    window of ``window_chunks * chunk`` tokens, rows appended by novelty under a budget schedule.

    Shapes: q [B, Hq, T, D], k [B, Hkv, T, D], v [B, Hkv, T, Dv], optional gate [B, Hkv, T] (merge-gate
    pre-activation z; None means z = 0). Learned weights (copied at construction): ln_weight, ln_bias [D]
    (state-key LayerNorm; default 1 and 0), tau_state, tau_window [Hq] (inverse temperatures; default 1:
    logits q . k / sqrt(D)). ``evict_rows_above`` > 0 also evicts state rows by H2O above that many (fixed
    and power-law budgets). Units: chunk, window in tokens; sinks, max_rows in rows.

    ``dtype`` (torch.float32, torch.bfloat16 or torch.float16; default float32): the dtype of every token
    tensor it takes and writes and of its window and the read copies of its state rows (the rows' merge
    sums stay float32); raises TypeError for another."""

    extras = ("gate",)
    optional_extras = 1

    def __init__(self, head_dim: int, query_heads: int, kv_heads: int, *, value_dim: int | None = None, batch: int = 1,
                 chunk: int = 256, window_chunks: int = 2, rope_dims: int = 0, sinks: int = 1, max_rows: int = 256,
                 budget: budgets.Schedule = budgets.Fixed(256), ln_weight=None, ln_bias=None, tau_state=None,
                 tau_window=None, evict_rows_above: int = 0, ln_eps: float = 1e-5, norm_eps: float = 1e-12,
                 dtype: torch.dtype = torch.float32):
        value_dim = head_dim if value_dim is None else value_dim
        super().__init__(batch=batch, query_heads=query_heads, kv_heads=kv_heads, head_dim=head_dim, value_dim=value_dim,
                         dtype=dtype)
        cfg = _config(_kvmem.MemoryConfig, head_dim=head_dim, value_dim=value_dim, query_heads=query_heads,
                      kv_heads=kv_heads, chunk=chunk, window_chunks=window_chunks, rope_dims=rope_dims, sinks=sinks,
                      max_rows=max_rows, ln_eps=ln_eps, norm_eps=norm_eps)
        self._adopt(_kvmem.make_kvm(cfg, budgets.to_args(budget, _kvmem), _weight("ln_weight", ln_weight, head_dim, 1.0),
                                    _weight("ln_bias", ln_bias, head_dim, 0.0), _weight("tau_state", tau_state, query_heads, 1.0),
                                    _weight("tau_window", tau_window, query_heads, 1.0), batch, evict_rows_above,
                                    self._dtype_name))


class OvqMemory(Memory):
    """OVQ (ovq-paper Sec. 3.2; spec OVQ.md): centroids with counts updated by online k-means, read with a
    log-count bias, a window of one chunk, the plateau budget t * N / (t + N) by default, no sinks.

    Shapes as KvmMemory (gate optional and unused by OVQ's merge unless given). ``beta`` [Hq] is the
    logit scale (default 1). Units: chunk in tokens; max_centroids in rows.

    ``dtype`` (torch.float32, torch.bfloat16 or torch.float16; default float32): the dtype of every token
    tensor it takes and writes and of its window and the read copies of its state rows (the rows' merge
    sums stay float32); raises TypeError for another."""

    extras = ("gate",)
    optional_extras = 1

    def __init__(self, head_dim: int, query_heads: int, kv_heads: int | None = None, *, value_dim: int | None = None,
                 batch: int = 1, chunk: int = 64, max_centroids: int = 1024, budget: budgets.Schedule | None = None,
                 beta=None, normalize_centroids: bool = False, dtype: torch.dtype = torch.float32):
        value_dim = head_dim if value_dim is None else value_dim
        kv_heads = query_heads if kv_heads is None else kv_heads
        super().__init__(batch=batch, query_heads=query_heads, kv_heads=kv_heads, head_dim=head_dim, value_dim=value_dim,
                         dtype=dtype)
        cfg = _config(_kvmem.MemoryConfig, head_dim=head_dim, value_dim=value_dim, query_heads=query_heads,
                      kv_heads=kv_heads, chunk=chunk, window_chunks=1, rope_dims=0, sinks=0, max_rows=max_centroids,
                      normalize_rows=normalize_centroids)
        schedule = budgets.Plateau(float(max_centroids)) if budget is None else budget
        self._adopt(_kvmem.make_ovq(cfg, budgets.to_args(schedule, _kvmem), _weight("beta", beta, query_heads, 1.0), batch,
                                    self._dtype_name))


class EvictionMemory(Memory):
    """A fixed-budget KV cache (kvpop-paper Sec. 2; spec EVICTION.md): per (sequence, kv-head) the first
    ``sinks`` tokens, the last ``window`` tokens and the ``top_k`` others with the highest score, one
    softmax over them (logits q . k / sqrt(D)). Budget: sinks + window + top_k rows.

    ``scorer``: "streaming" (StreamingLLM: no retained set beyond recency), "knorm" (key norm), "h2o"
    (accumulated attention; ``h2o_normalize`` for the mean), "tova" (last query's attention;
    ``tova_layer_mean``), "snapkv" (the attention of the observation window of queries, average-pooled over
    5 neighbouring positions), "kvpop" (learned mLSTM: ``weights`` maps w_q, w_k, w_v, w_i, b_i, w_f, b_f, w_s,
    b_s, theta to tensors, copied at construction; ``normalizer`` "xlstm" or "plain"). No extra tensors.

    ``chunk`` (tokens): when it evicts. 1 (the default): at every token (streaming). C > 1: once per chunk of
    C positions, scored by the last ``observation_window`` queries of the chunk before (holds at most
    budget + C rows). 0: at the end of the prompt, as kvpress and SnapKV compress: ``prefill`` attends the
    whole prompt exactly, its last ``observation_window`` queries score the tokens, and the first ``decode``
    step evicts down to the budget (holds the prompt until then). ``observation_window`` (queries, default 64
    as kvpress; 0: every query of the chunk). SnapKV's own setting: scorer "snapkv", chunk 0, sinks 0,
    window = observation_window + 1 (docs/eviction.md "Compression per chunk and at the end of a prompt").

    ``merge_evicted``: merge where eviction forgets. An evicted row is folded into the kept row (sinks
    excepted) whose key is most similar (cosine), as count-weighted means of keys and values, and every row
    is read with the logit bias log(count) (docs/eviction.md "Merging eviction"). Same budget in rows, plus a
    float32 count per row.

    ``dtype`` (torch.float32, torch.bfloat16 or torch.float16; default float32): the dtype of every token
    tensor it takes and writes and of the keys and values it stores; raises TypeError for another."""

    def __init__(self, head_dim: int, query_heads: int, kv_heads: int, *, value_dim: int | None = None, batch: int = 1,
                 scorer: str = "h2o", sinks: int = 4, window: int = 64, top_k: int = 448, decay_interval: int = 1,
                 h2o_normalize: bool = False, tova_layer_mean: bool = False,
                 weights: Mapping[str, torch.Tensor] | None = None, normalizer: str = "xlstm",
                 merge_evicted: bool = False, chunk: int = 1, observation_window: int = 64,
                 dtype: torch.dtype = torch.float32):
        value_dim = head_dim if value_dim is None else value_dim
        super().__init__(batch=batch, query_heads=query_heads, kv_heads=kv_heads, head_dim=head_dim, value_dim=value_dim,
                         dtype=dtype)
        cfg = _config(_kvmem.EvictionConfig, head_dim=head_dim, value_dim=value_dim, query_heads=query_heads,
                      kv_heads=kv_heads, sinks=sinks, window=window, top_k=top_k, decay_interval=decay_interval,
                      merge_evicted=bool(merge_evicted), chunk=chunk, observation_window=observation_window)
        w = {}
        for name, t in (weights or {}).items():
            w[name] = _tensor(f"weights['{name}']", t, (1, 2, 3))
        self.scorer = scorer
        self._adopt(_kvmem.make_eviction(cfg, batch, scorer, h2o_normalize, tova_layer_mean, w, normalizer, self._dtype_name))


class ProportionalMemory(Memory):
    """Proportional merging (kvmem::merge::Proportional), a merge memory for a pretrained model without
    training: state rows hold the sums of their tokens' keys and values (as given, RoPE'd) and a count, and
    are read as the mean key and mean value with the logit bias log(count) at the model's scale 1 / sqrt(D).
    A block sliding window of ``window_chunks * chunk`` tokens; when a chunk leaves it, the budget schedule
    says how many of its tokens found rows (the least similar first) and the others join the row whose mean
    key has the largest dot product with theirs. The first ``sinks`` tokens stay rows of their own. Holding
    every token as its own row, it is exact attention.

    Shapes: q [B, Hq, T, D], k [B, Hkv, T, D], v [B, Hkv, T, Dv]; no extra tensor (a gate is accepted and
    ignored). Units: chunk in tokens; sinks, max_rows in rows.

    ``dtype`` (torch.float32, torch.bfloat16 or torch.float16; default float32): the dtype of every token
    tensor it takes and writes and of its window and the read copies of its rows (the sums and counts stay
    float32); raises TypeError for another."""

    extras = ("gate",)
    optional_extras = 1

    def __init__(self, head_dim: int, query_heads: int, kv_heads: int, *, value_dim: int | None = None, batch: int = 1,
                 chunk: int = 256, window_chunks: int = 2, sinks: int = 1, max_rows: int = 256,
                 budget: budgets.Schedule = budgets.Fixed(256), dtype: torch.dtype = torch.float32):
        value_dim = head_dim if value_dim is None else value_dim
        super().__init__(batch=batch, query_heads=query_heads, kv_heads=kv_heads, head_dim=head_dim, value_dim=value_dim,
                         dtype=dtype)
        cfg = _config(_kvmem.MemoryConfig, head_dim=head_dim, value_dim=value_dim, query_heads=query_heads,
                      kv_heads=kv_heads, chunk=chunk, window_chunks=window_chunks, rope_dims=0, sinks=sinks,
                      max_rows=max_rows)
        self._adopt(_kvmem.make_proportional(cfg, budgets.to_args(budget, _kvmem), batch, self._dtype_name))


class TrellisMemory(Memory):
    """Trellis (trellis-paper Sec. 3, eqs. 4-14; spec TRELLIS.md): per (sequence, head) two fast-weight
    matrices M1 [m, D], M2 [m, Dv] trained at test time by gradient descent.

    Extras after q, k, v [B, H, T, D/Dv]: alpha [B, H, T, m] (latent targets) and the gates beta1, gamma1,
    beta2, gamma2 [B, H, T] (forget gates in [0, 1], step sizes >= 0). ``phi``: identity, silu, softmax,
    tanh or sigmoid; ``f``: ln-silu, l2-silu, softmax or identity; ln_weight, ln_bias [m] (optional affine).
    Units: slots m rows per head, chunk tokens.

    ``dtype`` (torch.float32, torch.bfloat16 or torch.float16; default float32): the dtype of every token
    tensor it takes and writes and of the keys and values it stores; raises TypeError for another."""

    extras = ("alpha", "beta1", "gamma1", "beta2", "gamma2")

    def __init__(self, slots: int, head_dim: int, heads: int, *, value_dim: int | None = None, batch: int = 1,
                 chunk: int = 16, phi: str = "silu", f: str = "ln-silu", readout2_phi: bool = True, grad_scale: float = 2.0,
                 check_gates: bool = True, ln_weight=None, ln_bias=None, dtype: torch.dtype = torch.float32):
        value_dim = head_dim if value_dim is None else value_dim
        super().__init__(batch=batch, query_heads=heads, kv_heads=heads, head_dim=head_dim, value_dim=value_dim, dtype=dtype)
        self.slots = slots
        cfg = _config(_kvmem.TrellisConfig, slots=slots, head_dim=head_dim, value_dim=value_dim, heads=heads, chunk=chunk,
                      readout2_phi=readout2_phi, grad_scale=grad_scale, check_gates=check_gates)
        lw = None if ln_weight is None else _tensor("ln_weight", ln_weight, (1,))
        lb = None if ln_bias is None else _tensor("ln_bias", ln_bias, (1,))
        self._adopt(_kvmem.make_trellis(cfg, phi, f, lw, lb, batch, self._dtype_name))

    def _extra(self, name: str, t, tokens: int) -> torch.Tensor:
        if name == "alpha":  # checked as a token tensor, passed on as a [B, H, T, m] view
            self._token("alpha", t, self.kv_heads, self.slots, tokens, [])
            return t.unsqueeze(0).transpose(1, 2) if t.dim() == 3 else t
        return self._gate(name, t, self.kv_heads, tokens)


def softmax_scale_ok(head_dim: int, scaling: float) -> bool:
    """True when ``scaling`` is the 1 / sqrt(head_dim) every kvmem readout uses (up to float rounding)."""
    return math.isclose(scaling, 1.0 / math.sqrt(head_dim), rel_tol=1e-6)
