#!/usr/bin/env python3
"""Plots the loss curves of tools/distill/distill.py reports (--report): stage 1, each layer's relative L2 error
of the attention output on the training texts per Adam step (one thin line per layer, their mean thick),
stage 2, the KL divergence to the full-cache model per step, and, for KVPOP reports, each layer's ranking loss
in a third panel.

  plot_curves.py --output curves.png kvm-fixed-1-8.json [kvm-fixed-1-8-e2e.json ovq-1-8.json ...]

Needs matplotlib (Agg). Exit status 2 for a report that cannot be read.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output", required=True)
    ap.add_argument("reports", nargs="+")
    a = ap.parse_args(argv)
    try:
        reports = [json.load(open(p)) for p in a.reports]
    except (OSError, ValueError) as e:
        print(f"plot: error: {e}", file=sys.stderr)
        return 2
    ranking = any(r["memory_id"] == "kvpop" for r in reports)
    fig, axes = plt.subplots(1, 3 if ranking else 2, figsize=(18 if ranking else 12, 4.5))
    s1, s2 = axes[0], axes[1]
    for i, r in enumerate(reports):
        name, color = f"{r['memory_id']} {r['fraction']}", f"C{i}"
        rank = (r.get("recipe") or {}).get("adapter_rank")
        if rank:  # distill.py --adapter-rank: the memory with q/k adapters (kvmem.adapters)
            name += f" + adapters (rank {rank})"
        kvpop = r["memory_id"] == "kvpop"  # KVPOP's scorers: the ranking loss itself, in its own panel
        ax = axes[2] if kvpop else s1
        curves = [list(c) if kvpop else [math.sqrt(x) for x in c] for c in r["curves"]]
        for c in curves:
            ax.plot(c, color=color, alpha=0.15, linewidth=0.8)
        if curves:
            steps = min(len(c) for c in curves)
            ax.plot([sum(c[t] for c in curves) / len(curves) for t in range(steps)], color=color, linewidth=2.5,
                    label=f"{name}: mean of {len(curves)} layers")
        if r.get("e2e_curve"):
            s2.plot(r["e2e_curve"], color=color, linewidth=2, marker=".", label=f"{name}, from {'stage 1' if r.get('init') else 'neutral'}")
    s1.set(title="stage 1: per layer, relative L2 error of the attention output", xlabel="Adam step",
           ylabel="relative L2 error (training texts)")
    s2.set(title="stage 2: end to end, KL(full cache || memory) per token", xlabel="Adam step", ylabel="KL (nats)")
    if ranking:
        axes[2].set(title="KVPOP's scorers: per layer, ranking loss (kvpop-paper eq. 2)", xlabel="Adam step",
                    ylabel="ranking loss (training text)")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(reports[0].get("model", ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(a.output, dpi=110)
    print(f"plot: {a.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
