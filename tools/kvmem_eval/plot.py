#!/usr/bin/env python3
"""Draw kvmem-eval reports: relative L2 error of each memory's attention output against the memory it
holds, as a fraction of the full KV cache (one line per memory; a memory evaluated at its own size is
one marker).

  plot.py --output fig.png report.json                  # one input: error vs fraction + error by position
  plot.py --output fig.png l0.json l1.json ... [--cols 3]  # several inputs (layers): one panel each

A relative L2 error above OFF_SCALE (the output is farther from exact attention than twice its own norm,
e.g. untrained Trellis, whose output scale is not attention's) would flatten every other line: such points
are drawn at the top edge as open triangles with their value written beside them, and such series are left
out of the error-by-position panel (named in its title).

Needs python3 and matplotlib (Agg backend, no display). Exit status 2 for unreadable reports.
"""
import argparse
import json
import math
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FixedLocator, NullLocator  # noqa: E402

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#7f7f7f",
          "#bcbd22", "#000000", "#aec7e8"]
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*", "h", "<", ">", "p"]
OFF_SCALE = 2.0  # relative L2 errors above this are drawn clipped at the top edge


def load(path):
    try:
        with open(path) as f:
            r = json.load(f)
        r["results"], r["memories"]  # noqa: B018 - must exist
        return r
    except (OSError, ValueError, KeyError, TypeError) as e:
        sys.exit(f"plot.py: error: {path}: not a kvmem-eval report ({e})")


def style(reports):
    """One color and marker per memory id, in order of first appearance."""
    ids = []
    for r in reports:
        for m in r["memories"]:
            if m["id"] not in ids:
                ids.append(m["id"])
    return {i: (COLORS[k % len(COLORS)], MARKERS[k % len(MARKERS)]) for k, i in enumerate(ids)}


def fraction_axis(ax, xs):
    lo, hi = min(xs), max(xs)
    ticks = [2.0 ** e for e in range(math.floor(math.log2(lo)), math.ceil(math.log2(hi)) + 1)]
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([f"1/{round(1 / t)}" if t < 1 else f"{t:g}" for t in ticks])
    ax.set_xlim(lo / 1.25, hi * 1.25)


def y_top(reports):
    """Upper y limit shared by the panels: a little above the largest error not above OFF_SCALE."""
    shown = [x["rel_l2"] for r in reports for x in r["results"] if x["rel_l2"] <= OFF_SCALE]
    return 1.08 * max(shown, default=1.0)


def off_scale(r, memory):
    return any(x["rel_l2"] > OFF_SCALE for x in r["results"] if x["memory"] == memory)


def error_panel(ax, r, colors, top, legend=True):
    xs = []
    for m in r["memories"]:
        rows = [x for x in r["results"] if x["memory"] == m["id"]]
        if not rows:
            continue
        rows.sort(key=lambda x: x["held_fraction"])
        x = [v["held_fraction"] for v in rows]
        y = [v["rel_l2"] for v in rows]
        xs += x
        c, mk = colors[m["id"]]
        if any(v > top for v in y):
            clipped = [min(v, 0.97 * top) for v in y]
            ax.plot(x, clipped, linestyle=":", marker="^", markerfacecolor="none", color=c,
                    label=m["label"] + " (off scale)")
            for xi, yi, ci in zip(x, y, clipped):
                if yi > top:
                    ax.annotate(f"{yi:.3g}", (xi, ci), textcoords="offset points", xytext=(0, -11), ha="center",
                                fontsize=7, color=c)
            continue
        if m.get("own_size"):
            ax.plot(x, y, linestyle="none", marker="*", markersize=13, color=c, label=m["label"] + " (own size)")
            for xi, yi in zip(x, y):
                ax.annotate(f"{100 * xi:.0f}%", (xi, yi), textcoords="offset points", xytext=(0, 8), ha="center",
                            fontsize=7, color=c)
        else:
            ax.plot(x, y, marker=mk, color=c, label=m["label"])
    if xs:
        fraction_axis(ax, xs)
    ax.set_ylim(0, top)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_xlabel("memory held / full KV cache")
    ax.set_ylabel("relative L2 error of y")
    if legend:  # below the axes: with a dozen memories a legend inside covers lines
        ax.legend(fontsize=8, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.12))


def bucket_panel(ax, r, colors):
    buckets = r["buckets"]
    mids = [(b + e - 1) / 2 for b, e in buckets]
    styles = ["-", "--", ":", "-."]
    fr = sorted({x["fraction_label"] for x in r["results"] if x["fraction"] is not None},
                key=lambda lab: -next(x["fraction"] for x in r["results"] if x["fraction_label"] == lab))
    left_out = []
    for x in r["results"]:
        if off_scale(r, x["memory"]):
            if x["label"] not in left_out:
                left_out.append(x["label"])
            continue
        c, mk = colors[x["memory"]]
        ls = styles[fr.index(x["fraction_label"]) % len(styles)] if x["fraction"] is not None else "-"
        lw = 1.0 if x["fraction"] is not None else 2.0
        ax.plot(mids, x["bucket_rel_l2"], ls, color=c, lw=lw, marker=mk, markersize=3,
                label=f'{x["label"]} {x["fraction_label"]}')
    ax.set_ylim(bottom=0)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_xlabel("token position (bucket centre)")
    ax.set_ylabel("relative L2 error of y")
    ax.set_title("error by position" + (f" ({', '.join(left_out)}: off scale, not drawn)" if left_out else ""),
                 fontsize=10)
    ax.legend(fontsize=6, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.16))


def title_of(r):
    return r.get("label") or r.get("input", "")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", nargs="+", help="kvmem-eval --json reports")
    ap.add_argument("--output", required=True, help="PNG to write")
    ap.add_argument("--title", default=None)
    ap.add_argument("--cols", type=int, default=3, help="panels per row with several reports")
    a = ap.parse_args()
    reports = [load(p) for p in a.reports]
    colors = style(reports)
    if len(reports) == 1:
        r = reports[0]
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 7))
        error_panel(ax1, r, colors, y_top(reports))
        ax1.set_title("error against memory")
        bucket_panel(ax2, r, colors)
        fig.suptitle(a.title or title_of(r))
    else:
        cols = max(1, min(a.cols, len(reports)))
        rows = math.ceil(len(reports) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.6 * rows), sharex=True, sharey=True, squeeze=False)
        top = y_top(reports)  # shared by every panel
        for k, r in enumerate(reports):
            ax = axes[k // cols][k % cols]
            error_panel(ax, r, colors, top, legend=False)
            ax.set_title(title_of(r), fontsize=10)
            if k % cols:
                ax.set_ylabel("")
            if k // cols != rows - 1:
                ax.set_xlabel("")
        for k in range(len(reports), rows * cols):
            axes[k // cols][k % cols].set_visible(False)
        handles, labels = [], []  # every memory once, whichever panel has it
        for ax in axes.flat:
            for h, lab in zip(*ax.get_legend_handles_labels()):
                if lab not in labels:
                    handles.append(h)
                    labels.append(lab)
        ncol = min(len(labels), 4)
        fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=9, bbox_to_anchor=(0.5, 0.0))
        fig.suptitle(a.title or "")
        fig.tight_layout(rect=(0, 0.035 * math.ceil(len(labels) / ncol) + 0.01, 1, 1))
    if len(reports) == 1:
        fig.tight_layout()
    try:
        fig.savefig(a.output, dpi=110)
    except OSError as e:
        sys.exit(f"plot.py: error: --output {a.output}: {e}")


if __name__ == "__main__":
    main()
