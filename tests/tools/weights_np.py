"""kvmem weights files (format kvmem-memory-weights-1, python/kvmem/weights.py) written with NumPy only, for the
tests of kvmem-run --weights and kvmem-eval --weights: random per-layer tensors of a memory and the metadata
the C++ reader checks (include/kvmem/io/memory_weights.hpp)."""
import json

import numpy as np

import safetensors_np as stn

FORMAT = "kvmem-memory-weights-1"


def shape_of(layers, hidden, query_heads, kv_heads, head_dim, adapter_rank=0):
    """The file's `shape` metadata."""
    return dict(layers=layers, hidden=hidden, query_heads=query_heads, kv_heads=kv_heads, head_dim=head_dim,
                adapter_rank=adapter_rank)


def random_layer(rng, memory, shape):
    """One layer's tensors of `memory` (kvm, ovq) for `shape`, float32, away from the neutral values so that
    applying them changes a memory's output: W_g N(0, 0.3), LayerNorm affine near (1, 0), temperatures and
    beta in [0.6, 1.6]."""
    f, s = np.float32, shape
    if memory == "ovq":
        return {"beta": rng.uniform(0.6, 1.6, s["query_heads"]).astype(f)}
    return {"gate_weight": (0.3 * rng.standard_normal((s["hidden"], s["kv_heads"]))).astype(f),
            "ln_weight": (1 + 0.3 * rng.standard_normal(s["head_dim"])).astype(f),
            "ln_bias": (0.2 * rng.standard_normal(s["head_dim"])).astype(f),
            "tau_state": rng.uniform(0.6, 1.6, s["query_heads"]).astype(f),
            "tau_window": rng.uniform(0.6, 1.6, s["query_heads"]).astype(f)}


def save(path, memory, shape, layers, model="tiny-test", metadata=None):
    """Writes layers {L: {name: array}} of `memory` for `model` to `path`, with the metadata distill.py writes
    (memory_id: kvm-fixed, ovq or kvpop; fraction 1/2); `metadata` adds or overrides keys (None drops one)."""
    meta = {"format": FORMAT, "memory": memory, "model": model, "shape": json.dumps(shape),
            "memory_id": {"kvm": "kvm-fixed"}.get(memory, memory), "fraction": "1/2"}
    meta.update(metadata or {})
    meta = {k: v for k, v in meta.items() if v is not None}
    stn.save(path, {f"layers.{i}.{n}": a for i, layer in layers.items() for n, a in layer.items()}, meta)


def apply_kvm(t, layer):
    """The input `t` with KVM's trained parameters of `layer` in place of its own, as kvmem-run kvm --weights
    applies them: gate = x . W_g (float64 sums rounded to float32), ln_weight, ln_bias, tau_state and
    tau_bswa = tau_window."""
    out = dict(t)
    out["gate"] = np.einsum("btc,ch->bht", t["x"].astype(np.float64), layer["gate_weight"].astype(np.float64)).astype(np.float32)
    out.update(ln_weight=layer["ln_weight"], ln_bias=layer["ln_bias"], tau_state=layer["tau_state"],
               tau_bswa=layer["tau_window"])
    return out
