"""Low-rank adapters on a transformers model's query and key projections: the "distilled + adapters"
variant of issue 45, in which the model meets its memory halfway (as LoLCATs and Liger convert pretrained
transformers to bounded-memory attention with low-rank adapters), its own weights unchanged.

Layer L's projections of the attention input x [B, T, hidden] become, before RoPE,

    q = W_q x + up_q (down_q x),    k = W_k x + up_k (down_k x),

with the tensors of kvmem.weights.ADAPTER_TENSORS: ``q_adapter_down`` [r, hidden], ``q_adapter_up``
[Hq * D, r], ``k_adapter_down`` [r, hidden], ``k_adapter_up`` [Hkv * D, r] (float32; r is the rank). The
adapter term is computed in float32 and added in the projection's dtype. ``attach`` installs them as
forward hooks on the attention modules' ``q_proj`` and ``k_proj`` (the model's own code computes RoPE and
anything after the projections), so training (kvmem.train) and inference (kvmem.transformers.KvmemCache)
run the same arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: kvmem.weights names of the adapters' tensors, per projection: (down, up).
NAMES = {"q": ("q_adapter_down", "q_adapter_up"), "k": ("k_adapter_down", "k_adapter_up")}


class LowRankAdapter(torch.nn.Module):
    """delta(x) = (x . down^T) . up^T: x [..., in] -> [..., out]; ``down`` [r, in], ``up`` [out, r], float32."""

    def __init__(self, down: torch.Tensor, up: torch.Tensor):
        super().__init__()
        if down.dim() != 2 or up.dim() != 2 or down.shape[0] != up.shape[1]:
            raise ValueError(f"adapter: down {list(down.shape)} and up {list(up.shape)} must be [r, in] and [out, r]")
        self.down = torch.nn.Parameter(down.detach().float().clone())
        self.up = torch.nn.Parameter(up.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() @ self.down.to(x.device).t()) @ self.up.to(x.device).t()


class LayerAdapters(torch.nn.Module):
    """One layer's adapters on q_proj (``q``) and k_proj (``k``)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        super().__init__()
        self.q = LowRankAdapter(tensors["q_adapter_down"], tensors["q_adapter_up"])
        self.k = LowRankAdapter(tensors["k_adapter_down"], tensors["k_adapter_up"])

    @classmethod
    def initial(cls, hidden: int, q_out: int, k_out: int, rank: int, *, seed: int = 0) -> "LayerAdapters":
        """Adapters that leave the model unchanged: ``down`` normal with standard deviation 1 / sqrt(hidden)
        (seeded ``seed``), ``up`` zero (LoRA's start). Raises ValueError for rank < 1."""
        if rank < 1:
            raise ValueError(f"adapter rank = {rank}: must be >= 1")
        g = torch.Generator().manual_seed(seed)
        down = lambda: torch.randn(rank, hidden, generator=g) / hidden ** 0.5  # noqa: E731
        return cls({"q_adapter_down": down(), "q_adapter_up": torch.zeros(q_out, rank),
                    "k_adapter_down": down(), "k_adapter_up": torch.zeros(k_out, rank)})

    def tensors(self) -> dict[str, torch.Tensor]:
        """The layer's adapter tensors as kvmem.weights names them (float32, detached copies)."""
        return {NAMES[p][0]: getattr(self, p).down.detach().clone() for p in NAMES} | \
               {NAMES[p][1]: getattr(self, p).up.detach().clone() for p in NAMES}


def of_tensors(tensors: dict[str, torch.Tensor]) -> LayerAdapters | None:
    """The LayerAdapters held by one layer's tensors of a weights file, None when it holds none."""
    return LayerAdapters(tensors) if NAMES["q"][0] in tensors else None


def attention_modules(model) -> list:
    """The attention modules of ``model`` in layer order (modules with a layer_idx and a q_proj). Raises
    ValueError naming the model when it has none (its attention cannot be hooked)."""
    found = sorted((m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "q_proj")),
                   key=lambda m: m.layer_idx)
    if not found:
        raise ValueError(f"model = {type(model).__name__}: has no attention module with a layer_idx and a q_proj, "
                         f"so kvmem cannot hook its attention")
    return found


class Attached:
    """The hooks ``attach`` installed; ``remove()`` takes them off (the model is then as before)."""

    def __init__(self, handles: list):
        self.handles = handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def attach(model, lookup: Callable[[int], LayerAdapters | None]) -> Attached:
    """Hooks every attention module's q_proj and k_proj of ``model``: each call adds the adapter term of
    ``lookup(layer_idx)`` (none when it returns None), looked up at every call, so that one set of hooks
    serves adapters that change. Raises ValueError as attention_modules(), and at a call when an adapter's
    sizes do not fit the projection (naming the layer, the tensor and both shapes)."""
    handles = []
    for module in attention_modules(model):
        for proj in NAMES:
            linear = getattr(module, f"{proj}_proj")
            handles.append(linear.register_forward_hook(_adder(module.layer_idx, proj, linear, lookup)))
    return Attached(handles)


def _adder(layer_idx: int, proj: str, linear, lookup):
    def hook(mod, args, out):
        adapters = lookup(layer_idx)
        if adapters is None:
            return out
        a = getattr(adapters, proj)
        if a.down.shape[1] != args[0].shape[-1] or a.up.shape[0] != out.shape[-1]:
            raise ValueError(f"layer {layer_idx}: {NAMES[proj][0]} {list(a.down.shape)} and {NAMES[proj][1]} "
                             f"{list(a.up.shape)} do not fit {proj}_proj [{out.shape[-1]}, {args[0].shape[-1]}]")
        return out + a(args[0]).to(out.dtype)
    return hook
