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


@pytest.fixture(scope="module")
def model():
    """A tiny Llama with random weights (3 layers, hidden 64, 4 query heads, 2 kv-heads, head_dim 16, vocabulary
    96), float32, in eval mode, one per test module; skips without transformers."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   pad_token_id=0, eos_token_id=1, bos_token_id=2)
    return transformers.LlamaForCausalLM(cfg).eval()


#: Tokens per sequence of the ``prompt`` fixture.
PROMPT_TOKENS = 48


@pytest.fixture(scope="module")
def prompt():
    """Token ids [2, PROMPT_TOKENS] for the tiny Llama (ids 3..95: no special token), from a fixed stream."""
    return torch.randint(3, 96, (2, PROMPT_TOKENS), generator=torch.Generator().manual_seed(7))
