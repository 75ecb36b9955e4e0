"""Shared by the pytest suites of the fidelity tools (test_fidelity.py, test_after_prompt.py): the tools'
folders on sys.path and a tiny Llama with random weights that stands in for SmolLM2 (no download)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.dont_write_bytecode = True
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for folder in ("capture", "fidelity", "distill"):
    path = os.path.join(ROOT, "tools", folder)
    if path not in sys.path:
        sys.path.insert(0, path)


@pytest.fixture(scope="module")
def tiny():
    """A Llama with 2 layers, 4 query heads, 2 kv-heads, head_dim 16, random weights, float32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(cfg).eval()
