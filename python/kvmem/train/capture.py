"""What each attention layer of a transformers causal LM sees, captured in one forward pass: the layer's
attention input x and the queries, keys and values that reach its softmax (after the projections and RoPE,
kv-heads kept), the training data of the per-layer distillation (kvmem.train.distill)."""

from __future__ import annotations

import math
import threading
from typing import NamedTuple

import torch

from ..adapters import attention_modules  # noqa: F401  (kvmem.train's callers import it from here)

_seen = threading.local()


class LayerInputs(NamedTuple):
    """One layer's view of one batch of sequences, float32, detached:

    - ``x`` [B, T, hidden]: the attention module's input (what the q, k, v projections read);
    - ``q`` [B, Hq, T, D] (scaled so that the model's softmax scale is 1 / sqrt(D)), ``k`` [B, Hkv, T, D],
      ``v`` [B, Hkv, T, Dv];
    - ``position_embeddings``: what the attention module was given for its RoPE (transformers' (cos, sin),
      each [B, T, D]), detached, or None where it was given none; the per-layer fit with adapters
      (kvmem.train.distill.fit_adapted_layer) runs the module again on ``x`` with them."""

    x: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    position_embeddings: tuple | None = None


def _record(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention function "kvmem_train_capture": records q, k, v (and the hooked x), then runs SDPA."""
    D = query.shape[-1]
    if scaling is not None and not math.isclose(scaling, 1.0 / math.sqrt(D), rel_tol=1e-6):
        query = query * (scaling * math.sqrt(D))  # fold the model's scale into q, as kvmem.transformers does
    seen = _seen.inputs.pop(module.layer_idx, None)
    if seen is None:
        raise ValueError(f"layer {module.layer_idx}: its attention input was not seen (no forward pre-hook ran)")
    x, rope = seen
    rope = None if rope is None else tuple(t.detach() for t in rope)
    _seen.layers[module.layer_idx] = LayerInputs(x.detach().float(), query.detach().float(), key.detach().float(),
                                                 value.detach().float(), rope)
    groups = query.shape[1] // key.shape[1]
    y = torch.nn.functional.scaled_dot_product_attention(query, key.repeat_interleave(groups, 1),
                                                         value.repeat_interleave(groups, 1), is_causal=True)
    return y.transpose(1, 2).contiguous(), None


def _keep_input(module, args, kwargs):
    x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    rope = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
    _seen.inputs[module.layer_idx] = (x, rope)


def capture(model, ids: torch.Tensor) -> list[LayerInputs]:
    """Runs ``model`` (a transformers causal LM) on token ids [B, T] once, with no cache, and returns every
    layer's LayerInputs in layer order. The model's attention implementation is restored afterwards. Raises
    ValueError as attention_modules()."""
    from transformers import AttentionInterface

    modules = attention_modules(model)
    AttentionInterface.register("kvmem_train_capture", _record)
    before = model.config._attn_implementation
    hooks = [m.register_forward_pre_hook(_keep_input, with_kwargs=True) for m in modules]
    _seen.inputs, _seen.layers = {}, {}
    try:
        model.set_attn_implementation("kvmem_train_capture")
        with torch.no_grad():
            model(ids, use_cache=False)
        return [_seen.layers[m.layer_idx] for m in modules]
    finally:
        for h in hooks:
            h.remove()
        model.set_attn_implementation(before)
        _seen.inputs, _seen.layers = {}, {}


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention at scale 1 / sqrt(D): q [B, Hq, T, D], k [B, Hkv, T, D], v [B, Hkv, T, Dv]
    (query head h reads kv-head h // (Hq / Hkv)) -> [B, Hq, T, Dv]; the distillation's target."""
    groups = q.shape[1] // k.shape[1]
    return torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1),
                                                            v.repeat_interleave(groups, 1), is_causal=True)
