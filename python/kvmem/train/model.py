"""A transformers causal LM whose every attention layer reads a memory's training form instead of its KV
cache, differentiably: what end-to-end distillation trains (issue 45, stage 2) and what the tests compare
with kvmem.transformers.KvmemCache running the C++ memories on the same weights."""

from __future__ import annotations

import contextlib
import math
import threading

import torch

from .capture import LayerInputs, attention_modules

_active = threading.local()


def _attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention function "kvmem_train": the layer's memory training form on this call's q, k, v."""
    D = query.shape[-1]
    if scaling is not None and not math.isclose(scaling, 1.0 / math.sqrt(D), rel_tol=1e-6):
        query = query * (scaling * math.sqrt(D))  # kvmem reads at 1 / sqrt(D), as kvmem.transformers folds it
    x = _active.inputs.pop(module.layer_idx)
    y = _active.layers[module.layer_idx](LayerInputs(x, query, key, value), _active.setup)
    return y.transpose(1, 2), None


def _keep_input(module, args, kwargs):
    _active.inputs[module.layer_idx] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]


@contextlib.contextmanager
def memories_in_every_layer(model, layers, setup):
    """Within the block, ``model``'s forward (one pass over whole sequences, no cache) runs layer i's attention
    as ``layers[i](LayerInputs(x, q, k, v), setup)`` (for example kvmem.train.distill.KvmParameters), with
    gradients; afterwards the model's attention implementation and hooks are as before. Raises ValueError
    when ``layers`` does not have one entry per attention layer, or as capture.attention_modules()."""
    from transformers import AttentionInterface

    modules = attention_modules(model)
    if len(layers) != len(modules):
        raise ValueError(f"layers: {len(layers)} given, the model has {len(modules)} attention layers")
    AttentionInterface.register("kvmem_train", _attend)
    before = model.config._attn_implementation
    hooks = [m.register_forward_pre_hook(_keep_input, with_kwargs=True) for m in modules]
    _active.inputs, _active.layers, _active.setup = {}, {m.layer_idx: p for m, p in zip(modules, layers)}, setup
    try:
        model.set_attn_implementation("kvmem_train")
        yield model
    finally:
        for h in hooks:
            h.remove()
        model.set_attn_implementation(before)
        _active.inputs, _active.layers, _active.setup = {}, {}, None
