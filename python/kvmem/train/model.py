"""A transformers causal LM whose every attention layer reads a memory's training form instead of its KV
cache, differentiably: what end-to-end distillation trains (issue 45, stage 2) and what the tests compare
with kvmem.transformers.KvmemCache running the C++ memories on the same weights."""

from __future__ import annotations

import contextlib
import math
import threading

import torch

from ..adapters import attach
from .capture import LayerInputs, attention_modules

_active = threading.local()


def _attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention function "kvmem_train": the layer's memory training form on this call's q, k, v."""
    D = query.shape[-1]
    if scaling is not None and not math.isclose(scaling, 1.0 / math.sqrt(D), rel_tol=1e-6):
        query = query * (scaling * math.sqrt(D))  # kvmem reads at 1 / sqrt(D), as kvmem.transformers folds it
    x = _active.inputs.pop(module.layer_idx)
    y = _active.layers[module.layer_idx](LayerInputs(x, query, key, value), _active.setup)
    if _active.keep_output:
        _active.outputs[module.layer_idx] = y
    return y.transpose(1, 2), None


def _keep_input(module, args, kwargs):
    _active.inputs[module.layer_idx] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]


@contextlib.contextmanager
def _training_form(model, modules: list, layers: dict, setup, adapters: dict | None, keep_output: bool):
    """Switches ``model`` to the attention function "kvmem_train" reading ``layers`` ({layer_idx: training
    form}), hooks ``modules`` for their input and, with ``adapters`` ({layer_idx: LayerAdapters}), their q and
    k projections; everything is restored afterwards."""
    from transformers import AttentionInterface

    AttentionInterface.register("kvmem_train", _attend)
    before = model.config._attn_implementation
    hooks = [m.register_forward_pre_hook(_keep_input, with_kwargs=True) for m in modules]
    added = attach(model, adapters.get) if adapters else None
    _active.inputs, _active.layers, _active.setup = {}, layers, setup
    _active.keep_output, _active.outputs = keep_output, {}
    try:
        model.set_attn_implementation("kvmem_train")
        yield
    finally:
        for h in hooks:
            h.remove()
        if added is not None:
            added.remove()
        model.set_attn_implementation(before)
        _active.inputs, _active.layers, _active.setup, _active.keep_output, _active.outputs = {}, {}, None, False, {}


@contextlib.contextmanager
def memories_in_every_layer(model, layers, setup, adapters=None):
    """Within the block, ``model``'s forward (one pass over whole sequences, no cache) runs layer i's attention
    as ``layers[i](LayerInputs(x, q, k, v), setup)`` (for example kvmem.train.distill.KvmParameters), with
    gradients, and with ``adapters`` (one kvmem.adapters.LayerAdapters per layer, or None) on the layers' q
    and k projections; afterwards the model's attention implementation and hooks are as before. Raises
    ValueError when ``layers`` or ``adapters`` does not have one entry per attention layer, or as
    kvmem.adapters.attention_modules()."""
    modules = attention_modules(model)
    for name, given in (("layers", layers), ("adapters", adapters)):
        if given is not None and len(given) != len(modules):
            raise ValueError(f"{name}: {len(given)} given, the model has {len(modules)} attention layers")
    by_index = {m.layer_idx: p for m, p in zip(modules, layers)}
    with _training_form(model, modules, by_index, setup,
                        None if adapters is None else {m.layer_idx: a for m, a in zip(modules, adapters)}, False):
        yield model


@contextlib.contextmanager
def memory_in_layer(model, layer_idx: int, layer, setup, adapters=None):
    """Within the block, ``run(inputs)`` runs attention module ``layer_idx`` of ``model`` alone on a captured
    kvmem.train.capture.LayerInputs (its x and position_embeddings), with its attention read through
    ``layer(LayerInputs(x, q, k, v), setup)`` and ``adapters`` (a kvmem.adapters.LayerAdapters or None) on
    its q and k projections, and returns the memory's attention output [B, Hq, T, Dv] (before the output
    projection), with gradients. Yields ``run``. Raises ValueError for a layer_idx the model does not have,
    and at a call for inputs captured without position embeddings."""
    modules = attention_modules(model)
    module = next((m for m in modules if m.layer_idx == layer_idx), None)
    if module is None:
        raise ValueError(f"layer_idx = {layer_idx}: the model has attention layers 0..{len(modules) - 1}")

    def run(inputs: LayerInputs):
        if inputs.position_embeddings is None:
            raise ValueError(f"layer {layer_idx}: its inputs were captured without position embeddings (the "
                             f"module received none), so it cannot be run again")
        dtype = module.q_proj.weight.dtype  # the capture keeps float32; the module runs in the model's dtype
        module(hidden_states=inputs.x.to(dtype), position_embeddings=tuple(t.to(dtype) for t in inputs.position_embeddings),
               attention_mask=None)
        return _active.outputs.pop(layer_idx)

    with _training_form(model, [module], {layer_idx: layer}, setup,
                        None if adapters is None else {layer_idx: adapters}, True):
        yield run
