#!/usr/bin/env python3
"""The continuation decoded after a compressed prompt: the perplexity of the tokens a causal LM decodes,
one at a time, after reading a prompt through a kvmem memory in every attention layer, at each memory
fraction of the prompt, against the same model with its full cache.

  continuation.py --output cont.json --text FILE [--prompt-tokens 1536] [--continuation-tokens 512]
                  [--fractions 1/4,1/8,1/16] [--memories h2o,snapkv-end,...] [--presses kvpress-snapkv,...]
                  [--jobs 2] [--dtype float32] [--model smollm2|DIR] [--markdown table.md]

The first --prompt-tokens tokens of --text are the prompt, given to the model in one forward (a prefill);
the next --continuation-tokens tokens are the continuation, each given in a forward of its own (a decode
step, teacher-forced), so that every memory reads its prompt as an engine's would: the streaming memories
(lm_memories.STUDY) bounded during the prefill, the compressing ones (lm_memories.COMPRESSING: at the end
of the prompt, as kvpress and SnapKV, or per chunk) exact over the prompt and compressed at the first
decode step. kvpress's presses (kvpress_presses.py, --presses) read the same way: the prompt in one prefill
compressed at its end, then the continuation appended. The perplexity is over the continuation's tokens (the
first one predicted from the prompt's last position). Memories and presses are sized at each fraction of the
prompt's tokens (lm_memories' rules; kvpress_presses.kept_tokens) and keep that budget while decoding (a
press never evicts after the prompt: it holds its budget plus the continuation at the end). The full cache's
row is the model's own attention over prompt and continuation (one forward: the same logits as decoding with
a full cache); with presses, the report also gives the largest logit difference between kvpress's loop
without a press and that forward. Also reported: the share of continuation positions whose greedy
prediction is the full cache's, what each memory held after the prompt and the most it held while reading
it (lm_memories.peak_tokens). Runs go to --jobs worker processes of one thread each (parallel_runs.py).

Errors (a text not found or too short, a fraction too small for the prompt, an unknown memory or press,
kvpress missing or at another version) print one line naming the problem and exit with status 2.
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
import kvpress_presses  # noqa: E402
import lm_memories  # noqa: E402
import parallel_runs  # noqa: E402
from calibrate import parse_fraction  # noqa: E402
from capture import CaptureError  # noqa: E402
from end_to_end import Progress, text_tokens  # noqa: E402

DEFAULT_MEMORIES = ("streaming", "h2o", "tova", "knorm", "streaming-merge", "h2o-merge", "proportional", "kvm-fixed",
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


def when(row: dict) -> str:
    """When a row's memory compresses, in words."""
    if row.get("kind") == "kvpress":
        return "prompt end (kvpress)"
    m = row["memory"]
    if "-end" in m:
        return "prompt end (chunk 0)"
    if m.endswith("-chunk"):
        return f"per chunk of {lm_memories.CHUNK_SHARE:.3g} of the prompt"
    return "every token"


