"""kvmem as a Hugging Face transformers attention backend: one kvmem memory per layer, no full KV cache.

Two lines of user code run ``generate`` with a kvmem memory in every attention layer::

    cache = kvmem.transformers.KvmemCache(model, kvmem.transformers.kvm(budget=kvmem.budget.Fixed(256)))
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=64)

``KvmemCache(model, factory)`` registers the attention function "kvmem" with transformers'
``AttentionInterface`` and hooks ``model``'s forwards (once per model): a forward given a KvmemCache as the
keyword ``past_key_values`` (as ``generate`` gives it) runs with the attention implementation "kvmem", and
every other forward of the model runs the model's own attention, exactly as before any kvmem use (the
implementation is switched at the forward's start and restored at its end, also when it raises). Each
layer's ``update`` hands the step's new keys and values (after RoPE) straight to the attention function,
which runs them through that layer's memory: a call of several tokens is a prefill (the first, or a chunk
that continues what the memory holds, with the meaning of one prefill), a call of one token after that a
decode step. Memories are built at the first call of each layer, when the
batch size, heads, head_dim and dtype are known, by ``factory(layer_idx, head_dim=, query_heads=,
kv_heads=, value_dim=, batch=, dtype=)``. Nothing keeps the full keys and values:
``cache.allocated_bytes()`` is what the memories hold.

Scope: float32, bfloat16 and float16 models (each layer's memory stores keys, values and its state in the
model's dtype and computes logits, softmax and merges in float32; float64 is refused); prompts of one length in a batch (the mask function "kvmem"
builds no mask, since every memory is causal by construction, and refuses a padding mask with a
ValueError: kvmem's ragged prefill takes right-ragged lengths, transformers pads on the left); greedy or sampling decoding, no
beam search (``reorder_cache``) or cache cropping. Trellis needs learned per-token gates and targets that
a pretrained transformer does not have, so the factories here are KVM, OVQ, proportional merging and the eviction
memories (with or without merging).
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
from transformers.cache_utils import Cache, CacheLayerMixin

from . import adapters as adapters_io
from . import memories, ops
from . import weights as weights_io

#: Builds a layer's memory: factory(layer_idx, *, head_dim, query_heads, kv_heads, value_dim, batch, dtype) -> Memory.
MemoryFactory = Callable[..., memories.Memory]

_current = threading.local()  # per thread: the running forwards of hooked models (_forwards())


def kvm(weights: weights_io.MemoryWeights | str | os.PathLike | None = None, **kwargs) -> MemoryFactory:
    """A factory of KvmMemory with the given keyword arguments (KvmMemory's names: chunk, window_chunks,
    sinks, max_rows, budget, evict_rows_above, ...), the same for every layer.

    ``weights``: trained KVM weights (a kvmem.weights.MemoryWeights or the path of its file, written by
    kvmem.train): layer i's memory takes layer i's ln_weight, ln_bias, tau_state and tau_window, and its
    merge gate z = x . gate_weight from the layer's attention input x (KvmemCache hooks the attention
    modules to see x). Weights with adapters (shape adapter_rank > 0, the "distilled + adapters" variant)
    also change the model's q and k projections while it runs with a KvmemCache of this factory
    (kvmem.adapters; see KvmemCache). Raises ValueError naming the file, the tensor and the shape expected
    for a file that is not KVM weights (kvmem.weights.load), and KvmemCache raises it for weights of other
    sizes than the model's."""
    if weights is None:
        return lambda layer_idx, **shape: memories.KvmMemory(**shape, **kwargs)
    return _Trained("kvm", weights, kwargs)


def ovq(weights: weights_io.MemoryWeights | str | os.PathLike | None = None, **kwargs) -> MemoryFactory:
    """A factory of OvqMemory (OvqMemory's names: chunk, max_centroids, budget, beta, ...). OVQ reads unit
    queries and keys (spec OVQ.md §2: logits beta * sqrt(D) * q^ . k^), so on a model not trained with it
    the attention changes even where every token has its own centroid. ``weights``: trained OVQ weights (a
    kvmem.weights.MemoryWeights or its file): layer i's memory takes layer i's beta; errors as kvm()'s."""
    if weights is None:
        return lambda layer_idx, **shape: memories.OvqMemory(**shape, **kwargs)
    return _Trained("ovq", weights, kwargs)


