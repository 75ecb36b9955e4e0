#!/usr/bin/env python3
"""Each distilled memory per layer on a held-out text (issue 45): how far the trained weights take each
attention layer's output towards exact attention on a text no training read, beside the same memory with
its neutral parameters and the training-free memories at the same share of the cache.

  held_out.py --text FILE --output layers.json --weights W.safetensors ... [--tokens 2048] [--compare h2o,tova]
              [--model smollm2 | --model HF_DIR]

- The model (frozen) runs once on the first --tokens tokens of --text; every attention layer's input x and
  its queries, keys and values are captured (kvmem.train.capture).
- Rows, each the relative L2 error sqrt(sum |y - y_exact|^2 / sum |y_exact|^2) of a layer's attention
  output against exact causal attention on the captured q, k, v, for every layer:
  - per --weights file (tools/distill/distill.py's; the memory and fraction its metadata names): the
    memory with the file's weights (and the training stages its recipe records: "1", or "1 + 2" for stage 2
    from stage 1's weights);
  - per memory and fraction met: the memory with its neutral parameters, and each --compare memory
    (tools/fidelity/lm_memories.py's ids) at that fraction.
  Every row runs kvmem's C++ memories through the factories end_to_end.py uses (kvmem.transformers; KVM's
  merge gate z = x . W_g from the captured x), sized for --tokens tokens.
- With adapters (a file whose shape has adapter_rank > 0), layer L's memory reads the q and k of the model
  with the file's adapters on layer L alone (a second capture per layer: layer L's input is the unadapted
  model's, as in distill.py's stage 1); the target stays exact attention of the unadapted model.

Errors (a text not found or shorter than a memory's chunk, a weights file for another model, a fraction too
small, an unknown --compare memory) print one line naming the problem and exit with status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("KVMEM_NUM_THREADS", "1")
import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "capture"))
sys.path.insert(0, os.path.join(HERE, "..", "fidelity"))
import causal_lm  # noqa: E402
import end_to_end  # noqa: E402
import lm_memories  # noqa: E402
from calibrate import CalibrationError  # noqa: E402
from capture import CaptureError  # noqa: E402


def relative_error(y: torch.Tensor, target: torch.Tensor) -> float:
    """sqrt(sum |y - target|^2 / sum |target|^2), in float64."""
    y, target = y.double(), target.double()
    return ((y - target).square().sum() / target.square().sum()).sqrt().item()


def stages(weights) -> str:
    """The training stages a distill.py weights file went through: "1", "1 + 2" (stage 2 after stage 1) or "2"
    (stage 2 alone, without its --init's record), from its metadata recipe and init."""
    recipe = json.loads(weights.metadata.get("recipe", "{}"))
    if not recipe.get("e2e_steps"):
        return "1"
    return "1 + 2" if recipe.get("steps") or "init" in weights.metadata else "2"


def layer_errors(model, ids: torch.Tensor, captured: list, factory, weights=None) -> list[float]:
    """The relative L2 error of each layer's memory (``factory(layer, **sizes)``; KVM's gate from x when the
    factory has trained gate weights) against exact attention on ``captured`` (kvmem.train.capture's
    LayerInputs of ``ids``); with ``weights`` holding adapters, layer L reads the q and k of the model with
    layer L's adapters alone."""
    from kvmem import adapters as ka
    from kvmem.train.capture import capture, exact_attention

    adapters = None
    if weights is not None and weights.shape.get("adapter_rank", 0) > 0:
        adapters = [ka.of_tensors(weights.layer(i)) for i in range(weights.shape["layers"])]
    out = []
    for layer, inputs in enumerate(captured):
        q, k = inputs.q, inputs.k
        if adapters is not None:
            hooks = ka.attach(model, lambda i, layer=layer: adapters[i] if i == layer else None)
            try:
                adapted = capture(model, ids)[layer]
            finally:
                hooks.remove()
            q, k = adapted.q, adapted.k
        B, Hq, T, D = q.shape
        memory = factory(layer, head_dim=D, query_heads=Hq, kv_heads=k.shape[1], value_dim=inputs.v.shape[-1],
                         batch=B, dtype=torch.float32)
        gate_weight = factory.gate_weight(layer) if hasattr(factory, "gate_weight") else None
        extras = () if gate_weight is None else ((inputs.x @ gate_weight).transpose(1, 2).contiguous(),)
        y = memory.prefill(q.contiguous(), k.contiguous(), inputs.v.contiguous(), *extras)
        out.append(relative_error(y, exact_attention(inputs.q, inputs.k, inputs.v)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--text", required=True, help="the held-out text")
    ap.add_argument("--output", required=True, help="JSON report")
    ap.add_argument("--weights", action="append", default=[], help="a distill.py weights file (repeat)")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of the text read, and the memories' sizing")
    ap.add_argument("--compare", default="h2o,tova", help="training-free memories measured at each fraction")
    ap.add_argument("--model", default="smollm2", help="'smollm2' or a Hugging Face model directory")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    try:
        compare = [m for m in args.compare.split(",") if m]
        for m in compare:
            if m not in lm_memories.LABELS or m == "kvpop":
                raise ValueError(f"--compare: {m!r} unknown or needs weights (known: "
                                 f"{', '.join(x for x in lm_memories.LABELS if x != 'kvpop')})")
        if args.tokens < 1:
            raise ValueError(f"--tokens {args.tokens}: must be >= 1")
        model, tok, model_name = causal_lm.load_model(args.model)
        trained = end_to_end.load_weights(args.weights, model_name)
        ids, info = causal_lm.read_text(args.text, tok, args.tokens)
        T = len(ids)
        for memory, label, f, _, _ in trained:  # sizes first: a fraction too small fails before any work
            for m in [memory] + compare:
                lm_memories.budget_split(T, f)
                if m in lm_memories.TRAINABLE:
                    lm_memories.setup(m, T, f)
    except (ValueError, CalibrationError, CaptureError, FileNotFoundError) as e:
        print(f"held_out: error: {e}", file=sys.stderr)
        return 2

    from kvmem.train.capture import capture

    t0 = time.time()
    ids_t = torch.tensor([ids])
    captured = capture(model, ids_t)
    rows, seen = [], set()

    def add(memory: str, label: str, f: float, sha=None, weights=None):
        rank = weights.shape.get("adapter_rank", 0) if weights is not None else 0
        name = lm_memories.LABELS[memory] + (f" + adapters (rank {rank})" if rank else "")
        errors = layer_errors(model, ids_t, captured, lm_memories.factory(memory, T, f, None, weights), weights)
        rows.append({"memory": memory, "label": name, "fraction_label": label, "fraction": f, "distilled": sha,
                     "stages": stages(weights) if weights is not None else None, "adapter_rank": rank,
                     "errors": errors, "mean": sum(errors) / len(errors)})
        print(f"held_out: {name}{' (distilled)' if sha else ''} at {label}: mean relative L2 error "
              f"{rows[-1]['mean']:.3f} ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)

    for memory, label, f, sha, weights in trained:
        for m in ([memory] if memory != "kvpop" else []) + compare:
            if (m, label) not in seen:
                seen.add((m, label))
                add(m, label, f)
        add(memory, label, f, sha, weights)
    report = {"tool": "tools/distill/held_out.py", "model": model_name, "text": info, "tokens": T,
              "layers": len(captured), "rows": rows, "seconds": time.time() - t0}
    with open(args.output + ".part", "w") as out:
        json.dump(report, out, indent=1)
    os.replace(args.output + ".part", args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
