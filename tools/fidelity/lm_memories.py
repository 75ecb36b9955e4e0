"""The memories of the end-to-end study, sized for a fraction f of a T-token KV cache, as factories for
kvmem.transformers.KvmemCache (one memory per layer, built at the layer's first call).

Sizing follows kvmem-eval's rules (tools/kvmem_eval/sizing.hpp, window share s = 1/4, one window chunk,
one sink) so the per-layer and end-to-end tables read the same memories:

  M = f * T tokens per kv-head and layer;  chunk C = max(1, round(s * M));  rows R = max(C, round(M) - C)
  kvm-fixed   KVM, window C, budget.Fixed(R), row cap R + C
  kvm-sqrt    KVM, window C, budget.PowerLaw(a * sqrt(ctx)) with a = R / sqrt(T) (R rows at token T)
  kvm-h2o     KVM, window C, budget.PowerLaw(16 * sqrt(ctx)) and H2O row eviction down to R rows
  ovq         OVQ, open chunk C, at most R centroids (plateau)
  proportional  proportional merging (mean keys and values, log-count bias), window C, budget.Fixed(R),
              row cap R + C, 4 sinks (as the eviction memories)
  streaming, knorm, h2o, tova   eviction: window w = min(M, max(1, round(s * M))), 4 sinks, top-k the rest
  streaming-merge, knorm-merge, h2o-merge, tova-merge   the same evictions, each evicted row merged into its
              most similar kept row (merge_evicted)
  snapkv-end, h2o-end, tova-end, knorm-end, streaming-end (and snapkv-end-merge, h2o-end-merge)   the same
              sizes, compressed at the end of the prompt (EvictionConfig::chunk = 0: exact attention over the
              prompt, its last min(OBSERVATION, T / 4) queries score, the first decode step evicts down to the budget;
              kvpress's and SnapKV's setting); snapkv scores with SnapKV's pooled observation-window attention
  snapkv-chunk, h2o-chunk   compressed once per chunk of C = round(CHUNK_SHARE * T) positions (T: the prompt),
              observed by the chunk's last min(OBSERVATION, T / 4, C) queries, so that a memory never holds more than
              its budget and one chunk (3/8 of the prompt at 1/4)

KVM and OVQ take a layer's calibrated scalars (tools/fidelity/calibrate.py) when `calibration` is given
({layer: {"ln_weight", "ln_bias", "tau_state", "beta"}}), trained weights (kvmem.weights.MemoryWeights, written
by tools/distill/distill.py) when `weights` is given, the neutral stand-ins otherwise. KVPOP (eviction
sized as the others, its mLSTM scorers trained by tools/distill/distill.py --memory kvpop: no public
checkpoint has them) runs only with `weights`. Trellis is not here (it needs per-token targets and gates
that a pretrained transformer does not have, see kvmem.transformers).
"""
from __future__ import annotations

import math

import torch

import kvmem
import kvmem.transformers as kt
from kvmem.train.distill import KvmSetup, KvpopSetup, OvqSetup

WINDOW_SHARE = 0.25
KVM_SINKS = 1
EVICTION_SINKS = 4

#: memory ids in table order, with their labels
LABELS = {"kvm-fixed": "KVM fixed", "kvm-sqrt": "KVM a*sqrt(N)", "kvm-h2o": "KVM + H2O rows", "ovq": "OVQ plateau",
          "proportional": "Proportional merge",
          "streaming": "StreamingLLM", "knorm": "KNorm", "h2o": "H2O", "tova": "TOVA",
          "streaming-merge": "StreamingLLM + merge", "knorm-merge": "KNorm + merge", "h2o-merge": "H2O + merge",
          "tova-merge": "TOVA + merge", "kvpop": "KVPOP (trained)",
          "snapkv-end": "SnapKV at prompt end", "h2o-end": "H2O at prompt end", "tova-end": "TOVA at prompt end",
          "knorm-end": "KNorm at prompt end", "streaming-end": "StreamingLLM at prompt end",
          "snapkv-end-merge": "SnapKV at prompt end + merge", "h2o-end-merge": "H2O at prompt end + merge",
          "snapkv-chunk": "SnapKV per chunk", "h2o-chunk": "H2O per chunk"}