class _Trained:
    """A memory factory with trained per-layer weights (kvm(), ovq() and eviction("kvpop") given ``weights``)."""

    def __init__(self, memory: str, weights, kwargs: dict):
        if not isinstance(weights, weights_io.MemoryWeights):
            weights = weights_io.load(weights, memory=memory)
        elif weights.memory != memory:
            raise ValueError(f"weights: hold {weights.memory!r} weights, expected {memory!r}")
        self.memory, self.weights, self.kwargs = memory, weights, kwargs
        #: one kvmem.adapters.LayerAdapters per layer when the weights hold adapters, else None
        self.adapters = None
        if weights.shape.get("adapter_rank", 0) > 0:
            self.adapters = [adapters_io.of_tensors(weights.layer(i)) for i in range(weights.shape["layers"])]

    def check(self, model) -> None:
        """Raises ValueError when the weights were made for other sizes than ``model``'s."""
        c = model.config.get_text_config()
        sizes = {"layers": c.num_hidden_layers, "hidden": c.hidden_size, "query_heads": c.num_attention_heads,
                 "kv_heads": c.num_key_value_heads}
        for key, value in sizes.items():
            if self.weights.shape.get(key) != value:
                raise ValueError(f"weights ({self.memory}, model {self.weights.model!r}): {key} = "
                                 f"{self.weights.shape.get(key)!r}, but the model has {value}")

    def gate_weight(self, layer_idx: int) -> torch.Tensor | None:
        """W_g [hidden, Hkv] of the layer (KVM), None for OVQ."""
        return self.weights.layer(layer_idx)["gate_weight"] if self.memory == "kvm" else None

    def __call__(self, layer_idx: int, **shape) -> memories.Memory:
        w = self.weights.layer(layer_idx)
        dev = memories.device()
        if self.memory == "ovq":
            return memories.OvqMemory(**shape, **self.kwargs, beta=w["beta"].to(dev))
        if self.memory == "kvpop":
            return memories.EvictionMemory(**shape, **self.kwargs, scorer="kvpop",
                                           weights={name: t.to(dev) for name, t in w.items()})
        return memories.KvmMemory(**shape, **self.kwargs, ln_weight=w["ln_weight"].to(dev), ln_bias=w["ln_bias"].to(dev),
                                  tau_state=w["tau_state"].to(dev), tau_window=w["tau_window"].to(dev))


def proportional(**kwargs) -> MemoryFactory:
    """A factory of ProportionalMemory (chunk, window_chunks, sinks, max_rows, budget, ...): rows read as the
    mean key and value of their tokens with the logit bias log(count), made for a model not trained with a
    memory (its attention is unchanged where every token has its own row)."""
    return lambda layer_idx, **shape: memories.ProportionalMemory(**shape, **kwargs)


def eviction(scorer: str = "h2o", weights: weights_io.MemoryWeights | str | os.PathLike | None = None,
             **kwargs) -> MemoryFactory:
    """A factory of EvictionMemory (scorer "streaming", "knorm", "h2o", "tova", "snapkv" or "kvpop"; sinks,
    window, top_k in tokens, merge_evicted to fold evicted rows into their nearest kept row, chunk and
    observation_window for compression per chunk or at the end of the prompt, ...). With ``chunk=0`` the
    memory holds the prompt whole while ``generate`` prefills it and compresses when generation moves from
    the prompt to the first new token (its first decode step), as kvpress does; with ``chunk=C`` it compresses
    once per C positions (a chunked prefill's chunks). ``weights``:
    trained KVPOP scorers (a kvmem.weights.MemoryWeights of memory "kvpop" or its file, written by
    kvmem.train): layer i's memory takes layer i's scorers; only with scorer "kvpop" (ValueError otherwise);
    errors as kvm()'s."""
    if weights is None:
        return lambda layer_idx, **shape: memories.EvictionMemory(**shape, scorer=scorer, **kwargs)
    if scorer != "kvpop":
        raise ValueError(f"scorer = {scorer!r}: trained weights are KVPOP's scorers (scorer 'kvpop')")
    return _Trained("kvpop", weights, kwargs)


