#!/usr/bin/env python3
"""Before/after table of two kvmem benchmark runs made in one bench/run.sh call (KVMEM_BENCH_BEFORE): the
programs of an earlier build (before-prefill.json, before-decode.json) and of this one (prefill.json,
decode.json), on the same machine minutes apart.

    python3 bench/compare.py RESULTS_DIR > RESULTS_DIR/before_after.md

One row per benchmark that both runs measured (same name: kind, memory, shape), with both times (the time
plot.py reads: the fastest repetition for prefill, the fastest step window for decode) and after / before
(< 1: faster now); then the benchmarks only one run has. Exits 2 when a file is missing."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plot import load  # noqa: E402  (the same reading of Google Benchmark's JSON as the plots)


def fmt_time(sec):
    return f"{sec * 1e3:.3g} ms" if sec >= 1e-3 else f"{sec * 1e6:.3g} us"


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    d = sys.argv[1]
    lines = ["# Before and after, one run", ""]
    for kind in ("prefill", "decode"):
        before_path, after_path = os.path.join(d, f"before-{kind}.json"), os.path.join(d, f"{kind}.json")
        for p in (before_path, after_path):
            if not os.path.exists(p):
                print(f"compare.py: {p} is missing", file=sys.stderr)
                sys.exit(2)
        before = {r["name"]: r for r in load(before_path)[1]}
        after = {r["name"]: r for r in load(after_path)[1]}
        common = [n for n in after if n in before]
        lines += [f"## {kind}", "", "| benchmark | before | after | after / before |", "|---|---:|---:|---:|"]
        for n in common:
            b, a = before[n]["sec"], after[n]["sec"]
            lines.append(f"| {n.replace('/real_time', '')} | {fmt_time(b)} | {fmt_time(a)} | {a / b:.3f} |")
        if common:
            ratios = sorted(after[n]["sec"] / before[n]["sec"] for n in common)
            lines += ["", f"{len(common)} benchmarks in both runs: after / before from {ratios[0]:.3f} to "
                      f"{ratios[-1]:.3f}, median {ratios[len(ratios) // 2]:.3f}."]
        only = [n for n in after if n not in before] + [n for n in before if n not in after]
        if only:
            lines += ["", "In one run only: " + ", ".join(f"`{n.replace('/real_time', '')}`" for n in only) + "."]
        lines.append("")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
