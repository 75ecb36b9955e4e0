#!/usr/bin/env python3
"""The continuation decoded after a compressed prompt: the perplexity of the tokens a causal LM decodes,
one at a time, after reading a prompt through a kvmem memory in every attention layer, at each memory
fraction of the prompt, against the same model with its full cache.

  continuation.py --output cont.json --text FILE [--prompt-tokens 1536] [--continuation-tokens 512]
                  [--fractions 1/4,1/8,1/16] [--memories h2o,snapkv-end,...] [--dtype float32]
                  [--model smollm2|DIR] [--markdown table.md]

The first --prompt-tokens tokens of --text are the prompt, given to the model in one forward (a prefill);
the next --continuation-tokens tokens are the continuation, each given in a forward of its own (a decode
step, teacher-forced), so that every memory reads its prompt as an engine's would: the streaming memories
(lm_memories.STUDY) bounded during the prefill, the compressing ones (lm_memories.COMPRESSING: at the end
of the prompt, as kvpress and SnapKV, or per chunk) exact over the prompt and compressed at the first
decode step. The perplexity is over the continuation's tokens (the first one predicted from the prompt's
last position). Memories are sized at each fraction of the prompt's tokens (lm_memories' rules) and keep
that budget while decoding. The full cache's row is the model's own attention over prompt and
continuation (one forward: the same logits as decoding with a full cache). Also reported: the share of
continuation positions whose greedy prediction is the full cache's, and what each memory held.

Errors (a text not found or too short, a fraction too small for the prompt, an unknown memory) print one
line naming the problem and exit with status 2.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "capture"))
sys.path.insert(0, HERE)
import lm_memories  # noqa: E402
from calibrate import parse_fraction  # noqa: E402
from capture import CaptureError  # noqa: E402
from end_to_end import Progress, text_tokens  # noqa: E402

DEFAULT_MEMORIES = ("streaming", "h2o", "tova", "streaming-merge", "h2o-merge", "proportional", "kvm-fixed",
                    "snapkv-end", "h2o-end", "tova-end", "knorm-end", "streaming-end", "snapkv-end-merge",
                    "h2o-end-merge", "snapkv-chunk", "h2o-chunk")


def continuation_logits(model, ids: torch.Tensor, prompt: int, cache) -> torch.Tensor:
    """Logits [continuation + 1, vocab] of positions prompt - 1 .. T - 1 of ids [1, T]: the prompt in one
    forward through `cache`, then each continuation token in a forward of its own (teacher-forced)."""
    with torch.no_grad():
        out = [model(ids[:, :prompt], past_key_values=cache, use_cache=True).logits[0, -1:]]
        for t in range(prompt, ids.shape[1]):
            out.append(model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits[0])
    return torch.cat(out)


def score(logits: torch.Tensor, targets: torch.Tensor, full_argmax: torch.Tensor | None) -> dict:
    """Perplexity of targets [n] under logits [n, vocab] (positions that predict them), and the share of
    positions whose argmax is the full cache's."""
    nll = torch.nn.functional.cross_entropy(logits.double(), targets, reduction="mean").item()
    out = {"perplexity": math.exp(nll), "nll": nll}
    if full_argmax is not None:
        out["agreement"] = (logits.argmax(-1) == full_argmax).double().mean().item()
    return out


