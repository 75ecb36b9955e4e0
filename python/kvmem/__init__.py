"""kvmem: bounded attention memories (KVM, OVQ, Trellis, eviction) for LLM inference, as PyTorch ops.

    import torch, kvmem
    memory = kvmem.KvmMemory(head_dim=64, query_heads=8, kv_heads=2, budget=kvmem.budget.PowerLaw(256, 16.0))
    y = memory.prefill(q, k, v)          # q [B, 8, T, 64], k and v [B, 2, T, 64], float32
    y1 = memory.decode(q1, k1, v1)       # one more token per sequence

Kokkos starts when this package is imported, with as many host threads as torch.get_num_threads() (or
KVMEM_NUM_THREADS), and is finalized at interpreter exit after every memory is freed. Both libraries use the
same OpenMP runtime; see docs/python.md for thread counts. The Hugging Face integration is
kvmem.transformers (it imports transformers only when used).
"""

from __future__ import annotations

import atexit
import os

import torch

from . import _kvmem

_kvmem.initialize(int(os.environ.get("KVMEM_NUM_THREADS", torch.get_num_threads())))
atexit.register(_kvmem.finalize)

from . import budget, ops  # noqa: E402  (the ops need Kokkos running only when called)
from ._device import device  # noqa: E402
from .memories import EvictionMemory, KvmMemory, Memory, OvqMemory, ProportionalMemory, TrellisMemory  # noqa: E402


def backend() -> str:
    """Kokkos' default execution space and its concurrency, e.g. "OpenMP (2 threads)"."""
    return _kvmem.backend()


__all__ = ["EvictionMemory", "KvmMemory", "Memory", "OvqMemory", "ProportionalMemory", "TrellisMemory", "backend", "budget",
           "device", "ops"]
__version__ = "0.1.0"
