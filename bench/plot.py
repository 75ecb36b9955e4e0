#!/usr/bin/env python3
"""Plots and tabulates the kvmem benchmarks (bench/README.md).

    python3 bench/plot.py bench/results --png docs/performance.png --summary bench/results/summary.md

Reads prefill.json and decode.json (Google Benchmark JSON written by kvmem_bench_prefill/_decode; dtype.json
of kvmem_bench_dtype when present) and
meta.json (bench/run.sh) from the results directory. Writes a two-panel log-log plot (prefill time
against T, each memory against exact attention; decode step time against position) and a Markdown
summary: every measurement as a table, and the issue's targets with the measured values.
"""
import argparse
import json
import math
import os
import re
import sys

FIELD = re.compile(r"([A-Za-z_]+):(\d+)")


def load(path):
    if not os.path.exists(path):
        return {}, []
    with open(path) as f:
        data = json.load(f)
    runs = []
    for b in data.get("benchmarks", []):
        if b.get("run_type", "iteration") != "iteration" or b.get("error_occurred"):
            continue
        parts = b["name"].split("/")
        r = dict(b)
        r["kind"], r["memory"] = parts[0], parts[1]
        for k, v in FIELD.findall(b["name"]):
            if k not in ("iterations", "real_time"):
                r[k] = int(v)
        scale = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}[b.get("time_unit", "ns")]
        gb_sec = b["real_time"] * scale  # Google Benchmark's mean over all iterations
        # The programs report the fastest iteration (prefill) or step window (decode); rates follow it.
        r["sec"] = b["seconds"] if "seconds" in b else b["step_us"] * 1e-6 if "step_us" in b else gb_sec
        for k in ("GFLOP/s", "tokens/s"):
            if k in b:
                r[k] = b[k] * gb_sec / r["sec"]
        runs.append(r)
    return data.get("context", {}), runs


