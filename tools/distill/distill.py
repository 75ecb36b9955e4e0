#!/usr/bin/env python3
"""Distills a memory's own parameters into a pretrained causal LM, its weights frozen (issue 45): every
attention layer's KVM or OVQ parameters (or KVPOP's scorers) are fitted, through the memory's training form (kvmem.train), first
layer by layer to the layer's exact attention (stage 1), then all together to the full-cache model's
next-token distributions (stage 2, KL divergence), on training texts, and written as one weights file
(kvmem.weights) that kvmem.transformers.kvm/ovq(weights=...) and tools/fidelity/end_to_end.py --weights load.

  distill.py --memory kvm-fixed --fraction 1/8 --output kvm-fixed-8.safetensors [--report curves.json]
             [--model smollm2 | --model HF_DIR] [--text FILE ...] [--tokens 2048] [--steps 40]
             [--e2e-steps 0] [--e2e-texts 2] [--init WEIGHTS] [--adapter-rank 0] [--quick]

- The memory is sized as tools/fidelity/lm_memories.py sizes it for --tokens tokens at --fraction of the cache
  (kvm-fixed, kvm-sqrt, ovq or kvpop): what the weights are trained in is what the evaluation runs.
- Training texts (default TRAINING_TEXTS: Debian's licences and Python sources that no evaluation of
  docs/fidelity.md reads) are read as plain text, the first --tokens tokens of each one sequence; a text
  shorter than the memory's chunk is refused. Each is recorded in the weights file with its SHA-256.
- One forward pass of the model per text captures every layer's attention input and queries, keys and
  values; then layer by layer, --steps Adam steps over all texts (kvmem.train.distill.fit_kvm_layer /
  fit_ovq_layer), one line of progress per layer on stderr with the loss before and after.
- KVPOP (--memory kvpop): each layer's mLSTM scorers (one per kv-head) are trained by KVPOP's pairwise
  ranking loss against the teacher ranking of the layer's future-attention importance
  (kvmem.train.distill.fit_kvpop_layer; kvpop-paper Sec. 2.1, App. D), sized as the eviction memories of
  lm_memories.py; it has no stage 2 (its hard top-k gives the model's output no gradient), so --e2e-steps
  and --init are refused with it.
- --adapter-rank R > 0 (KVM and OVQ): the "distilled + adapters" variant. Each layer also gets rank-R
  low-rank adapters on its q and k projections (kvmem.adapters: q = W_q x + up (down x), the same for k),
  trained with the memory's parameters: stage 1 runs the layer's attention module again on its captured
  input with the adapters (kvmem.train.distill.fit_adapted_layer) against exact attention of the unadapted
  model, stage 2 trains them end to end with the rest. The weights file holds them (shape adapter_rank = R)
  and kvmem.transformers' factories apply them.
- Stage 2 (--e2e-steps > 0): Adam steps on every layer's parameters at once, from stage 1's, on the KL
  divergence of the model with the training form in every layer to the model with its full cache, over the
  first --e2e-texts texts (kvmem.train.distill.fit_end_to_end); one line of progress per step.
- --init WEIGHTS starts from a weights file of this memory and model (an earlier run's) instead of stage 1,
  which it skips: stage 2 alone, with the file's adapters if it has any (--adapter-rank must then be 0 or
  the file's rank).
- --report writes the loss curves (JSON); --quick is the whole pipeline small (256 tokens, 2 texts, 3 steps
  per layer, 2 end-to-end steps on one text, none for KVPOP) for tests.

The training runs torch and kvmem on one thread each (faster here than two threads that contend for the
same OpenMP runtime). Errors (an unknown memory, a fraction too small, a text not found or shorter than one
chunk, a model whose attention cannot be hooked) print one line naming the problem and exit with status 2.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch and kvmem start their OpenMP threads
os.environ.setdefault("KVMEM_NUM_THREADS", "1")
import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "capture"))
sys.path.insert(0, os.path.join(HERE, "..", "fidelity"))
import causal_lm  # noqa: E402
import lm_memories  # noqa: E402
from calibrate import CalibrationError, parse_fraction  # noqa: E402
from capture import CaptureError  # noqa: E402

#: Default training texts: none of them is read by an evaluation of docs/fidelity.md (which reads GPL-2,
#: GPL-3, LGPL-2.1, Apache-2.0, MPL-2.0, Artistic and the KVM paper). Paths inside the build environment.
TRAINING_TEXTS = ("/usr/share/common-licenses/CC-BY-SA-4.0", "/usr/share/common-licenses/GFDL-1.3",
                  "/usr/share/common-licenses/Artistic-2.0", "/usr/lib/python3.14/argparse.py",
                  "/usr/lib/python3.14/difflib.py", "/usr/lib/python3.14/textwrap.py")


class DistillError(Exception):
    """Bad input of distill.py; main() prints it and exits with status 2."""


def training_texts(paths: list[str], tok, tokens: int, chunk: int) -> tuple[list[list[int]], list[dict]]:
    """The first ``tokens`` token ids of each text and its record (path, sha256, tokens used). Raises
    DistillError naming a text that is missing or shorter than ``chunk`` tokens."""
    seqs, records = [], []
    for path in paths:
        try:
            ids, info = causal_lm.read_text(path, tok, tokens)
        except CaptureError as e:
            raise DistillError(str(e)) from None
        if len(ids) < chunk:
            raise DistillError(f"--text {path!r}: has {len(ids)} tokens, fewer than the memory's chunk of {chunk}")
        seqs.append(ids)
        records.append({"path": path, "sha256": info["sha256"], "tokens": len(ids)})
    return seqs, records


def weights_kind(memory: str) -> str:
    """The kvmem.weights memory of a TRAINABLE id: "ovq", "kvpop" or "kvm"."""
    return memory if memory in ("ovq", "kvpop") else "kvm"


def distill(model, model_name: str, seqs: list[list[int]], memory: str, setup, steps: int, log=print,
            adapter_rank: int = 0) -> tuple:
    """Stage 1: captures every layer on ``seqs`` and fits each layer's parameters (with rank-``adapter_rank``
    adapters when it is > 0); returns (one dict of tensors per layer, one loss curve per layer, seconds per
    layer)."""
    from kvmem.train.capture import capture
    from kvmem.train.distill import fit_adapted_layer, fit_kvm_layer, fit_kvpop_layer, fit_ovq_layer

    t0 = time.time()
    captured = [capture(model, torch.tensor([ids])) for ids in seqs]  # [text][layer]
    log(f"distill: captured {len(captured[0])} layers of {len(seqs)} texts in {time.time() - t0:.0f} s")
    plain = {"ovq": fit_ovq_layer, "kvpop": fit_kvpop_layer}.get(memory, fit_kvm_layer)

    def fit(batches, layer):
        if adapter_rank:
            return fit_adapted_layer(model, layer, batches, setup, rank=adapter_rank, steps=steps)
        return plain(batches, setup, steps=steps)
    what = "ranking loss" if memory == "kvpop" else "relative error"
    tensors, curves, seconds = [], [], []
    for layer in range(len(captured[0])):
        t = time.time()
        result = fit([c[layer] for c in captured], layer)
        tensors.append(result.tensors)
        curves.append(result.curve)
        seconds.append(time.time() - t)
        left = (len(captured[0]) - layer - 1) * sum(seconds) / len(seconds)
        log(f"distill: layer {layer + 1}/{len(captured[0])}: {what} {result.curve[0]:.3f} -> "
            f"{result.curve[-1]:.3f} ({seconds[-1]:.0f} s; about {left / 60:.0f} min left)")
    return tensors, curves, seconds


def end_to_end(model, seqs: list[list[int]], memory: str, setup, tensors: list[dict], steps: int, log=print) -> tuple:
    """Stage 2 from stage 1's ``tensors`` on ``seqs``; returns (one dict of tensors per layer, the KL curve)."""
    from kvmem.adapters import of_tensors
    from kvmem.train.distill import fit_end_to_end, parameters_of

    layers = [parameters_of(weights_kind(memory), t) for t in tensors]
    adapters = [of_tensors(t) for t in tensors]
    adapters = None if adapters[0] is None else adapters
    t0 = time.time()

    def progress(step, loss):
        left = (steps - step - 1) * (time.time() - t0) / (step + 1)
        log(f"distill: end-to-end step {step + 1}/{steps}: KL {loss:.4f} ({left / 60:.0f} min left)")

    curve = fit_end_to_end(model, layers, setup, [torch.tensor([ids]) for ids in seqs], steps=steps,
                           adapters=adapters, on_step=progress)
    log(f"distill: end to end: KL {curve[0]:.4f} -> {curve[-1]:.4f} in {(time.time() - t0) / 60:.1f} min")
    return [p.tensors() | (a.tensors() if adapters else {}) for p, a in zip(layers, adapters or layers)], curve


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--memory", required=True, help=f"one of {', '.join(lm_memories.TRAINABLE)}")
    ap.add_argument("--fraction", default="1/8", help="the memory's share of a --tokens-token KV cache")
    ap.add_argument("--output", required=True, help="the weights file (safetensors)")
    ap.add_argument("--report", default=None, help="JSON with each layer's loss curve")
    ap.add_argument("--model", default="smollm2", help="'smollm2' or a Hugging Face model directory")
    ap.add_argument("--text", action="append", default=None, help="a training text (repeat; default: TRAINING_TEXTS)")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of each training text and the memory's sizing")
    ap.add_argument("--steps", type=int, default=40, help="Adam steps per layer")
    ap.add_argument("--e2e-steps", type=int, default=0, help="stage 2: end-to-end Adam steps (0: none)")
    ap.add_argument("--e2e-texts", type=int, default=2, help="stage 2: the first N training texts")
    ap.add_argument("--init", default=None, help="start from this weights file and skip stage 1")
    ap.add_argument("--adapter-rank", type=int, default=0, help="rank of the q and k adapters trained too (0: none)")
    ap.add_argument("--quick", action="store_true", help="small: 256 tokens, the first 2 texts, 3 steps, 2 end-to-end steps")
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens, args.steps, args.e2e_steps, args.e2e_texts = 256, 3, 0 if args.memory == "kvpop" else 2, 1
        args.text = (args.text or list(TRAINING_TEXTS))[:2]
    torch.set_num_threads(1)
    try:
        if args.memory not in lm_memories.TRAINABLE:
            raise DistillError(f"--memory {args.memory!r}: not trainable here (choose {', '.join(lm_memories.TRAINABLE)})")
        if args.memory == "kvpop" and (args.e2e_steps or args.init):
            raise DistillError("--e2e-steps / --init: KVPOP's scorers are trained by their ranking loss only (the hard "
                               "top-k gives the model's output no gradient); leave them out for --memory kvpop")
        if args.adapter_rank < 0 or (args.adapter_rank and args.memory == "kvpop"):
            raise DistillError(f"--adapter-rank {args.adapter_rank}: must be >= 0, and 0 for --memory kvpop (adapters "
                               f"are trained with the KVM and OVQ memories)")
        if args.tokens < 1 or args.steps < 0 or args.e2e_steps < 0 or args.e2e_texts < 1:
            raise DistillError(f"--tokens {args.tokens}, --steps {args.steps}, --e2e-steps {args.e2e_steps}, --e2e-texts "
                               f"{args.e2e_texts}: need tokens >= 1, steps >= 0, e2e-steps >= 0 and e2e-texts >= 1")
        fraction = parse_fraction(args.fraction)
        setup = lm_memories.setup(args.memory, args.tokens, fraction)
        model, tok, model_name = causal_lm.load_model(args.model)
        if args.tokens > causal_lm.context_limit(model):
            raise DistillError(f"--tokens {args.tokens}: beyond the model's context of {causal_lm.context_limit(model)}")
        seqs, records = training_texts(args.text or list(TRAINING_TEXTS), tok, args.tokens,
                                       setup.window + 1 if args.memory == "kvpop" else setup.chunk)
        from kvmem import weights as kw
        from kvmem.train.capture import attention_modules
        from kvmem.train.distill import memory_weights

        attention_modules(model)  # a model whose attention cannot be hooked fails here, before any work
        kind = weights_kind(args.memory)
        init = kw.load(args.init, memory=kind, model=model_name) if args.init else None
        if init is not None and args.adapter_rank not in (0, init.shape["adapter_rank"]):
            raise DistillError(f"--adapter-rank {args.adapter_rank}: --init {args.init!r} has adapters of rank "
                               f"{init.shape['adapter_rank']} (give 0 or that rank)")
        rank = init.shape["adapter_rank"] if init is not None else args.adapter_rank
    except (DistillError, CalibrationError, CaptureError, ValueError, FileNotFoundError) as e:
        print(f"distill: error: {e}", file=sys.stderr)
        return 2

    t0 = time.time()
    if init is None:
        tensors, curves, seconds = distill(model, model_name, seqs, args.memory, setup, args.steps,
                                           log=lambda s: print(s, file=sys.stderr, flush=True), adapter_rank=rank)
    else:  # stage 2 from an earlier run: its stage-1 curves stay in its own report
        tensors, curves, seconds = [init.layer(i) for i in range(init.shape["layers"])], [], []
    e2e_curve = []
    if args.e2e_steps:
        tensors, e2e_curve = end_to_end(model, seqs[:args.e2e_texts], args.memory, setup, tensors, args.e2e_steps,
                                        log=lambda s: print(s, file=sys.stderr, flush=True))
    recipe = {"tool": "tools/distill/distill.py", "steps": 0 if args.init else args.steps, "tokens": args.tokens,
              "loss": ("KVPOP's pairwise ranking loss (kvpop-paper eq. 2, margin-weighted) against the teacher "
                       "ranking by each layer's future-attention importance (App. D, exact)" if kind == "kvpop" else
                       "stage 1: relative squared error of each layer's attention output against exact attention; "
                       "stage 2: KL(full-cache model || model with the memory in every layer) per next token"),
              "optimizer": "Adam", "e2e_steps": args.e2e_steps, "e2e_texts": min(args.e2e_texts, len(seqs)),
              "adapter_rank": rank, "quick": args.quick}
    meta = {"memory_id": args.memory, "fraction": args.fraction, "setup": repr(setup), "recipe": recipe,
            "training_texts": records}
    if init is not None:
        meta["init"] = {"path": args.init, "sha256": hashlib.sha256(open(args.init, "rb").read()).hexdigest(),
                        "recipe": init.metadata.get("recipe"), "training_texts": init.metadata.get("training_texts")}
    kw.save(args.output, memory_weights(kind, model_name, model, tensors, meta))
    if args.report:
        with open(args.report, "w") as f:
            json.dump({**meta, "model": model_name, "seconds": time.time() - t0, "layer_seconds": seconds,
                       "curves": curves, "e2e_curve": e2e_curve, "weights": args.output,
                       "weights_sha256": hashlib.sha256(open(args.output, "rb").read()).hexdigest()}, f, indent=1)
    loss_name = "ranking loss" if kind == "kvpop" else "relative error"
    summary = [f"mean {loss_name} over {len(curves)} layers {sum(c[0] for c in curves) / len(curves):.3f} -> "
               f"{sum(c[-1] for c in curves) / len(curves):.3f}"] if curves else []
    summary += [f"KL {e2e_curve[0]:.4f} -> {e2e_curve[-1]:.4f}"] if e2e_curve else []
    print(f"distill: {args.memory} at {args.fraction}: {', '.join(summary) or 'nothing trained'} in "
          f"{(time.time() - t0) / 60:.1f} min -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