def markdown(report: dict) -> str:
    """The report as a table: a row per memory or press, a column per fraction (perplexity, and agreement)."""
    fractions = list(dict.fromkeys(r["fraction_label"] for r in report["results"]))
    rows = list(dict.fromkeys((r.get("kind", "kvmem"), r["memory"]) for r in report["results"]))
    cell = {(r.get("kind", "kvmem"), r["memory"], r["fraction_label"]): r for r in report["results"]}
    head = "| memory | when it compresses | " + " | ".join(f"{f} of the prompt" for f in fractions) + " |"
    lines = [head, "|---|---|" + "---:|" * len(fractions)]
    lines.append(f"| full KV cache | never | " + " | ".join(f"{report['full']['perplexity']:.2f}" for _ in fractions) + " |")
    for kind, m in rows:
        cells = []
        for f in fractions:
            r = cell.get((kind, m, f))
            cells.append("" if r is None else f"{r['perplexity']:.2f} ({100 * r['agreement']:.0f} %)")
        first = next(r for r in report["results"] if (r.get("kind", "kvmem"), r["memory"]) == (kind, m))
        lines.append(f"| {first['label']} | {when(first)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def load(model_name: str, dtype: str):
    """(model, tokenizer) in `dtype`, with the model's own attention (parallel_runs' loader)."""
    import causal_lm

    model, tok, _ = causal_lm.load_model(model_name)
    model = model.to(getattr(torch, dtype))
    model.set_attn_implementation("sdpa")
    return model, tok


def run(model, tok, job: dict) -> dict:
    """One row: the continuation through job's memory (kind "kvmem") or press (kind "kvpress") at its
    fraction (parallel_runs' job)."""
    t0 = time.time()
    ids, P, f = job["ids"], job["prompt"], job["fraction"]
    if job["kind"] == "kvpress":
        logits = kvpress_presses.prefill_decode(model, ids, P, kvpress_presses.make(job["name"], f, model, tok))[:-1]
        sizes = {"held_tokens": kvpress_presses.kept_tokens(P, f), "peak_tokens": P}
    else:
        import kvmem.transformers as kt

        cache = kt.KvmemCache(model, lm_memories.factory(job["name"], P, f))
        logits = continuation_logits(model, ids, P, cache)[:-1]
        sizes = {"held_tokens": lm_memories.held_tokens(job["name"], P, f),
                 "peak_tokens": lm_memories.peak_tokens(job["name"], P, f), "held_bytes": cache.held_bytes()}
    return {"kind": job["kind"], "memory": job["name"], "label": job["label"], "fraction_label": job["fraction_label"],
            "fraction": f, **score(logits, ids[0, P:], job["full_argmax"]), **sizes, "seconds": time.time() - t0}


def parse_runs(args) -> tuple[list[tuple[str, float]], list[dict]]:
    """(fractions as (label, value), runs as {"kind", "name", "label"}) of a tool's --fractions, --memories
    (kvmem, lm_memories ids) and --presses (kvpress_presses ids), checked with --jobs before any work (kvpress
    loaded when a press is asked for). Raises ValueError naming the flag, KvpressError when kvpress is missing."""
    if args.jobs < 1:
        raise ValueError(f"--jobs {args.jobs}: must be at least 1")
    fractions = [(s, parse_fraction(s)) for s in args.fractions.split(",")]
    memories = [m for m in args.memories.split(",") if m]
    presses = [p for p in args.presses.split(",") if p]
    for m in memories:
        if m not in lm_memories.LABELS or m in lm_memories.WEIGHTS_ONLY:
            raise ValueError(f"--memories: {m!r} unknown (known: "
                             f"{', '.join(x for x in lm_memories.LABELS if x not in lm_memories.WEIGHTS_ONLY)})")
    for p in presses:
        if p not in kvpress_presses.PRESSES:
            raise ValueError(f"--presses: {p!r} unknown (known: {', '.join(kvpress_presses.PRESSES)})")
    if presses:
        kvpress_presses.load()
    return fractions, ([{"kind": "kvmem", "name": m, "label": lm_memories.LABELS[m]} for m in memories] +
                       [{"kind": "kvpress", "name": p, "label": kvpress_presses.label(p)} for p in presses])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output", required=True, help="JSON report")
    ap.add_argument("--text", required=True, help="the text: its first tokens the prompt, the next the continuation")
    ap.add_argument("--prompt-tokens", type=int, default=1536)
    ap.add_argument("--continuation-tokens", type=int, default=512)
    ap.add_argument("--fractions", default="1/4,1/8,1/16", help="memory sizes as shares of the prompt's tokens")
    ap.add_argument("--memories", default=",".join(DEFAULT_MEMORIES), help="kvmem memories (lm_memories ids; '' none)")
    ap.add_argument("--presses", default="", help="kvpress presses (kvpress_presses ids, e.g. kvpress-snapkv)")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes, one thread each")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--model", default="smollm2", help="smollm2 or a Hugging Face model directory")
    ap.add_argument("--markdown", default=None, help="also write the table (markdown) here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # also here: small forwards run slower on two threads (parallel_runs.py)
    try:
        import causal_lm
        import kvmem

        if args.prompt_tokens < 2 or args.continuation_tokens < 1:
            raise ValueError(f"--prompt-tokens {args.prompt_tokens} and --continuation-tokens "
                             f"{args.continuation_tokens}: need at least 2 and 1")
        fractions, runs = parse_runs(args)
        for _, f in fractions:
            lm_memories.budget_split(args.prompt_tokens, f)  # a fraction too small fails before any work
        model, tok = load(args.model, args.dtype)
        T = args.prompt_tokens + args.continuation_tokens
        if T > causal_lm.context_limit(model):
            raise ValueError(f"{T} tokens are beyond the model's context of {causal_lm.context_limit(model)}")
        ids = torch.tensor([text_tokens(args.text, tok, T, "--text")])
    except (ValueError, FileNotFoundError, CaptureError, kvpress_presses.KvpressError) as e:
        print(f"continuation: error: {e}", file=sys.stderr)
        return 2

    P = args.prompt_tokens
    targets = ids[0, P:]
    jobs = runs
    progress = Progress(1 + len(jobs) * len(fractions))
    progress.step("full KV cache")
    with torch.no_grad():
        full_logits = model(ids).logits[0, P - 1:-1]
    full = score(full_logits, targets, None)
    check = kvpress_presses.full_cache_check(model, ids, P) if any(j["kind"] == "kvpress" for j in runs) else None
    jobs = [{**j, "fraction_label": fl, "fraction": f, "ids": ids, "prompt": P, "full_argmax": full_logits.argmax(-1),
             "describe": f"{j['name']} at {fl}"} for j in jobs for fl, f in fractions]
    results = parallel_runs.map_jobs("continuation", args.model, args.dtype, jobs, args.jobs, progress.step)
    report = {"tool": "tools/fidelity/continuation.py", "model": args.model, "dtype": args.dtype,
              "backend": kvmem.backend(), "versions": kvpress_presses.installed_versions(), "text": args.text,
              "prompt_tokens": P, "continuation_tokens": args.continuation_tokens,
              "observation_window": lm_memories.observation_tokens(P), "chunk": lm_memories.chunk_tokens(P),
              "kvpress_full_cache_max_abs_diff": check, "full": full, "results": results}
    with open(args.output, "w") as fh:
        json.dump(report, fh, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(markdown(report))
    best = min(results, key=lambda r: r["perplexity"]) if results else None
    print(f"continuation: full cache perplexity {full['perplexity']:.2f} over {args.continuation_tokens} tokens after "
          f"{P}; {len(results)} runs" + (f", best {best['label']} at {best['fraction_label']}: "
                                         f"{best['perplexity']:.2f}" if best else "") + f" -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