def load_torch(path, pre, dec):
    """PyTorch SDPA's times from bench/torch_sdpa.py --shapes-from (same run, same shapes and threads): sets
    torch_sec and vs_torch (PyTorch's time / kvmem's: > 1 means kvmem is faster) on each kvmem run of a
    shape it measured. Returns the context, or {} when there is no such file."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        data = json.load(f)
    times = {}
    for t in data.get("results", []):
        if t.get("dtype") == "float32":
            times[(t["op"], t.get("T", t.get("pos")), t["D"], t["G"], t["B"], t["Hkv"], t["threads"])] = t["seconds"]
    for op, runs in (("prefill", pre), ("decode", dec)):
        for r in runs:
            sec = times.get((op, r.get("T", r.get("pos")), r["D"], r["G"], r["B"], r["Hkv"], r["threads"]))
            if sec is not None:
                r["torch_sec"], r["vs_torch"] = sec, sec / r["sec"]
    return dict(data.get("context", {}), copy_bytes_per_s=data.get("copy_bytes_per_s"))


def against_torch(runs, axis, label):
    """One row per shape that PyTorch measured: PyTorch's time, then each memory's time and speedup over it."""
    runs = [r for r in runs if "torch_sec" in r]
    if not runs:
        return []
    keys = ("D", "G", "B", "Hkv", "threads")
    shapes = sorted({(r[axis],) + tuple(r[k] for k in keys) for r in runs}, key=lambda k: (k[1:], k[0]))
    mems = memory_order(runs)
    out = [f"| {label} | D | G | B | Hkv | threads | PyTorch SDPA | " + " | ".join(mems) + " |",
           "|" + "---|" * (7 + len(mems))]
    for shp in shapes:
        cond = dict(zip((axis,) + keys, shp))
        rs = pick(runs, **cond)
        cells = []
        for m in mems:
            r = one(rs, memory=m)
            cells.append(f"{fmt_time(r['sec'])} ({r['vs_torch']:.2f}x)" if r else "-")
        out.append(f"| {size(shp[0])} | " + " | ".join(str(x) for x in shp[1:]) + f" | {fmt_time(rs[0]['torch_sec'])} | "
                   + " | ".join(cells) + " |")
    return out


def pick(runs, **kw):
    return [r for r in runs if all(r.get(k) == v for k, v in kw.items())]


def one(runs, **kw):
    found = pick(runs, **kw)
    return found[0] if found else None


def fmt_time(sec):
    if sec >= 1:
        return f"{sec:.2f} s"
    if sec >= 1e-3:
        return f"{sec * 1e3:.1f} ms"
    return f"{sec * 1e6:.0f} us"


def fmt_bytes(b):
    for unit, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= s:
            return f"{b / s:.1f} {unit}"
    return f"{b:.0f} B"


def fmt(x, digits=2):
    if x is None:
        return "-"
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return "-"
    return f"{x:.{digits}f}"


def size(n):
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def prefill_rows(runs):
    out = ["| memory | T | D | G | B | Hkv | threads | time | tokens/s | GFLOP/s | of sgemm | readout GFLOP/s |"
           " readout of sgemm | readout share | held | of KV cache | speedup vs exact |",
           "|" + "---|" * 17]
    for r in runs:
        out.append(
            f"| {r['memory']} | {size(r['T'])} | {r['D']} | {r['G']} | {r['B']} | {r['Hkv']} | {r['threads']} | "
            f"{fmt_time(r['sec'])} | {r['tokens/s']:.0f} | {fmt(r['GFLOP/s'])} | {fmt(100 * r['frac_sgemm'], 1)}% | "
            f"{fmt(r.get('readout_GFLOP/s'))} | "
            f"{fmt(100 * r['readout_frac_sgemm'], 1) + '%' if 'readout_frac_sgemm' in r else '-'} | "
            f"{fmt(r.get('readout_share'))} | {fmt_bytes(r['bytes_held'])} | {fmt(100 * r['held_vs_kv_cache'], 1)}% | "
            f"{fmt(r.get('speedup_vs_exact'))} |")
    return out


def decode_rows(runs):
    out = ["| memory | position | D | G | B | Hkv | threads | step | mean step | tokens/s | GFLOP/s | bytes read/step |"
           " GB/s | of copy BW | readout share | held | of KV cache | speedup vs exact | vs first position |",
           "|" + "---|" * 19]
    for r in runs:
        out.append(
            f"| {r['memory']} | {size(r['pos'])} | {r['D']} | {r['G']} | {r['B']} | {r['Hkv']} | {r['threads']} | "
            f"{fmt_time(r['sec'])} | {fmt_time(r['mean_step_us'] * 1e-6) if 'mean_step_us' in r else '-'} | "
            f"{r['tokens/s']:.0f} | {fmt(r['GFLOP/s'])} | {fmt_bytes(r['bytes_read'])} | "
            f"{fmt(r['GB/s'])} | {fmt(100 * r['frac_copy_bw'], 1)}% | {fmt(r.get('readout_share'))} | "
            f"{fmt_bytes(r['bytes_held'])} | {fmt(100 * r['held_vs_kv_cache'], 2)}% | {fmt(r.get('speedup_vs_exact'))} | "
            f"{fmt(r.get('vs_first_pos'), 3) if 'vs_first_pos' in r else '-'} |")
    return out


def memory_order(runs):
    """Memories in a stable order: exact attention, then KVM, OVQ, Trellis, eviction, the reference."""
    rank = {"exact": 0, "kvm": 1, "ovq": 2, "trellis": 3, "evict": 4, "reference": 5}
    names = {r["memory"] for r in runs}
    return sorted(names, key=lambda m: (rank.get(m.split("-")[0], 9), m))


def side_by_side(runs, axis, label, fmt_cell):
    """One row per memory, one column per value of `axis` (T or pos): every memory at a glance."""
    values = sorted({r[axis] for r in runs})
    out = [f"| memory | " + " | ".join(f"{label} = {size(v)}" for v in values) + " |", "|" + "---|" * (len(values) + 1)]
    for mem in memory_order(runs):
        cells = []
        for v in values:
            r = one(runs, memory=mem, **{axis: v})
            cells.append(fmt_cell(r) if r else "-")
        out.append(f"| {mem} | " + " | ".join(cells) + " |")
    return out


def with_speedup(r):
    s = r.get("speedup_vs_exact")
    return fmt_time(r["sec"]) + (f" ({s:.1f}x)" if s is not None else "")


def torch_targets(pre, dec, all_threads, row):
    """The CPU-speed targets: exact attention at least PyTorch SDPA's speed, the memories' margins over it,
    the readout's share of sgemm, the update's cost against the readout, thread scaling."""
    for op, runs, axis, what in (("prefill", pre, "T", "shape"), ("decode", dec, "pos", "position")):
        ex = [r for r in runs if r["memory"] == "exact" and "vs_torch" in r]
        if ex:
            worst = min(ex, key=lambda r: r["vs_torch"])
            where = f"T = {size(worst['T'])}" if axis == "T" else f"position {size(worst['pos'])}"
            row(f"exact {op} >= 1.0x PyTorch SDPA's speed at every measured {what} ({len(ex)} cases)",
                f"lowest {worst['vs_torch']:.2f}x ({where}, D = {worst['D']}, G = {worst['G']}, B = {worst['B']}, "
                f"Hkv = {worst['Hkv']}, {worst['threads']} threads); {sum(r['vs_torch'] >= 1 for r in ex)} of "
                f"{len(ex)} met", worst["vs_torch"] >= 1)
    for mem, want in (("kvm-fixed256", 10.0), ("kvm-power-law", 3.0)):
        r = one(pre, memory=mem, T=16384, D=128, G=1, B=1, Hkv=1, threads=all_threads)
        if r and "vs_torch" in r:
            row(f"{mem} prefill at T = 16K, D = 128 >= {want:.0f}x faster than PyTorch SDPA over the full cache",
                f"{r['vs_torch']:.1f}x ({fmt_time(r['sec'])} vs {fmt_time(r['torch_sec'])})", r["vs_torch"] >= want)
    rd = [r for r in pre if "readout_frac_sgemm" in r and r["threads"] == all_threads and r["T"] >= 4096
          and r["memory"] in ("exact", "kvm-fixed256", "kvm-power-law", "ovq-plateau256")]
    if rd:
        worst = min(rd, key=lambda r: r["readout_frac_sgemm"])
        best = max(rd, key=lambda r: r["readout_frac_sgemm"])
        row("prefill readout >= 70% of the measured sgemm rate (exact, KVM, OVQ; T >= 4K)",
            f"{100 * worst['readout_frac_sgemm']:.1f}% ({worst['memory']}, T = {size(worst['T'])}, D = {worst['D']}, "
            f"G = {worst['G']}, B = {worst['B']}, Hkv = {worst['Hkv']}) to {100 * best['readout_frac_sgemm']:.1f}% "
            f"({best['memory']}, T = {size(best['T'])}, D = {best['D']})", worst["readout_frac_sgemm"] >= 0.70)
    for r in sorted(pick(pre, T=16384, G=1, B=1, Hkv=1, threads=all_threads), key=lambda r: (r["D"], r["memory"])):
        if r.get("readout_share") and "update_share" in r:
            ratio = r["update_share"] / r["readout_share"]
            row(f"{r['memory']} update <= 30% of its readout at T = 16K (D = {r['D']})",
                f"{100 * ratio:.0f}% (update {fmt_time(r['update_share'] * r['sec'])}, "
                f"readout {fmt_time(r['readout_share'] * r['sec'])})", ratio <= 0.30)
    for mem in ("exact", "kvm-fixed256"):
        for r1 in pick(pre, memory=mem, threads=1, T=8192):
            r2 = one(pre, memory=mem, T=r1["T"], D=r1["D"], G=r1["G"], B=r1["B"], Hkv=r1["Hkv"], threads=all_threads)
            if r2 and all_threads > 1:
                sp = r1["sec"] / r2["sec"]
                row(f"{mem} prefill on {all_threads} threads >= 1.8x one thread (T = 8K, D = {r1['D']}, "
                    f"Hkv = {r1['Hkv']})", f"{sp:.2f}x", sp >= 1.8)


def targets(pre, dec, all_threads):
    lines = ["| target | measured | met |", "|---|---|---|"]

    def row(name, value, ok):
        lines.append(f"| {name} | {value} | {'yes' if ok else 'no'} |")

    torch_targets(pre, dec, all_threads, row)

    for D in (64, 128):
        r = one(pre, memory="kvm-fixed256", T=65536, D=D, G=1, B=1, threads=all_threads)
        if r and "speedup_vs_exact" in r:
            s = r["speedup_vs_exact"]
            row(f"KVM fixed-256 prefill at T = 64K >= 10x faster than exact (D = {D}, Hkv = {r['Hkv']})",
                f"{s:.1f}x", s >= 10)
    for r in pick(dec, memory="kvm-fixed256", pos=262144):
        if "vs_first_pos" in r:
            v = r["vs_first_pos"]
            # Flat in the position: a step at 256K no more than 10 % slower than at 4K (faster is the noise).
            row(f"KVM fixed-256 decode step at 256K at most 10% slower than at 4K (D = {r['D']}, B = {r['B']}, "
                f"Hkv = {r['Hkv']})", f"{100 * (v - 1):+.1f}% ({fmt_time(r['sec'])} vs {fmt_time(r['sec'] / v)})",
                v <= 1.10)
    for r in pick(dec, memory="kvm-fixed256", threads=all_threads):
        if r["pos"] in (4096, 262144) and (r["B"] == 8 or r["pos"] == 262144):
            f = r["frac_copy_bw"]
            row(f"decode step >= 50% of copy bandwidth (KVM fixed-256, position {size(r['pos'])}, D = {r['D']}, "
                f"G = {r['G']}, B = {r['B']})", f"{100 * f:.1f}% ({r['GB/s']:.1f} GB/s)", f >= 0.50)
    return lines


def dtype_rows(path):
    """The storage-type comparison of kvmem_bench_dtype (dtype.json), one row per (phase, memory): the
    float32 time, and per 16-bit type its time, its ratio to float32 and its bytes held against float32's.
    [] when there is no such file."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        data = json.load(f)
    cells = {}
    for b in data.get("benchmarks", []):
        if b.get("run_type", "iteration") != "iteration" or b.get("error_occurred"):
            continue
        _, phase, memory, dtype = b["name"].split("/")[:4]
        where = "position " + str(dict(FIELD.findall(b["name"])).get("pos") or "") if phase == "decode" else \
            "T = " + str(dict(FIELD.findall(b["name"])).get("T"))
        cells.setdefault((phase, memory, where), {})[dtype] = b
    rows = ["| phase | memory | float32 | bfloat16 (time, held vs float32) | float16 (time, held vs float32) |",
            "|---|---|---|---|---|"]
    for (phase, memory, where), by in cells.items():
        def cell(d):
            b = by.get(d)
            if b is None:
                return "-"
            t = fmt_time(b["seconds"])
            return t if d == "F32" else f"{t} ({fmt(b.get('vs_f32', float('nan')))}x, {fmt(b.get('held_vs_f32', float('nan')))}x)"
        rows.append(f"| {phase} ({where}) | {memory} | {cell('F32')} | {cell('BF16')} | {cell('F16')} |")
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("results")
    ap.add_argument("--png", default=None)
    ap.add_argument("--summary", default=None)
    a = ap.parse_args()
    ctx_p, pre = load(os.path.join(a.results, "prefill.json"))
    ctx_d, dec = load(os.path.join(a.results, "decode.json"))
    meta = {}
    if os.path.exists(os.path.join(a.results, "meta.json")):
        with open(os.path.join(a.results, "meta.json")) as f:
            meta = json.load(f)
    ctx = ctx_p or ctx_d
    ctx_t = load_torch(os.path.join(a.results, "sdpa.json"), pre, dec)
    all_threads = int(ctx.get("kokkos_threads", 2))
    rank = {m: i for i, m in enumerate(memory_order(pre + dec))}

    md = ["# kvmem benchmark summary", ""]
    if meta:
        md += [f"- commit `{meta['commit']}`{' (with uncommitted changes)' if meta.get('dirty') else ''}, "
               f"run {meta['started']} .. {meta['finished']}",
               f"- {meta['cpu']}, {meta['cores']} cores, {meta['memory_gib']} GiB, {meta['kernel']}; "
               f"load average before {meta['load_before']}, after {meta['load_after']}"]
    for c, label in ((ctx_p, "prefill"), (ctx_d, "decode")):
        if c:
            md.append(f"- ceilings measured by the {label} run: " + ", ".join(
                f"sgemm {float(c[f'ceiling_sgemm_gflops_threads_{t}']):.1f} GFLOP/s and copy "
                f"{float(c[f'ceiling_copy_gbytes_per_s_threads_{t}']):.1f} GB/s on {t} thread{'s' if t > 1 else ''}"
                for t in sorted({1, all_threads}) if f"ceiling_sgemm_gflops_threads_{t}" in c))
    if ctx_t:
        md.append(f"- PyTorch {ctx_t.get('torch', '?')} `scaled_dot_product_attention` (bench/torch_sdpa.py, float32, "
                  f"same shapes and threads, right after kvmem's runs; decode: the fastest of {ctx_t.get('repeats')} "
                  f"windows of {ctx_t.get('steps')} steps)")
    md.append("")
    if ctx_t:
        md += ["## Against PyTorch SDPA (same run; x: PyTorch's time / kvmem's, above 1 kvmem is faster)", "",
               "Prefill:", ""] + against_torch(pre, "T", "T") + ["", "Decode step:", ""] + \
            against_torch(dec, "pos", "position") + [""]
    if pre:
        scaling = [r for r in pre if r["Hkv"] == 1 and r["threads"] == all_threads and r["memory"] != "reference-fixed256"]
        for D in sorted({r["D"] for r in scaling}):
            md += [f"## Prefill time against T, every memory (D = {D}, G = 1, B = 1, Hkv = 1; x: speedup "
                   "against exact attention in the same run)", ""] + side_by_side(
                pick(scaling, D=D), "T", "T", with_speedup) + [""]
        md += ["## Prefill against T (G = 1, B = 1, Hkv = 1)", ""] + prefill_rows(
            sorted(scaling, key=lambda r: (r["D"], rank[r["memory"]], r["T"]))) + [""]
        grid = [r for r in pre if r["Hkv"] == 8]
        if grid:
            md += ["## Prefill over the issue's shape grid (Hkv = 8)", ""] + prefill_rows(
                sorted(grid, key=lambda r: (r["T"], r["D"], r["G"], r["B"], rank[r["memory"]]))) + [""]
        same = lambda q, r: all(q[k] == r[k] for k in ("memory", "T", "D", "G", "B", "Hkv"))
        thr = [r for r in pre if any(q["threads"] == 1 and same(q, r) for q in pre)]
        if thr:
            md += ["## Prefill on one thread and on all threads", ""] + prefill_rows(
                sorted(thr, key=lambda r: (rank[r["memory"]], r["threads"]))) + [""]
        shown = scaling + grid + thr
        rest = [r for r in pre if r["memory"] != "reference-fixed256" and not any(r is q for q in shown)]
        if rest:
            md += ["## Prefill at other shapes", ""] + prefill_rows(
                sorted(rest, key=lambda r: (r["T"], r["D"], r["G"], r["B"], r["Hkv"], r["threads"], rank[r["memory"]]))) + [""]
        ref = pick(pre, memory="reference-fixed256")
        if ref:
            md += ["## The naive float64 reference (tests/reference/kvm_reference.hpp)", ""]
            for r in ref:
                md.append(f"- T = {size(r['T'])}, D = {r['D']}, Hkv = {r['Hkv']}: {fmt_time(r['sec'])}, "
                          f"{r.get('slowdown_vs_kvmem', float('nan')):.0f}x the time of kvmem's KVM fixed-256 prefill")
            md.append("")
    if dec:
        series = lambda r: r["Hkv"] == 2 and r["B"] == 1 and r["G"] == 1 and r["threads"] == all_threads
        for D in sorted({r["D"] for r in dec if series(r)}):
            md += [f"## Decode step against position, every memory (D = {D}, G = 1, B = 1, Hkv = 2; x: speedup "
                   "against exact attention in the same run)", ""] + side_by_side(
                [r for r in dec if series(r) and r["D"] == D], "pos", "position", with_speedup) + [""]
        md += ["## Decode step against position (G = 1, B = 1, Hkv = 2)", ""] + decode_rows(
            sorted([r for r in dec if series(r)], key=lambda r: (rank[r["memory"]], r["pos"]))) + [""]
        md += ["## Decode over the issue's shape grid (Hkv = 8) and on one thread and all threads (Hkv = 4)", ""] + \
            decode_rows(sorted([r for r in dec if not series(r)],
                               key=lambda r: (r["Hkv"], r["G"], r["B"], r["threads"], rank[r["memory"]]))) + [""]
    dt = dtype_rows(os.path.join(a.results, "dtype.json"))
    if dt:
        md += ["## Storage types (kvmem_bench_dtype: B = 8, Hkv = 8, D = 128, G = 1; 16-bit time / float32 time in "
               "the same run; issue 17's target: bfloat16 decode <= 0.6x where the state streams from memory, "
               "prefill no slower)", ""] + dt + [""]
    md += ["## Targets", ""] + targets(pre, dec, all_threads) + [""]
    text = "\n".join(md)
    if a.summary:
        with open(a.summary, "w") as f:
            f.write(text)
    print(text)

    if a.png:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 6))
        names = memory_order(pre + dec)
        colors = {m: plt.get_cmap("tab20")(i % 20) for i, m in enumerate(names)}
        colors.update({"exact": "black", "kvm-fixed256": "tab:blue", "kvm-power-law": "tab:orange",
                       "kvm-power-law-h2o256": "tab:cyan", "ovq-plateau256": "tab:green", "trellis-m64": "tab:olive",
                       "evict-h2o256": "tab:red", "evict-tova256": "tab:pink", "evict-kvpop256": "tab:purple",
                       "evict-knorm256": "tab:brown", "evict-streaming256": "goldenrod", "reference-fixed256": "tab:gray"})
        markers = {"exact": "o", "kvm": "s", "ovq": "D", "trellis": "P", "evict": "v", "reference": "x"}
        style = lambda m: (colors[m], markers.get(m.split("-")[0], "."))
        for D, ls in ((64, "-"), (128, "--")):
            for mem in names:
                color, marker = style(mem)
                rs = sorted(pick(pre, memory=mem, D=D, G=1, B=1, Hkv=1, threads=all_threads), key=lambda r: r["T"])
                if rs:
                    ax1.plot([r["T"] for r in rs], [r["sec"] for r in rs], ls, color=color, marker=marker,
                             label=f"{mem}, D={D}")
        ax1.set_xscale("log", base=2)
        ax1.set_yscale("log")
        ax1.set_xlabel("prompt length T (tokens)")
        ax1.set_ylabel("prefill time (s)")
        ax1.set_title(f"Prefill, B=1, 1 kv-head, G=1, {all_threads} threads")
        ax1.grid(True, which="both", alpha=0.3)
        ax1.legend(fontsize=7, ncol=2)
        dec_D = max([r["D"] for r in pick(dec, G=1, B=1, Hkv=2, threads=all_threads)], default=128)
        for mem in names:
            color, marker = style(mem)
            rs = sorted(pick(dec, memory=mem, D=dec_D, G=1, B=1, Hkv=2, threads=all_threads), key=lambda r: r["pos"])
            if rs:
                ax2.plot([r["pos"] for r in rs], [r["sec"] * 1e3 for r in rs], "-", color=color, marker=marker,
                         label=f"{mem}, D={dec_D}")
        ax2.set_xscale("log", base=2)
        ax2.set_yscale("log")
        ax2.set_xlabel("position (tokens already in the cache)")
        ax2.set_ylabel("decode step time (ms)")
        ax2.set_title(f"Decode step, B=1, 2 kv-heads, G=1, D={dec_D}, {all_threads} threads")
        ax2.grid(True, which="both", alpha=0.3)
        ax2.legend(fontsize=7, ncol=2)
        if meta:
            fig.suptitle(f"kvmem {meta['commit']} on {meta['cpu']} ({meta['cores']} cores), {meta['started'][:10]}",
                         fontsize=9)
        fig.tight_layout()
        fig.savefig(a.png, dpi=110)
        print(f"wrote {a.png}", file=sys.stderr)


if __name__ == "__main__":
    main()
