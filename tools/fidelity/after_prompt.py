#!/usr/bin/env python3
"""Needle retrieval decoded after the prompt: every needle case of end_to_end.py read as an engine reads it (the
prompt, through the assistant's turn, in one prefill; then the forced start of the answer and the answer one
token per forward, teacher-forced), through kvmem's memories compressed at the end of the prompt or per chunk,
its streaming memories, and kvpress's presses (kvpress_presses.py), each keeping a fraction of the prompt.

  after_prompt.py --output ap.json --haystack FILE [--haystack2 FILE] [--needle-tokens 512] [--facts 5]
                  [--depths 0.1,0.5,0.9] [--fractions 1/4,1/8] [--memories snapkv-end,...]
                  [--presses kvpress-snapkv,...] [--jobs 2] [--dtype float32] [--markdown table.md]

A case is found when the greedy prediction of every answer token is right (end_to_end.py's rule), with its
log-probability. Memories and presses are sized at each fraction of the case's prompt tokens (the question
and chat template included): a kvmem memory holds lm_memories.held_tokens of them after the prompt, a press
kvpress_presses.kept_tokens; the peak is what either holds while it reads the prompt (the whole prompt for a
memory compressed at the end and for a press; the budget and one chunk for a per-chunk memory; the budget for
a streaming one). The full cache's row is the model's own attention over the whole case in one forward; the
report also gives the largest logit difference between kvpress's prefill-and-decode loop without a press and
that forward (kvpress_presses.full_cache_check), which shows the loop reads the model as transformers does.

Runs go to --jobs worker processes of one thread each (parallel_runs.py). Errors (a text not found or too
short, an unknown memory or press, a fraction too small, kvpress missing or at another version) print one
line naming the problem and exit with status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "capture"))
sys.path.insert(0, HERE)
import continuation  # noqa: E402
import kvpress_presses  # noqa: E402
import lm_memories  # noqa: E402
import parallel_runs  # noqa: E402
from capture import CaptureError  # noqa: E402
from continuation import load, parse_runs  # noqa: E402  (parallel_runs' loader: the model in its dtype, its own attention)
from end_to_end import Progress, needle_cases, parse_depths, pick_facts, score_needle, text_tokens  # noqa: E402

DEFAULT_MEMORIES = ("snapkv-end", "h2o-end", "tova-end", "knorm-end", "streaming-end", "snapkv-end-merge",
                    "h2o-end-merge", "snapkv-chunk", "h2o-chunk", "h2o", "tova", "streaming-merge")


def case_logits(model, tok, case: dict, kind: str, name: str, fraction: float) -> tuple[torch.Tensor, dict]:
    """Logits [T - P + 1, vocab] of positions P - 1 .. T - 1 of the case (P: its prompt tokens), read through
    kvmem memory `name` (kind "kvmem"), kvpress press `name` (kind "kvpress") or the full cache (kind "full",
    one forward), and what was held."""
    ids, P = case["ids"], case["prompt"]
    if kind == "full":
        with torch.no_grad():
            return model(ids).logits[0, P - 1:], {"held_tokens": ids.shape[1], "peak_tokens": ids.shape[1]}
    if kind == "kvpress":
        press = kvpress_presses.make(name, fraction, model, tok)
        held = kvpress_presses.kept_tokens(P, fraction)
        return kvpress_presses.prefill_decode(model, ids, P, press), {"held_tokens": held, "peak_tokens": P}
    import kvmem.transformers as kt

    cache = kt.KvmemCache(model, lm_memories.factory(name, P, fraction))
    logits = continuation.continuation_logits(model, ids, P, cache)
    return logits, {"held_tokens": lm_memories.held_tokens(name, P, fraction),
                    "peak_tokens": lm_memories.peak_tokens(name, P, fraction), "held_bytes": cache.held_bytes()}


def run(model, tok, job: dict) -> dict:
    """One row: every case through job's memory or press at its fraction (parallel_runs' job)."""
    t0 = time.time()
    needles, held, peak = [], [], []
    for case in job["cases"]:
        logits, sizes = case_logits(model, tok, case, job["kind"], job["name"], job["fraction"])
        shifted = {**case, "positions": [p - (case["prompt"] - 1) for p in case["positions"]]}
        needles.append(score_needle(logits, shifted))
        held.append(sizes["held_tokens"])
        peak.append(sizes["peak_tokens"])
    n = len(needles)
    return {"kind": job["kind"], "memory": job["name"], "label": job["label"], "fraction_label": job["fraction_label"],
            "fraction": job["fraction"], "found": sum(x["retrieved"] for x in needles), "cases": n,
            "logprob_mean": sum(x["logprob"] for x in needles) / n, "held_tokens_mean": sum(held) / n,
            "peak_tokens_mean": sum(peak) / n, "needles": needles, "seconds": time.time() - t0}


def markdown(report: dict) -> str:
    """The report as a table: a row per memory or press, per fraction the needles found (of the cases) and
    the mean peak held tokens as a share of the mean prompt."""
    fractions = list(dict.fromkeys(r["fraction_label"] for r in report["results"]))
    rows = list(dict.fromkeys((r["kind"], r["memory"]) for r in report["results"]))
    cell = {(r["kind"], r["memory"], r["fraction_label"]): r for r in report["results"]}
    prompt = report["prompt_tokens_mean"]
    full = report["full"]
    head = "| memory | when it compresses | " + " | ".join(f"{f}: found (peak held)" for f in fractions) + " |"
    lines = [head, "|---|---|" + "---:|" * len(fractions)]
    lines.append("| full KV cache | never | " + " | ".join(f"{full['found']} of {full['cases']} (1)" for _ in fractions) + " |")
    for kind, m in rows:
        cells, label = [], None
        for f in fractions:
            r = cell.get((kind, m, f))
            if r is None:
                cells.append("")
                continue
            label = r["label"]
            cells.append(f"{r['found']} of {r['cases']} ({r['peak_tokens_mean'] / prompt:.2f})")
        first = next(r for r in report["results"] if (r["kind"], r["memory"]) == (kind, m))
        lines.append(f"| {label} | {continuation.when(first)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output", required=True, help="JSON report")
    ap.add_argument("--haystack", required=True, help="text the needles are hidden in")
    ap.add_argument("--haystack2", default=None, help="a second haystack (doubles the needle cases)")
    ap.add_argument("--needle-tokens", type=int, default=512, help="tokens of each haystack")
    ap.add_argument("--depths", default="0.1,0.5,0.9", help="where the needle goes, as shares of the haystack")
    ap.add_argument("--facts", type=int, default=5, help="the first N facts of end_to_end.FACTS")
    ap.add_argument("--fractions", default="1/4,1/8", help="memory sizes as shares of each prompt's tokens")
    ap.add_argument("--memories", default=",".join(DEFAULT_MEMORIES), help="kvmem memories (lm_memories ids; '' none)")
    ap.add_argument("--presses", default=",".join(kvpress_presses.PRESSES), help="kvpress presses ('' none)")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes, one thread each")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--model", default="smollm2", help="smollm2 or a Hugging Face model directory")
    ap.add_argument("--markdown", default=None, help="also write the table (markdown) here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # also here: small forwards run slower on two threads (parallel_runs.py)
    try:
        import kvmem

        fractions, runs = parse_runs(args)
        if args.needle_tokens < 1:
            raise ValueError(f"--needle-tokens {args.needle_tokens}: must be at least 1")
        depths, facts = parse_depths(args.depths), pick_facts(args.facts)
        model, tok = load(args.model, args.dtype)
        haystacks = [text_tokens(p, tok, args.needle_tokens, flag)
                     for p, flag in ((args.haystack, "--haystack"), (args.haystack2, "--haystack2")) if p]
        cases = needle_cases(tok, haystacks, facts, depths)
        for _, f in fractions:  # sizes first: a fraction too small fails before any work
            for c in cases:
                lm_memories.budget_split(c["prompt"], f)
    except (ValueError, FileNotFoundError, CaptureError, kvpress_presses.KvpressError) as e:
        print(f"after_prompt: error: {e}", file=sys.stderr)
        return 2

    jobs = [{**j, "fraction_label": fl, "fraction": f, "cases": cases, "describe": f"{j['name']} at {fl}"}
            for j in runs for fl, f in fractions]
    progress = Progress(len(jobs) + 1)
    progress.step(f"full KV cache ({len(cases)} cases)")
    full = run(model, tok, {"kind": "full", "name": "full", "label": "full KV cache", "fraction_label": "1",
                            "fraction": 1.0, "cases": cases})
    check = (kvpress_presses.full_cache_check(model, cases[0]["ids"], cases[0]["prompt"])
             if any(j["kind"] == "kvpress" for j in runs) else None)
    results = parallel_runs.map_jobs("after_prompt", args.model, args.dtype, jobs, args.jobs, progress.step)
    report = {"tool": "tools/fidelity/after_prompt.py", "model": args.model, "dtype": args.dtype,
              "backend": kvmem.backend(), "versions": kvpress_presses.installed_versions(),
              "haystacks": [args.haystack] + ([args.haystack2] if args.haystack2 else []),
              "needle_tokens": args.needle_tokens, "facts": [f.id for f in facts], "depths": depths,
              "prompt_tokens_mean": sum(c["prompt"] for c in cases) / len(cases),
              "observation_window": lm_memories.OBSERVATION, "chunk_share": lm_memories.CHUNK_SHARE,
              "kvpress_full_cache_max_abs_diff": check, "full": full, "results": results}
    with open(args.output, "w") as fh:
        json.dump(report, fh, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(markdown(report))
    print(f"after_prompt: full cache {full['found']} of {full['cases']}; {len(results)} runs -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
