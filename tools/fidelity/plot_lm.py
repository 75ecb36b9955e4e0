#!/usr/bin/env python3
"""The causal-LM figure of docs/fidelity.md: three panels against the memory fraction of the KV cache,
one line per memory (dashed: KVM and OVQ with calibrated scalars):

1. relative L2 error of the attention output, averaged over the captured layers (kvmem-eval reports);
2. perplexity end to end (tools/fidelity/end_to_end.py), the full cache as a horizontal line;
3. the needle's log-probability (the answer's, mean over the needle cases: a continuous view of
   retrieval, which is all-or-nothing per case), the full cache as a horizontal line; the legend gives
   each memory's needle cases found at its largest fraction.

  plot_lm.py --e2e e2e.json --layers l0.json ... --calibrated l0-kvm-calibrated.json ... --output fig.png

Needs matplotlib (Agg). Exit status 2 for unreadable reports.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"kvm-fixed": "#1f77b4", "kvm-sqrt": "#9467bd", "kvm-h2o": "#17becf", "ovq": "#ff7f0e",
          "proportional": "#bcbd22",
          "streaming": "#2ca02c", "knorm": "#8c564b", "h2o": "#d62728", "tova": "#e377c2", "trellis": "#7f7f7f"}
# a merging eviction in its scorer's colour, square markers
COLORS.update({f"{m}-merge": COLORS[m] for m in ("streaming", "knorm", "h2o", "tova")})


def marker(mid: str) -> str:
    """Square markers for the merging evictions, round for the others."""
    return "s" if mid.endswith("-merge") else "o"

SHOWN = tuple(COLORS)


def load(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f"plot_lm.py: error: {path}: {e}")


def needle_logprob(run: dict) -> float:
    """Mean over the needle cases of the log-probability of the answer's tokens."""
    return sum(n["logprob"] for n in run["needle"]) / len(run["needle"])


def needle_found(run: dict) -> int:
    """Needle cases whose answer greedy decoding writes."""
    return sum(n["retrieved"] for n in run["needle"])


def layer_means(reports: list[dict]) -> dict[tuple[str, str], tuple[float, float]]:
    """{(memory id, label): (fraction, mean rel L2 over the reports)} for fraction-sized rows."""
    acc = defaultdict(list)
    for rep in reports:
        for x in rep["results"]:
            if x["fraction"] is not None:
                acc[(x["memory"], x["label"], x["fraction"])].append(x["rel_l2"])
    return {k: sum(v) / len(v) for k, v in acc.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--e2e", required=True)
    ap.add_argument("--layers", nargs="+", required=True)
    ap.add_argument("--calibrated", nargs="*", default=[])
    ap.add_argument("--output", required=True)
    a = ap.parse_args()
    e2e = load(a.e2e)
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    for reports, dashed in ((a.layers, False), (a.calibrated, True)):
        means = layer_means([load(p) for p in reports])
        for mid in SHOWN:
            pts = sorted((f, v) for (m, _, f), v in means.items() if m == mid)
            if pts:
                axes[0].plot([p[0] for p in pts], [min(p[1], 2.0) for p in pts], ("--" if dashed else "-"),
                             marker=marker(mid), color=COLORS[mid], label=f"{mid}{' calibrated' if dashed else ''}")
    axes[0].set_ylabel("relative L2 error of attention output (mean over layers; clipped at 2)")
    axes[0].set_title(f"per layer ({len(a.layers)} layers)")
    n = len(e2e["full"]["needle"])
    for key, ax, full, title in (("perplexity", axes[1], e2e["full"]["perplexity"], "perplexity (log scale)"),
                                 ("needle_logprob", axes[2], needle_logprob(e2e["full"]),
                                  f"needle: mean log-probability of the answer ({n} cases)")):
        for mid in SHOWN:
            for cal in (False, True):
                runs = sorted((r for r in e2e["results"] if r["memory"] == mid and r["calibrated"] == cal
                               and not r.get("distilled")),
                              key=lambda r: r["fraction"])
                if runs:
                    label = f"{mid}{' calibrated' if cal else ''}"
                    if key == "needle_logprob":
                        label += f" (found {needle_found(runs[-1])}/{n} at {runs[-1]['fraction_label']})"
                    ax.plot([r["fraction"] for r in runs],
                            [needle_logprob(r) if key == "needle_logprob" else r[key] for r in runs],
                            "--" if cal else "-", marker=marker(mid), color=COLORS[mid], label=label)
        found = f" (found {needle_found(e2e['full'])}/{n})" if key == "needle_logprob" else ""
        ax.axhline(full, color="black", lw=1, ls=":", label=f"full KV cache{found}")
        ax.set_title(f"end to end: {title}")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("memory held / full KV cache")
        ax.grid(alpha=0.3)
    axes[2].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.suptitle(f"SmolLM2-135M-Instruct: kvmem memories in every layer ({e2e['ppl_tokens']} tokens of perplexity text, "
                 f"needles in {e2e['needle_tokens']} tokens of each haystack)")
    fig.tight_layout()
    fig.savefig(a.output, dpi=110)
    print(f"plot_lm.py: {a.output}")


if __name__ == "__main__":
    main()