class KvmemLayer(CacheLayerMixin):
    """One attention layer's cache: a kvmem memory, built at the layer's first call.

    ``update`` stores nothing and returns the step's keys and values [B, Hkv, T, D] unchanged; the
    attention function "kvmem" gives them to the memory together with the queries."""

    def __init__(self, factory: MemoryFactory, layer_idx: int):
        super().__init__()
        self.factory, self.layer_idx = factory, layer_idx
        self.memory: memories.Memory | None = None
        #: W_g [hidden, Hkv] of a trained KVM factory: the merge gate is x . W_g of the layer's input x
        self.gate_weight = factory.gate_weight(layer_idx) if hasattr(factory, "gate_weight") else None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return key_states, value_states

    def get_seq_length(self) -> int:
        return 0 if self.memory is None else self.memory.tokens(0)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_cache_shape(self) -> int:
        return -1

    def reset(self) -> None:
        if self.memory is not None:
            self.memory.reset()

    def offload(self):
        raise NotImplementedError("KvmemCache: offloading is not supported (the memory lives on kvmem's device)")

    def prefetch(self):
        raise NotImplementedError("KvmemCache: offloading is not supported (the memory lives on kvmem's device)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("KvmemCache: beam search (reorder_cache) is not supported; use greedy or sampling")

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("KvmemCache: a kvmem memory cannot be cropped (merged rows have no position)")

    def attend(self, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
        """Runs one call of this layer: query [B, Hq, T, D], key [B, Hkv, T, D], value [B, Hkv, T, Dv];
        returns the attention output [B, T, Hq, Dv] (what transformers' attention functions return)."""
        B, Hq, T, D = query.shape
        Hkv, Dv = key.shape[1], value.shape[3]
        if query.dtype not in ops.DTYPES:
            raise TypeError(f"q.dtype = {query.dtype}: the kvmem backend runs float32, bfloat16 and float16 models")
        if self.memory is None:
            self.memory = self.factory(self.layer_idx, head_dim=D, query_heads=Hq, kv_heads=Hkv, value_dim=Dv, batch=B,
                                       dtype=query.dtype)
        if not memories.softmax_scale_ok(D, scaling):  # kvmem reads with 1 / sqrt(D): fold the model's scale into q
            query = query * (scaling * math.sqrt(D))
        out = torch.empty(B, T, Hq, Dv, dtype=query.dtype, device=query.device)
        y = out.transpose(1, 2)  # [B, Hq, T, Dv] view: the memory writes the output in transformers' layout
        extras = () if self.gate_weight is None else (self._gate(module, query),)
        if T == 1 and self.memory.tokens(0) > 0:
            self.memory.decode(query, key, value, *extras, y=y)
        else:  # a prompt, or a chunk of one (a prefill continues what the memory holds)
            self.memory.prefill(query, key, value, *extras, y=y)
        return out

    def _gate(self, module, query: torch.Tensor) -> torch.Tensor:
        """The merge gate z [B, Hkv, T] = x . W_g of the attention input x that the hook saw for ``module``."""
        seen = getattr(_current, "hidden", None)
        if seen is None or seen[0] is not module:
            raise ValueError(f"layer {self.layer_idx}: no attention input seen for the merge gate (KvmemCache "
                             f"hooks the modules with a layer_idx and a q_proj; this model's attention has none)")
        x = seen[1]
        w = self.gate_weight.to(device=x.device, dtype=torch.float32)
        return (x.to(torch.float32) @ w).to(query.dtype).transpose(1, 2).contiguous()


class KvmemCache(Cache):
    """A transformers ``Cache`` with one kvmem memory per attention layer and no full KV cache.

    ``KvmemCache(model, factory)`` switches ``model`` to the attention function "kvmem" (registered here)
    and builds layer i's memory with ``factory(i, head_dim=, query_heads=, kv_heads=, value_dim=, batch=, dtype=)``
    at its first call (see kvm(), ovq(), eviction()). Pass it as ``past_key_values`` to ``generate`` or to
    the model's forward (as a keyword argument, which is how ``generate`` passes it).

    kvmem's attention runs only in the forwards of ``model`` (or of a model inside it) that are given a
    KvmemCache as the keyword ``past_key_values``; ``model.config``'s attention implementation is "kvmem"
    during such a forward only, so plain forwards and ``generate()`` calls of the same model, before and
    after, run the model's own attention bit for bit, and several caches can be used in turn on one model.
    A factory whose trained weights hold adapters (``factory.adapters``) adds them to the model's q and k
    projections (kvmem.adapters) during each forward whose ``past_key_values`` is this cache, and only then.
    The hooks that do so are installed on ``model`` once and stay (they change nothing in other forwards).
    Raises TypeError when ``model`` has no ``set_attn_implementation`` or cannot switch its attention
    implementation (a model whose attention does not go through transformers' AttentionInterface); a
    forward that reaches this cache's ``update`` without having been given it as the keyword
    ``past_key_values`` (e.g. positionally) raises ValueError."""

    def __init__(self, model, factory: MemoryFactory):
        if not hasattr(model, "set_attn_implementation"):
            raise TypeError(f"model = {type(model).__name__}: must be a transformers PreTrainedModel")
        if hasattr(model, "_can_set_attn_implementation") and not model._can_set_attn_implementation():
            raise TypeError(f"model = {type(model).__name__}: its attention does not go through transformers' "
                            f"AttentionInterface, so kvmem's attention cannot run in it")
        register()
        if hasattr(factory, "check"):
            factory.check(model)
        _hook_forwards(model)
        layers = model.config.get_text_config().num_hidden_layers
        super().__init__(layers=[KvmemLayer(factory, i) for i in range(layers)])
        if any(layer.gate_weight is not None for layer in self.layers):
            _hook_attention_inputs(model)
        #: the factory's adapters (one kvmem.adapters.LayerAdapters per layer) or None
        self.adapters = getattr(factory, "adapters", None)
        if self.adapters is not None:
            _hook_adapters(model)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if _forward_cache() is not self:
            raise ValueError("past_key_values: a KvmemCache must be given to the model's forward as the keyword "
                             "past_key_values (as generate gives it), so that the forward runs kvmem's attention; "
                             "this forward did not receive it that way")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def allocated_bytes(self) -> int:
        """Bytes the layers' memories have allocated on kvmem's device (state, caches, scratch)."""
        return sum(layer.memory.allocated_bytes() for layer in self.layers if layer.memory is not None)

    def held_bytes(self) -> int:
        """Bytes of keys and values the memories hold for the tokens seen (in the model's dtype)."""
        return sum(layer.memory.held_bytes() for layer in self.layers if layer.memory is not None)


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The attention function "kvmem" (transformers' AttentionInterface signature): query [B, Hq, T, D],
    key and value [B, Hkv, T, D/Dv] of this call's tokens; returns ([B, T, Hq, Dv], None). Runs in a forward
    given a KvmemCache as the keyword ``past_key_values`` (KvmemCache switches the model to it there); raises
    ValueError in any other forward (e.g. a model switched to "kvmem" by hand) and for dropout > 0."""
    cache = _forward_cache()
    if cache is None:
        raise ValueError("attn_implementation = 'kvmem': runs only in a forward given past_key_values = "
                         "kvmem.transformers.KvmemCache(model, factory) as a keyword")
    if dropout:
        raise ValueError(f"dropout = {dropout}: the kvmem attention backend is for inference (dropout 0)")
    if scaling is None:
        scaling = 1.0 / math.sqrt(query.shape[-1])
    return cache.layers[module.layer_idx].attend(module, query, key, value, scaling), None


def mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None, **kwargs):
    """The mask function "kvmem" (transformers' AttentionMaskInterface): no mask (each memory is causal).
    Raises ValueError when the 2-D padding mask ``attention_mask`` [B, kv_length] masks a token."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("attention_mask: has padded tokens, which the kvmem backend does not take (left padding); "
                         "generate one prompt or prompts of equal length")
    return None


def _save_attention_input(module, args, kwargs):
    """Forward pre-hook of an attention module: keeps its input x [B, T, hidden] for the merge gate."""
    _current.hidden = (module, kwargs["hidden_states"] if "hidden_states" in kwargs else args[0])


def _hook_attention_inputs(model) -> None:
    """Hooks every attention module of ``model`` (a module with a layer_idx and a q_proj) once, so that a
    trained KVM layer sees its attention input. Raises ValueError when the model has no such module."""
    hooked = 0
    for module in model.modules():
        if hasattr(module, "layer_idx") and hasattr(module, "q_proj"):
            if not getattr(module, "_kvmem_input_hook", False):
                module.register_forward_pre_hook(_save_attention_input, with_kwargs=True)
                module._kvmem_input_hook = True
            hooked += 1
    if not hooked:
        raise ValueError(f"model = {type(model).__name__}: no attention module with a layer_idx and a q_proj to "
                         f"hook, so a trained KVM's merge gate cannot see the layer's input")


def _forwards() -> list:
    """This thread's running forwards of hooked models, innermost last: (past_key_values, the configs'
    attention implementations to restore at the forward's end, or None when it changed none)."""
    if not hasattr(_current, "forwards"):
        _current.forwards = []
    return _current.forwards


def _forward_cache() -> KvmemCache | None:
    """The KvmemCache the innermost running forward of a hooked model was given, None for any other forward."""
    forwards = _forwards()
    cache = forwards[-1][0] if forwards else None
    return cache if isinstance(cache, KvmemCache) else None


def _forward_enter(module, args, kwargs):
    """Forward pre-hook of a hooked model: notes the forward's past_key_values and, for a KvmemCache, switches
    the model's attention implementation to "kvmem" until the forward ends (_forward_exit)."""
    cache = kwargs.get("past_key_values")
    restore = None
    if isinstance(cache, KvmemCache) and module.config._attn_implementation != "kvmem":
        restore = [(c, c._attn_implementation_internal) for c in _configs(module.config)]
        module.config._attn_implementation = "kvmem"  # the setter sets the sub-configs too
    _forwards().append((cache, restore))


def _forward_exit(module, args, output):
    """Forward hook of a hooked model (also when the forward raised): restores what _forward_enter changed,
    each config's (and sub-config's) own value as it was."""
    _, restore = _forwards().pop()
    for config, value in restore or ():
        config._attn_implementation_internal = value


def _configs(config) -> list:
    """``config`` and its sub-configs, recursively (transformers' PretrainedConfig.sub_configs)."""
    found = [config]
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "_attn_implementation_internal"):
            found += _configs(sub)
    return found


def _hook_forwards(model) -> None:
    """Hooks, once, the forward of ``model`` and of every transformers model inside it (e.g. LlamaModel in
    LlamaForCausalLM, which a caller may run on its own) with _forward_enter and _forward_exit."""
    for module in model.modules():
        if hasattr(module, "set_attn_implementation") and hasattr(module, "config") and \
                not getattr(module, "_kvmem_forward_hooks", False):
            module.register_forward_pre_hook(_forward_enter, with_kwargs=True)
            module.register_forward_hook(_forward_exit, always_call=True)
            module._kvmem_forward_hooks = True


def _forward_adapters(layer_idx: int):
    """The adapters of ``layer_idx`` of the KvmemCache the innermost running forward was given, if any."""
    cache = _forward_cache()
    return cache.adapters[layer_idx] if cache is not None and cache.adapters is not None else None


def _hook_adapters(model) -> None:
    """Installs once on ``model``: hooks on its q and k projections that add the adapters of the KvmemCache
    the running forward was given (kvmem.adapters.attach; the forwards are hooked by _hook_forwards)."""
    if getattr(model, "_kvmem_adapter_hooks", False):
        return
    adapters_io.attach(model, _forward_adapters)
    model._kvmem_adapter_hooks = True


def register() -> None:
    """Registers the attention function and the mask function "kvmem" with transformers (idempotent)."""
    AttentionInterface.register("kvmem", attention)
    AttentionMaskInterface.register("kvmem", mask)
