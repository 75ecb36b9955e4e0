"""The torch.library custom ops ``kvmem::prefill`` and ``kvmem::decode``.

Both take a memory handle (an int: what torch.compile can trace), the token tensors and an output tensor
``y`` that they write in place (``mutates_args=("y",)``), and return nothing. Their fake (meta)
implementations do nothing, since ``y`` already has its final shape: a model that calls them traces under
torch.compile without graph breaks and ``torch.library.opcheck`` passes. The memory classes of
kvmem.memories check every argument before they call these ops; the C++ side checks shapes again.

Tensors (views of the caller's tensors, no copy; any strides with a contiguous channel axis):
  q [B, Hq, T, D], k [B, Hkv, T, D], v [B, Hkv, T, Dv], y [B, Hq, T, Dv] (written),
  extras: the family's extra tensors (KVM/OVQ: [] or [gate [B, Hkv, T]]; Trellis: alpha [B, H, T, m],
  beta1, gamma1, beta2, gamma2 [B, H, T]).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import _kvmem


@torch.library.custom_op("kvmem::prefill", mutates_args=("y",))
def prefill(handle: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extras: Sequence[torch.Tensor],
            y: torch.Tensor, lengths: Sequence[int]) -> None:
    """Runs T tokens of every sequence through memory ``handle`` (sequence b: its first lengths[b] tokens;
    all T when ``lengths`` is empty) and writes y. Raises ValueError for shapes the memory rejects."""
    _kvmem.prefill(handle, q.detach(), k.detach(), v.detach(), [x.detach() for x in extras], y.detach(), list(lengths))


@prefill.register_fake
def _(handle, q, k, v, extras, y, lengths) -> None:
    return None


@torch.library.custom_op("kvmem::decode", mutates_args=("y",))
def decode(handle: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extras: Sequence[torch.Tensor],
           y: torch.Tensor, active: Sequence[int]) -> None:
    """Runs one token of every sequence b with active[b] != 0 (all when ``active`` is empty) through memory
    ``handle`` and writes its row of y (rows of inactive sequences are left as they were)."""
    _kvmem.decode(handle, q.detach(), k.detach(), v.detach(), [x.detach() for x in extras], y.detach(),
                  [1 if a else 0 for a in active])


@decode.register_fake
def _(handle, q, k, v, extras, y, active) -> None:
    return None
