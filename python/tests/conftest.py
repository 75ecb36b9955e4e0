"""Shared fixtures of the Python tests (run by scripts/test through CTest's python.pytest, or by hand:
``/opt/kvmem-venv/bin/python -m pytest python/tests`` inside the build environment)."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "tools"))  # safetensors_np


@pytest.fixture
def rand():
    """rand(*shape) -> float32 standard normal tensor from a fixed stream (one per test)."""
    g = torch.Generator().manual_seed(1234)
    return lambda *shape: torch.randn(*shape, generator=g)


@pytest.fixture
def kvmem_run():
    """Path of the kvmem-run binary (KVMEM_RUN, set by CTest); skips when not given."""
    path = os.environ.get("KVMEM_RUN")
    if not path:
        pytest.skip("KVMEM_RUN is not set (CTest's python.pytest sets it)")
    return path
