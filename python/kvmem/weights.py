"""Trained weights of kvmem's memories as safetensors files: one file per trained memory and model, every
attention layer's parameters in it (issue 45; written by kvmem.train, read by the memory factories of
kvmem.transformers and by tools/fidelity).

Tensors (float32; L is the layer index, hidden the model's hidden size, Hq/Hkv its query/kv-heads, D head_dim):

- KVM (spec KVM.md §1-§3): ``layers.L.gate_weight`` [hidden, Hkv] (W_g: the merge-gate pre-activation
  z = x . W_g of the layer's attention input x), ``layers.L.ln_weight``, ``layers.L.ln_bias`` [D] (the
  state-key LayerNorm's affine), ``layers.L.tau_state``, ``layers.L.tau_window`` [Hq] (inverse temperatures
  of the state rows and of the window);
- OVQ (spec OVQ.md §2): ``layers.L.beta`` [Hq] (the logit scale);
- either, with low-rank adapters (the "distilled + adapters" variant): ``layers.L.q_adapter_down`` [r, hidden],
  ``layers.L.q_adapter_up`` [Hq * D, r], ``layers.L.k_adapter_down`` [r, hidden], ``layers.L.k_adapter_up``
  [Hkv * D, r] (added to the q and k projections: W x + up (down x)).

Metadata (strings): ``format`` (FORMAT), ``memory`` ("kvm" or "ovq"), ``model`` (the model's name),
``shape`` (JSON: layers, hidden, query_heads, kv_heads, head_dim, adapter_rank), ``tensors_sha256`` (the
SHA-256 of the tensors, tensors_digest: what names these weights, for example in a layer captured with
their adapters on, tools/capture/causal_lm.py --adapters), and whatever the trainer records (``config``,
``budget``, ``recipe``, ``training_texts`` with their SHA-256, ...).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

import torch

FORMAT = "kvmem-memory-weights-1"

#: Per-layer tensors of each memory: name -> shape in terms of the model's sizes.
TENSORS = {
    "kvm": {"gate_weight": ("hidden", "kv_heads"), "ln_weight": ("head_dim",), "ln_bias": ("head_dim",),
            "tau_state": ("query_heads",), "tau_window": ("query_heads",)},
    "ovq": {"beta": ("query_heads",)},
    # KVPOP's mLSTM scorer per kv-head (spec EVICTION.md §3; kvmem.train.kvpop): x = [k ; v], D + Dv = 2 D
    # features, D / 2 scorer channels.
    "kvpop": {"w_q": ("kv_heads", "kv_features", "scorer_dim"), "w_k": ("kv_heads", "kv_features", "scorer_dim"),
              "w_v": ("kv_heads", "kv_features", "scorer_dim"), "w_i": ("kv_heads", "kv_features"),
              "b_i": ("kv_heads",), "w_f": ("kv_heads", "kv_features"), "b_f": ("kv_heads",),
              "w_s": ("kv_heads", "scorer_dim"), "b_s": ("kv_heads",), "theta": ("kv_heads",)},
}
#: The adapters' tensors (present when shape["adapter_rank"] > 0).
ADAPTER_TENSORS = {"q_adapter_down": ("adapter_rank", "hidden"), "q_adapter_up": ("q_out", "adapter_rank"),
                   "k_adapter_down": ("adapter_rank", "hidden"), "k_adapter_up": ("k_out", "adapter_rank")}
SHAPE_KEYS = ("layers", "hidden", "query_heads", "kv_heads", "head_dim", "adapter_rank")


@dataclass
class MemoryWeights:
    """Every layer's trained parameters of one memory for one model.

    ``memory``: "kvm", "ovq" or "kvpop"; ``model``: the model's name; ``shape``: {layers, hidden, query_heads,
    kv_heads, head_dim, adapter_rank} (adapter_rank 0: no adapters); ``layers``: {layer index: {tensor name:
    float32 tensor}} with the names and shapes of TENSORS (and ADAPTER_TENSORS); ``metadata``: further
    strings to store (config, budget, recipe, training texts; as read, also the file's tensors_sha256)."""

    memory: str
    model: str
    shape: dict
    layers: dict = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)

    def expected(self) -> dict[str, tuple[int, ...]]:
        """{tensor name: shape} every layer must have."""
        s = dict(self.shape, q_out=self.shape["query_heads"] * self.shape["head_dim"],
                 k_out=self.shape["kv_heads"] * self.shape["head_dim"], kv_features=2 * self.shape["head_dim"],
                 scorer_dim=self.shape["head_dim"] // 2)
        names = dict(TENSORS[self.memory])
        if self.shape.get("adapter_rank", 0) > 0:
            names.update(ADAPTER_TENSORS)
        return {n: tuple(int(s[d]) for d in dims) for n, dims in names.items()}

    def layer(self, index: int) -> dict[str, torch.Tensor]:
        """The tensors of layer ``index``; raises ValueError naming the layer when the file has none."""
        if index not in self.layers:
            raise ValueError(f"layer {index}: the weights ({self.memory}, {self.model}) have layers 0..{self.shape['layers'] - 1}")
        return self.layers[index]

    def check(self, source: str = "the weights") -> None:
        """Raises ValueError naming ``source``, the tensor and the shape expected for an unknown memory, a
        missing or surplus tensor or a wrong shape or dtype."""
        if self.memory not in TENSORS:
            raise ValueError(f"{source}: memory = {self.memory!r}, expected one of {sorted(TENSORS)}")
        for key in SHAPE_KEYS:
            if not isinstance(self.shape.get(key), int) or self.shape[key] < (0 if key == "adapter_rank" else 1):
                raise ValueError(f"{source}: shape[{key!r}] = {self.shape.get(key)!r}, expected a positive int")
        want = self.expected()
        for index in range(self.shape["layers"]):
            tensors = self.layers.get(index, {})
            for name, shape in want.items():
                full = f"layers.{index}.{name}"
                if name not in tensors:
                    raise ValueError(f"{source}: tensor {full} is missing (expected shape {list(shape)})")
                t = tensors[name]
                if tuple(t.shape) != shape or t.dtype != torch.float32:
                    raise ValueError(f"{source}: tensor {full} has shape {list(t.shape)} and dtype {t.dtype}, "
                                     f"expected shape {list(shape)} and torch.float32")
            extra = sorted(set(tensors) - set(want))
            if extra:
                raise ValueError(f"{source}: tensor layers.{index}.{extra[0]} is not a {self.memory} tensor "
                                 f"(expected {sorted(want)})")
        extra_layers = sorted(set(self.layers) - set(range(self.shape["layers"])))
        if extra_layers:
            raise ValueError(f"{source}: layer {extra_layers[0]} is beyond shape['layers'] = {self.shape['layers']}")


def tensors_digest(layers: dict) -> str:
    """SHA-256 (hex) of the tensors {layer index: {name: tensor}}: each tensor's full name layers.L.name, its
    shape and its float32 bytes (little-endian), in the order of the names."""
    h = hashlib.sha256()
    for name, t in sorted((f"layers.{i}.{n}", t) for i, layer in layers.items() for n, t in layer.items()):
        h.update(f"{name}{list(t.shape)}".encode())
        h.update(t.detach().to(torch.float32).contiguous().cpu().numpy().astype("<f4").tobytes())
    return h.hexdigest()


def save(path: str | os.PathLike, weights: MemoryWeights) -> None:
    """Writes ``weights`` to ``path`` (safetensors): first to a temporary file beside it, then renamed, so a run
    stopped midway leaves no half-written file. Raises ValueError as MemoryWeights.check."""
    from safetensors.torch import save_file

    weights.check(f"weights for {os.fspath(path)!r}")
    tensors = {f"layers.{i}.{n}": t.detach().contiguous() for i, layer in weights.layers.items() for n, t in layer.items()}
    meta = {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in weights.metadata.items()}
    meta.update(format=FORMAT, memory=weights.memory, model=weights.model, shape=json.dumps(weights.shape),
                tensors_sha256=tensors_digest(weights.layers))
    tmp = f"{os.fspath(path)}.tmp-{os.getpid()}"
    try:
        save_file(tensors, tmp, metadata=meta)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load(path: str | os.PathLike, *, memory: str | None = None, model: str | None = None,
         shape: dict | None = None) -> MemoryWeights:
    """Reads a weights file. Raises FileNotFoundError for a missing file and ValueError naming the file (and
    the tensor and the shape expected) for anything else: not a kvmem weights file, a file for another
    ``memory`` or ``model`` than asked, sizes other than ``shape``'s (any subset of SHAPE_KEYS), a
    missing, surplus or misshapen tensor, or tensors that do not match the file's tensors_sha256."""
    from safetensors import safe_open

    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"weights file {path!r} not found")
    try:
        with safe_open(path, framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:  # safetensors raises its own errors for a damaged file
        raise ValueError(f"weights file {path!r}: not a safetensors file ({e})") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"weights file {path!r}: metadata format = {meta.get('format')!r}, expected {FORMAT!r}")
    if memory is not None and meta.get("memory") != memory:
        raise ValueError(f"weights file {path!r}: holds {meta.get('memory')!r} weights, expected {memory!r}")
    if model is not None and meta.get("model") != model:
        raise ValueError(f"weights file {path!r}: trained for model {meta.get('model')!r}, expected {model!r}")
    try:
        file_shape = json.loads(meta.get("shape", ""))
    except ValueError:
        raise ValueError(f"weights file {path!r}: metadata shape = {meta.get('shape')!r} is not JSON") from None
    for key, value in (shape or {}).items():
        if file_shape.get(key) != value:
            raise ValueError(f"weights file {path!r}: {key} = {file_shape.get(key)!r}, expected {value!r} (the model's)")
    layers: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        parts = name.split(".")
        if len(parts) != 3 or parts[0] != "layers" or not parts[1].isdigit():
            raise ValueError(f"weights file {path!r}: tensor {name} is not named layers.<index>.<name>")
        layers.setdefault(int(parts[1]), {})[parts[2]] = t
    extra = {k: v for k, v in meta.items() if k not in ("format", "memory", "model", "shape")}
    w = MemoryWeights(meta.get("memory", ""), meta.get("model", ""), file_shape, layers, extra)
    w.check(f"weights file {path!r}")
    if "tensors_sha256" in meta and meta["tensors_sha256"] != (digest := tensors_digest(layers)):
        raise ValueError(f"weights file {path!r}: its tensors do not match its metadata tensors_sha256 = "
                         f"{meta['tensors_sha256']} (their SHA-256 is {digest}: changed after it was written)")
    return w