#: memories that run only with trained weights (factory(..., weights=...)), not in the study's default runs
WEIGHTS_ONLY = ("kvpop",)
#: memories compressed per chunk or at the end of the prompt (EvictionConfig::chunk != 1): within one prefill
#: their attention is exact, so only a continuation decoded after the prompt (continuation.py) sees them
COMPRESSING = tuple(m for m in LABELS if "-end" in m or m.endswith("-chunk"))
#: the memories end_to_end.py runs by default (every id of LABELS but WEIGHTS_ONLY and COMPRESSING)
STUDY = tuple(m for m in LABELS if m not in WEIGHTS_ONLY and m not in COMPRESSING)
EVICTIONS = ("streaming", "knorm", "h2o", "tova")  # scorers of the eviction memories (and of their "-merge" forms)
OBSERVATION = 64  # the observation window of the compressing memories (queries; kvpress's default)
CHUNK_SHARE = 1 / 8  # positions per compression of the "-chunk" memories, as a share of the prompt
CALIBRATED = ("kvm-fixed", "kvm-sqrt", "kvm-h2o", "ovq")  # the memories with learned scalars


def budget_split(T: int, fraction: float) -> tuple[int, int]:
    """(C, R): chunk (= window) tokens and state rows of a fraction of a T-token cache. Raises ValueError
    naming the fraction when it leaves no room for a chunk above the sink."""
    M = fraction * T
    C = max(1, round(WINDOW_SHARE * M))
    R = max(C, round(M) - C)
    if C <= KVM_SINKS or R <= KVM_SINKS:
        raise ValueError(f"fraction = {fraction}: {M:.1f} tokens of a {T}-token cache leave chunk {C} and rows {R}, "
                         f"which must exceed the {KVM_SINKS} sink row")
    return C, R


def eviction_sizes(T: int, fraction: float) -> dict:
    """An eviction memory's sinks, window and top_k (tokens) at `fraction` of a T-token cache: M = f T tokens,
    window w = min(M, max(1, round(s M))), up to EVICTION_SINKS sinks, top-k the rest."""
    M = round(fraction * T)
    w = min(M, max(1, round(WINDOW_SHARE * fraction * T)))
    sinks = max(0, min(EVICTION_SINKS, M - w))
    return {"sinks": sinks, "window": w, "top_k": max(0, M - w - sinks)}


def _layer_weights(calibration, layer_idx: int, kind: str) -> dict:
    if calibration is None:
        return {}
    if layer_idx not in calibration:
        raise ValueError(f"calibration: has no layer {layer_idx} (calibrate every layer of the model)")
    c = calibration[layer_idx]
    if kind == "ovq":
        return {"beta": torch.tensor(c["beta"], dtype=torch.float32)}
    return {name: torch.tensor(c[name], dtype=torch.float32) for name in ("ln_weight", "ln_bias", "tau_state")}


def setup(memory: str, T: int, fraction: float) -> KvmSetup | OvqSetup | KvpopSetup:
    """The KVM, OVQ or KVPOP memory `memory` ("kvm-fixed", "kvm-sqrt", "ovq" or "kvpop") at `fraction` of a
    T-token cache, as kvmem.train's setups (what tools/distill/distill.py trains and factory() runs). Raises
    ValueError for another id or a fraction too small (budget_split)."""
    if memory == "kvpop":
        return KvpopSetup(**eviction_sizes(T, fraction))
    C, R = budget_split(T, fraction)
    if memory == "ovq":
        return OvqSetup(chunk=C, max_centroids=R)
    if memory == "kvm-fixed":
        return KvmSetup(chunk=C, window_chunks=1, sinks=KVM_SINKS, max_rows=R + C, budget=kvmem.budget.Fixed(R))
    if memory == "kvm-sqrt":
        return KvmSetup(chunk=C, window_chunks=1, sinks=KVM_SINKS, max_rows=R + C,
                        budget=kvmem.budget.PowerLaw(growth_factor=R / math.sqrt(T)))
    raise ValueError(f"memory = {memory!r}: has no trained form (trainable: {', '.join(TRAINABLE)})")


TRAINABLE = ("kvm-fixed", "kvm-sqrt", "ovq", "kvpop")  # the memories setup() and tools/distill/distill.py know


