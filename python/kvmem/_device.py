"""The torch device of kvmem's compiled memories: "cpu" in a build on Kokkos' host backends, the current CUDA
device in a build on Kokkos::Cuda (DLPack device type 2)."""

from __future__ import annotations

import functools

import torch

from . import _kvmem


@functools.cache
def device() -> torch.device:
    """The device every kvmem tensor must be on."""
    if _kvmem.dlpack_device() == 2:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
