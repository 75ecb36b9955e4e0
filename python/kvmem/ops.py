"""The torch.library custom ops ``kvmem::prefill``, ``kvmem::extend`` and ``kvmem::decode``, and how tensors cross into C++.

Both ops take a memory handle (an int: what torch.compile can trace), the token tensors, an output tensor
``y`` and optionally ``lse`` (the readout's log-sum-exp, float32 [B, Hq, T]) that they write in place
(``mutates_args=("y", "lse")``), and return nothing. Their fake (meta)
implementations do nothing, since ``y`` already has its final shape: a model that calls them traces under
torch.compile without graph breaks and ``torch.library.opcheck`` passes. The memory classes of
kvmem.memories check every argument and, outside torch.compile tracing, call the C++ module directly
(``call``): the dispatcher of a custom op costs tens of microseconds, a decode step's whole budget.

Tensors (views of the caller's tensors, no copy; any strides with a contiguous channel axis):
  q [B, Hq, T, D], k [B, Hkv, T, D], v [B, Hkv, T, Dv], y [B, Hq, T, Dv] (written),
  extras: the family's extra tensors (KVM/OVQ: [] or [gate [B, Hkv, T]]; Trellis: alpha [B, H, T, m],
  beta1, gamma1, beta2, gamma2 [B, H, T]).
All of them in the memory's dtype (``DTYPES``: float32, bfloat16 or float16), which they keep: kvmem reads
and writes 16-bit tensors as they are and computes in float32.
They cross as a descriptor: per tensor its data pointer, extents and strides, then the dtype's code
(``describe``), which C++ wraps as unmanaged Kokkos views of that type after checking the code against the
memory's dtype; DLPack would cost microseconds per tensor at every step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

from . import _kvmem
from ._device import device


#: The dtypes a memory stores its tokens in, and the code each has in a descriptor (C++: python/src/tensors.hpp).
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def dtype_name(dtype: torch.dtype) -> str:
    """The name C++ takes for a memory's dtype ("float32", "bfloat16", "float16"); raises TypeError for
    any other dtype."""
    if dtype not in DTYPES:
        raise TypeError(f"dtype = {dtype}: must be torch.float32, torch.bfloat16 or torch.float16")
    return str(dtype).removeprefix("torch.")


def describe(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, y: torch.Tensor) -> list[int]:
    """The 37-integer descriptor of q, k, v, y: (data pointer, 4 extents, 4 strides in elements) each, then
    the code of their dtype (DTYPES). Raises TypeError for a dtype kvmem does not store or for tensors of
    different dtypes, and ValueError for another device, a rank other than 4 or non-contiguous channels,
    naming the tensor: the checks that keep a raw pointer safe. C++ then checks the dtype against the
    memory's."""
    out: list[int] = []
    dev = device()
    for name, t in (("q", q), ("k", k), ("v", v), ("y", y)):
        if t.dtype not in DTYPES:
            raise TypeError(f"{name}.dtype = {t.dtype}: must be torch.float32, torch.bfloat16 or torch.float16 (kvmem does not cast)")
        if t.dtype != q.dtype:
            raise TypeError(f"{name}.dtype = {t.dtype}: must be q's dtype {q.dtype} (kvmem does not cast)")
        if t.device != dev:
            raise ValueError(f"{name}.device = {t.device}: must be the memory's device {dev} (kvmem does not copy)")
        if t.dim() != 4:
            raise ValueError(f"{name}.dim() = {t.dim()}: must be 4 ([B, H, T, C])")
        stride = t.stride()
        if stride[3] != 1 and t.shape[3] > 1:
            raise ValueError(f"{name}.stride(-1) = {stride[3]}: channels must be contiguous (kvmem does not copy)")
        out.append(t.data_ptr())
        out.extend(t.shape)
        out.extend(stride)
    out.append(DTYPES[q.dtype])
    return out


def describe_lse(lse: torch.Tensor | None) -> list[int]:
    """The 7-integer descriptor of lse [B, Hq, T] (data pointer, 3 extents, 3 strides in elements), or []
    for None. Raises TypeError for a dtype other than float32 and ValueError for another device or a rank
    other than 3; C++ checks the extents against the memory."""
    if lse is None:
        return []
    if lse.dtype != torch.float32:
        raise TypeError(f"lse.dtype = {lse.dtype}: must be torch.float32")
    if lse.device != device():
        raise ValueError(f"lse.device = {lse.device}: must be the memory's device {device()} (kvmem does not copy)")
    if lse.dim() != 3:
        raise ValueError(f"lse.dim() = {lse.dim()}: must be 3 ([B, Hq, T])")
    return [lse.data_ptr(), *lse.shape, *lse.stride()]


def call(run, handle: int, q, k, v, extras: Sequence[torch.Tensor], y, control: Sequence[int], lse=None) -> None:
    """Runs ``_kvmem.prefill`` or ``_kvmem.decode`` (``run``) on the tensors, without the dispatcher."""
    run(handle, describe(q, k, v, y), [x.detach() for x in extras], control, describe_lse(lse))


@torch.library.custom_op("kvmem::prefill", mutates_args=("y", "lse"))
def prefill(handle: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extras: Sequence[torch.Tensor],
            y: torch.Tensor, lengths: Sequence[int], lse: Optional[torch.Tensor] = None) -> None:
    """Runs T tokens of every sequence through memory ``handle`` (sequence b: its first lengths[b] tokens;
    all T when ``lengths`` is empty) and writes y, and the readout's log-sum-exp into ``lse`` when given.
    Raises ValueError for shapes the memory rejects."""
    call(_kvmem.prefill, handle, q, k, v, extras, y, list(lengths), lse)


@prefill.register_fake
def _(handle, q, k, v, extras, y, lengths, lse=None) -> None:
    return None


@torch.library.custom_op("kvmem::extend", mutates_args=("y", "lse"))
def extend(handle: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extras: Sequence[torch.Tensor],
           y: torch.Tensor, lengths: Sequence[int], lse: Optional[torch.Tensor] = None) -> None:
    """prefill that only continues prompts (chunked prefill): a sequence with lengths[b] > 0 must hold
    tokens. Raises ValueError naming the sequence otherwise, or for shapes the memory rejects."""
    call(_kvmem.extend, handle, q, k, v, extras, y, list(lengths), lse)


@extend.register_fake
def _(handle, q, k, v, extras, y, lengths, lse=None) -> None:
    return None


@torch.library.custom_op("kvmem::decode", mutates_args=("y", "lse"))
def decode(handle: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extras: Sequence[torch.Tensor],
           y: torch.Tensor, active: Sequence[int], lse: Optional[torch.Tensor] = None) -> None:
    """Runs one token of every sequence b with active[b] != 0 (all when ``active`` is empty) through memory
    ``handle`` and writes its row of y (rows of inactive sequences are left as they were), and of ``lse``
    when given."""
    call(_kvmem.decode, handle, q, k, v, extras, y, [1 if a else 0 for a in active], lse)


@decode.register_fake
def _(handle, q, k, v, extras, y, active, lse=None) -> None:
    return None