def factory(memory: str, T: int, fraction: float, calibration=None, weights=None):
    """A KvmemCache factory of `memory` (an id of LABELS) at `fraction` of a T-token cache, with the calibrated
    scalars `calibration` or the trained weights `weights` (kvmem.weights.MemoryWeights; TRAINABLE memories
    only). Raises ValueError for an unknown id, weights for another memory, or a fraction too small
    (budget_split)."""
    if memory not in LABELS:
        raise ValueError(f"memory = {memory!r}: unknown (known: {', '.join(LABELS)})")
    if weights is not None:
        if memory not in TRAINABLE:
            raise ValueError(f"memory = {memory!r}: takes no trained weights (trainable: {', '.join(TRAINABLE)})")
        s = setup(memory, T, fraction)
        if memory == "kvpop":
            return kt.eviction("kvpop", weights=weights, **s.memory_args())
        make = kt.ovq if memory == "ovq" else kt.kvm
        return make(weights=weights, **s.memory_args())
    if memory == "kvpop":
        raise ValueError("memory = 'kvpop': needs trained scorers (weights; tools/distill/distill.py --memory kvpop)")
    scorer = memory.removesuffix("-merge")
    if memory in COMPRESSING:
        scorer, _, when = scorer.partition("-")
        chunk = 0 if when == "end" else chunk_tokens(T)
        return kt.eviction(scorer, **eviction_sizes(T, fraction), merge_evicted=memory.endswith("-merge"), chunk=chunk,
                           observation_window=observation_tokens(T) if chunk == 0 else min(observation_tokens(T), chunk))
    if scorer in EVICTIONS:
        return kt.eviction(scorer, **eviction_sizes(T, fraction), merge_evicted=memory.endswith("-merge"))
    C, R = budget_split(T, fraction)
    if memory == "proportional":
        return kt.proportional(chunk=C, window_chunks=1, sinks=min(EVICTION_SINKS, C - 1), max_rows=R + C,
                               budget=kvmem.budget.Fixed(R))
    if memory == "ovq":
        args = setup(memory, T, fraction).memory_args()
        return lambda layer_idx, **shape: kvmem.OvqMemory(**shape, **args, **_layer_weights(calibration, layer_idx, "ovq"))
    if memory in TRAINABLE:
        kvm_args = setup(memory, T, fraction).memory_args()
    else:  # kvm-h2o
        kvm_args = {"chunk": C, "window_chunks": 1, "sinks": KVM_SINKS, "max_rows": T + C,
                    "budget": kvmem.budget.PowerLaw(growth_factor=16.0), "evict_rows_above": R}
    return lambda layer_idx, **shape: kvmem.KvmMemory(**shape, **kvm_args,
                                                      **_layer_weights(calibration, layer_idx, "kvm"))


def observation_tokens(T: int) -> int:
    """The observation window (queries) of the compressing memories for a T-token prompt: OBSERVATION, at most
    a quarter of the prompt (so at most half a chunk, and never longer than the prompt: kvmem refuses that)."""
    return max(1, min(OBSERVATION, T // 4))


def chunk_tokens(T: int) -> int:
    """Positions per compression of the "-chunk" memories for a T-token prompt: round(CHUNK_SHARE * T), at least 2."""
    return max(2, round(CHUNK_SHARE * T))


def peak_tokens(memory: str, T: int, fraction: float) -> int:
    """The most tokens' worth of keys and values the memory holds per kv-head while it reads a T-token prompt
    and decodes after it: the prompt and one decoded token for a memory compressed at the prompt's end (chunk
    0), the budget and one chunk for one compressed per chunk, the budget for the streaming memories."""
    if memory in COMPRESSING and "-end" in memory:
        return T + 1
    if memory in COMPRESSING:
        return held_tokens(memory, T, fraction) + chunk_tokens(T)
    return held_tokens(memory, T, fraction)


def held_tokens(memory: str, T: int, fraction: float) -> int:
    """Tokens' worth of keys and values the memory holds per kv-head at the end of T tokens (its budget)."""
    if memory.removesuffix("-merge") in EVICTIONS or memory == "kvpop" or memory in COMPRESSING:
        return round(fraction * T)
    C, R = budget_split(T, fraction)
    return R + C
