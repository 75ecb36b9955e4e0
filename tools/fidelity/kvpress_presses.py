"""kvpress (NVIDIA, Apache-2.0, PyPI), pinned at KVPRESS_VERSION, beside kvmem's memories: its presses by id,
sized at a fraction of the prompt, and the prefill-then-decode loop that reads a model through them.

A press compresses the KV cache of every layer once, at the end of the prefill (its forward hook on each
attention layer ranks the prompt's tokens and keeps int(T * (1 - compression_ratio)) of them per kv-head);
decode steps then append to the compressed cache and never evict. So a press "at fraction f" keeps
int(f' * T) tokens with compression_ratio 1 - f' (f' = f nudged up by 1e-9 so that f * T tokens are kept
where f * T is whole), the same budget as kvmem's memories at f (lm_memories.held_tokens), and holds the
whole prompt during the prefill.

What was adapted to run kvpress 0.5.5 (which pins transformers < 5.3) on this environment's transformers
(see installed_versions()), and nothing else:
- the package is loaded without its __init__, which imports every press, three of them (DuoAttention's and
  LUKV's pattern loaders, the expected-attention statistics script) needing `datasets`, `cachetools` and
  `fire`, which no press used here imports; load() does what the __init__ does besides: it patches
  transformers' attention functions (kvpress.attention_patch) so that the head-wise presses (KVzip, whose
  per-head budgets mask keys rather than drop them) are read as kvpress reads them;
- transformers 5.4 and later no longer pass `cache_position` to the attention layers, where kvpress's
  forward hook reads it to tell the prefill from a decode step; the hook is given the positions the
  transformers kvpress pins would pass (the cache's tokens before this call up to its length after it),
  which only decides "is this the prefill" (_with_cache_position);
- decode steps pass their absolute position (position_ids), as kvpress's own pipeline does, since the
  compressed cache is shorter than the sequence;
- KVzip reads its tokenizer by model.config.name_or_path, which a model read from a GGUF file has not: the
  tokenizer is saved to a temporary directory named there (make()).
full_cache_check() shows the loop without a press gives the model's own logits.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
import tempfile
import types

import torch

KVPRESS_VERSION = "0.5.5"

#: press ids in table order: (kvpress class, label, its own arguments besides compression_ratio)
PRESSES = {
    "kvpress-snapkv": ("SnapKVPress", "kvpress SnapKV", {}),
    "kvpress-tova": ("TOVAPress", "kvpress TOVA", {}),
    "kvpress-knorm": ("KnormPress", "kvpress KNorm", {}),
    "kvpress-streaming": ("StreamingLLMPress", "kvpress StreamingLLM", {}),
    "kvpress-expected": ("ExpectedAttentionPress", "kvpress Expected Attention", {}),
    "kvpress-kvzip": ("KVzipPress", "kvpress KVzip", {}),
}
_MODULES = {"SnapKVPress": "snapkv_press", "TOVAPress": "tova_press", "KnormPress": "knorm_press",
            "StreamingLLMPress": "streaming_llm_press", "ExpectedAttentionPress": "expected_attention_press",
            "KVzipPress": "kvzip_press"}
_loaded: dict[str, type] = {}


class KvpressError(RuntimeError):
    """kvpress is missing or at another version than KVPRESS_VERSION (scripts/lib/env.sh kvmem_kvpress_install)."""


def installed_versions() -> dict:
    """{"kvpress", "transformers", "torch"}: the versions this run uses."""
    import transformers

    try:
        kv = importlib.metadata.version("kvpress")
    except importlib.metadata.PackageNotFoundError:
        kv = None
    return {"kvpress": kv, "transformers": transformers.__version__, "torch": torch.__version__}


def _with_cache_position(hook):
    """kvpress's BasePress.forward_hook, given kwargs["cache_position"] where transformers no longer passes it:
    arange(L - q, L) for a cache layer of L tokens after a call of q tokens."""

    def wrapped(self, module, args, kwargs, output):
        if "cache_position" not in kwargs:
            length = kwargs["past_key_values"].layers[module.layer_idx].keys.shape[-2]
            q = kwargs["hidden_states"].shape[1]
            kwargs = {**kwargs, "cache_position": torch.arange(length - q, length)}
        return hook(self, module, args, kwargs, output)

    wrapped.kvmem_adapted = True
    return wrapped


def load() -> dict[str, type]:
    """{class name: press class} of the presses in PRESSES. Raises KvpressError when kvpress is not
    installed at KVPRESS_VERSION."""
    if _loaded:
        return _loaded
    version = installed_versions()["kvpress"]
    if version != KVPRESS_VERSION:
        raise KvpressError(f"kvpress {version or 'is not installed'}: this comparison pins kvpress=={KVPRESS_VERSION} "
                           f"(scripts/lib/env.sh: kvmem_kvpress_install)")
    if "kvpress" not in sys.modules:
        spec = importlib.util.find_spec("kvpress")
        package = types.ModuleType("kvpress")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["kvpress"] = package
    base = importlib.import_module("kvpress.presses.base_press").BasePress
    if not getattr(base.forward_hook, "kvmem_adapted", False):
        base.forward_hook = _with_cache_position(base.forward_hook)
        importlib.import_module("kvpress.attention_patch").patch_attention_functions()
    for name, module in _MODULES.items():
        _loaded[name] = getattr(importlib.import_module(f"kvpress.presses.{module}"), name)
    return _loaded


def label(press: str) -> str:
    """The table label of a press id."""
    return PRESSES[press][1]


def make(press: str, fraction: float, model, tokenizer):
    """The press `press` (an id of PRESSES) keeping `fraction` of the prompt's tokens per layer and kv-head.
    Raises ValueError for an unknown id or a fraction outside (0, 1)."""
    if press not in PRESSES:
        raise ValueError(f"press = {press!r}: unknown (known: {', '.join(PRESSES)})")
    if not 0 < fraction < 1:
        raise ValueError(f"fraction = {fraction}: must be in (0, 1)")
    name, _, extra = PRESSES[press]
    cls = load()[name]
    if name == "KVzipPress" and not os.path.isfile(os.path.join(str(model.config.name_or_path), "tokenizer_config.json")):
        path = tempfile.mkdtemp(prefix="kvmem-kvzip-tokenizer-")
        tokenizer.save_pretrained(path)
        model.config.name_or_path = path
    return cls(compression_ratio=compression_ratio(fraction), **extra)


def compression_ratio(fraction: float) -> float:
    """kvpress's compression_ratio (the share of tokens removed) that keeps `fraction` of them: 1 - f, less
    1e-9 so that int(T * (1 - ratio)) is f * T where that is whole."""
    return 1.0 - fraction - 1e-9


def kept_tokens(prompt: int, fraction: float) -> int:
    """Tokens a press at `fraction` keeps of a `prompt`-token prompt (kvpress: int(T * (1 - ratio)))."""
    return int(prompt * (1.0 - compression_ratio(fraction)))


def prefill_decode(model, ids: torch.Tensor, prompt: int, press=None) -> torch.Tensor:
    """Logits [T - prompt + 1, vocab] of positions prompt - 1 .. T - 1 of ids [1, T]: the first `prompt` tokens
    in one forward through a fresh DynamicCache, compressed by `press` at its end (None: kept whole), then
    each later token in a forward of its own at its absolute position (teacher-forced)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        if press is None:
            out = [model(ids[:, :prompt], past_key_values=cache, use_cache=True).logits[0, -1:]]
        else:
            with press(model):
                out = [model(input_ids=ids[:, :prompt], past_key_values=cache, use_cache=True).logits[0, -1:]]
        for t in range(prompt, ids.shape[1]):
            out.append(model(ids[:, t:t + 1], past_key_values=cache, use_cache=True,
                             position_ids=torch.tensor([[t]])).logits[0])
    return torch.cat(out)


def full_cache_check(model, ids: torch.Tensor, prompt: int) -> float:
    """The largest absolute difference between prefill_decode() without a press and the model's own logits
    over ids [1, T] in one forward (positions prompt - 1 .. T - 2): 0 up to float rounding when the loop
    reads the model as transformers does."""
    with torch.no_grad():
        own = model(ids).logits[0, prompt - 1:]
    return (prefill_decode(model, ids, prompt)[:own.shape[0]] - own).abs().max().item()