def markdown(report: dict) -> str:
    """The report as a table: a row per memory, a column per fraction (perplexity, and agreement)."""
    fractions = list(dict.fromkeys(r["fraction_label"] for r in report["results"]))
    memories = list(dict.fromkeys(r["memory"] for r in report["results"]))
    cell = {(r["memory"], r["fraction_label"]): r for r in report["results"]}
    head = "| memory | when it compresses | " + " | ".join(f"{f} of the prompt" for f in fractions) + " |"
    lines = [head, "|---|---|" + "---:|" * len(fractions)]
    lines.append(f"| full KV cache | never | " + " | ".join(f"{report['full']['perplexity']:.2f}" for _ in fractions) + " |")
    for m in memories:
        when = "prompt end (chunk 0)" if "-end" in m else f"per chunk of {lm_memories.CHUNK}" if m.endswith("-chunk") \
            else "every token"
        cells = []
        for f in fractions:
            r = cell.get((m, f))
            cells.append("" if r is None else f"{r['perplexity']:.2f} ({100 * r['agreement']:.0f} %)")
        lines.append(f"| {lm_memories.LABELS[m]} | {when} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output", required=True, help="JSON report")
    ap.add_argument("--text", required=True, help="the text: its first tokens the prompt, the next the continuation")
    ap.add_argument("--prompt-tokens", type=int, default=1536)
    ap.add_argument("--continuation-tokens", type=int, default=512)
    ap.add_argument("--fractions", default="1/4,1/8,1/16", help="memory sizes as shares of the prompt's tokens")
    ap.add_argument("--memories", default=",".join(DEFAULT_MEMORIES))
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--model", default="smollm2", help="smollm2 or a Hugging Face model directory")
    ap.add_argument("--markdown", default=None, help="also write the table (markdown) here")
    args = ap.parse_args(argv)
    try:
        import causal_lm
        import kvmem
        import kvmem.transformers as kt

        if args.prompt_tokens < 2 or args.continuation_tokens < 1:
            raise ValueError(f"--prompt-tokens {args.prompt_tokens} and --continuation-tokens "
                             f"{args.continuation_tokens}: need at least 2 and 1")
        fractions = [(s, parse_fraction(s)) for s in args.fractions.split(",")]
        memories = args.memories.split(",")
        for m in memories:
            if m not in lm_memories.LABELS or m in lm_memories.WEIGHTS_ONLY:
                raise ValueError(f"--memories: {m!r} unknown (known: "
                                 f"{', '.join(x for x in lm_memories.LABELS if x not in lm_memories.WEIGHTS_ONLY)})")
        for _, f in fractions:
            lm_memories.budget_split(args.prompt_tokens, f)  # a fraction too small fails before any work
        model, tok, model_name = causal_lm.load_model(args.model)
        model = model.to(getattr(torch, args.dtype))
        T = args.prompt_tokens + args.continuation_tokens
        if T > causal_lm.context_limit(model):
            raise ValueError(f"{T} tokens are beyond the model's context of {causal_lm.context_limit(model)}")
        ids = torch.tensor([text_tokens(args.text, tok, T, "--text")])
    except (ValueError, FileNotFoundError, CaptureError) as e:
        print(f"continuation: error: {e}", file=sys.stderr)
        return 2

    P = args.prompt_tokens
    targets = ids[0, P:]
    progress = Progress(1 + len(memories) * len(fractions))
    progress.step("full KV cache")
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        full_logits = model(ids).logits[0, P - 1:-1]
    full = score(full_logits, targets, None)
    full_argmax = full_logits.argmax(-1)
    results = []
    for memory in memories:
        for label, f in fractions:
            progress.step(f"{memory} at {label}")
            t0 = time.time()
            cache = kt.KvmemCache(model, lm_memories.factory(memory, P, f))
            logits = continuation_logits(model, ids, P, cache)[:-1]
            results.append({"memory": memory, "label": lm_memories.LABELS[memory], "fraction_label": label,
                            "fraction": f, **score(logits, targets, full_argmax),
                            "held_tokens": lm_memories.held_tokens(memory, P, f), "held_bytes": cache.held_bytes(),
                            "seconds": time.time() - t0})
    report = {"tool": "tools/fidelity/continuation.py", "model": model_name, "dtype": args.dtype,
              "backend": kvmem.backend(), "text": args.text, "prompt_tokens": P,
              "continuation_tokens": args.continuation_tokens, "observation_window": lm_memories.OBSERVATION,
              "chunk": lm_memories.CHUNK, "full": full, "results": results}
    with open(args.output, "w") as fh:
        json.dump(report, fh, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(markdown(report))
    best = min(results, key=lambda r: r["perplexity"]) if results else None
    print(f"continuation: full cache perplexity {full['perplexity']:.2f} over {args.continuation_tokens} tokens after "
          f"{P}; {len(results)} memory runs" + (f", best {best['label']} at {best['fraction_label']}: "
                                                f"{best['perplexity']:.2f}" if best else "") + f" -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
