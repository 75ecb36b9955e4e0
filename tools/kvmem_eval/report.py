#!/usr/bin/env python3
"""Fill the generated blocks of docs/fidelity.md from kvmem-eval JSON reports.

  report.py --doc docs/fidelity.md --embedded e.json --layers l0.json ... [--sweep s1.json ...] \
            [--inputs layer0.safetensors ...] [--bf16 e.json:e-bf16.json l0.json:l0-bf16.json ...] \
            [--bf16-floor e-floor.json ...] [--command "scripts/fidelity"]

The document keeps its prose; every block between
  <!-- generated:NAME -->  and  <!-- /generated:NAME -->
is replaced (NAME: setup, embedded-table, embedded-buckets, layers-table, layers-cosine, sweep-table,
inputs-table, bf16-table, headline). A block missing from the document is an error (exit 2), so the prose and the
generator cannot drift apart silently. Needs python3 (+ NumPy for --inputs).
"""
import argparse
import json
import os
import re
import struct
import sys


def fail(msg):
    sys.exit(f"report.py: error: {msg}")


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        fail(f"{path}: not a kvmem-eval report ({e})")


def mib(b):
    return f"{b / 1048576:.3f}"


def pct(x):
    return f"{100 * x:.1f}%"


def fractions(rep):
    out = []
    for x in rep["results"]:
        if x["fraction"] is not None and x["fraction_label"] not in out:
            out.append(x["fraction_label"])
    return out


def result(rep, memory, label):
    for x in rep["results"]:
        if x["memory"] == memory and x["fraction_label"] == label:
            return x
    return None


def main_table(rep):
    lines = ["| memory | budget | parameters | state rows (Trellis: slots; eviction: sinks + kept) | window tokens "
             "| held MiB | of full cache "
             "| rel. L2 error | mean cosine | min cosine | prefill s |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for x in rep["results"]:
        lines.append(f'| {x["label"]} | {x["fraction_label"]} | {x["summary"]} | {max(x["state_rows"])} | '
                     f'{max(x["window_tokens"])} | {mib(x["peak_bytes"])} | {pct(x["held_fraction"])} | '
                     f'{x["rel_l2"]:.4f} | {x["cosine_mean"]:.4f} | {x["cosine_min"]:.3f} | {x["seconds"]:.2f} |')
    ex = rep["exact"]["seconds"]
    lines.append("")
    lines.append(f'Exact causal attention over the full cache ({mib(rep["full_kv_bytes"])} MiB): {ex:.2f} s. '
                 f'Backend {rep["backend"]["name"]} with {rep["backend"]["concurrency"]} threads on a shared '
                 f'machine: wall times are indicative only.')
    return "\n".join(lines)


def bucket_table(rep):
    head = "| memory | budget | " + " | ".join(f"{b}-{e - 1}" for b, e in rep["buckets"]) + " |"
    lines = [head, "|---|---|" + "---:|" * len(rep["buckets"])]
    for x in rep["results"]:
        lines.append(f'| {x["label"]} | {x["fraction_label"]} | ' +
                     " | ".join(f"{v:.3f}" for v in x["bucket_rel_l2"]) + " |")
    return "\n".join(lines)


def layers_table(layers, key, fmt):
    """One row per memory and budget, one column per layer, and the mean over the layers."""
    fr = fractions(layers[0])
    rows = []
    for m in layers[0]["memories"]:
        if m["own_size"]:
            x = result(layers[0], m["id"], "own")
            rows.append((m["id"], "own", m["label"], f'own ({pct(x["held_fraction"]) if x else "?"})'))
        else:
            rows += [(m["id"], f, m["label"], f) for f in fr]
    names = [rep["label"] or rep["input"] for rep in layers]
    lines = ["| memory | budget | " + " | ".join(names) + " | **mean** |", "|---|---|" + "---:|" * (len(names) + 1)]
    for mid, f, label, budget in rows:
        vals = [result(rep, mid, f)[key] if result(rep, mid, f) else None for rep in layers]
        got = [v for v in vals if v is not None]
        mean = f"**{fmt(sum(got) / len(got))}**" if got else ""
        lines.append(f"| {label} | {budget} | " + " | ".join(fmt(v) if v is not None else "" for v in vals) +
                     f" | {mean} |")
    return "\n".join(lines)


def storage_table(pairs, floors):
    """The error bf16 storage adds: for every memory and budget of the float32 reports, the relative L2 error
    in float32 and in bf16 (mean over the reports) and their difference, with its range over the reports.
    `pairs` [(float32 report, bf16 report)] of the same inputs; `floors` bf16 reports at fraction 1 with a
    window holding every token (what rounding the tokens and the output to bf16 costs alone)."""
    f32s = [a for a, _ in pairs]
    fr = fractions(f32s[0])
    rows = []
    for m in f32s[0]["memories"]:
        rows += [(m["id"], "own", m["label"])] if m["own_size"] else [(m["id"], f, m["label"]) for f in fr]
    lines = ["| memory | budget | rel. L2, float32 | rel. L2, bf16 | added by bf16 (mean) | added, min .. max |",
             "|---|---|---:|---:|---:|---:|"]
    for mid, f, label in rows:
        got = [(result(a, mid, f), result(b, mid, f)) for a, b in pairs]
        got = [(x["rel_l2"], y["rel_l2"]) for x, y in got if x and y]
        if not got:
            continue
        n = len(got)
        d = [y - x for x, y in got]
        lines.append(f"| {label} | {f} | {sum(x for x, _ in got) / n:.4f} | {sum(y for _, y in got) / n:.4f} | "
                     f"{sum(d) / n:+.4f} | {min(d):+.4f} .. {max(d):+.4f} |")
    if floors:
        v = [x["rel_l2"] for rep in floors for x in rep["results"]]
        lines.append("")
        lines.append(f"Floor: KVM fixed with its window holding every token (exact attention over the tokens rounded "
                     f"to bf16, output rounded to bf16): relative L2 error {min(v):.4f} .. {max(v):.4f} over "
                     f"{len(v)} inputs.")
    return "\n".join(lines)


def sweep_table(sweeps):
    fr = fractions(sweeps[0])
    lines = ["| window share s | " + " | ".join(f"KVM fixed {f}: rel. L2 (chunk, rows)" for f in fr) + " |",
             "|---|" + "---:|" * len(fr)]
    for rep in sweeps:
        cells = []
        for f in fr:
            x = result(rep, "kvm-fixed", f)
            c = x["params"]["config"]
            cells.append(f'{x["rel_l2"]:.4f} ({c["chunk"]}, {max(x["state_rows"])})')
        lines.append(f'| {rep["sizing"]["window_share"]:g} | ' + " | ".join(cells) + " |")
    return "\n".join(lines)


def read_qk(path):
    """q and k of a kvmem-run input file (float32 only), without other dependencies than NumPy."""
    import numpy as np
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name in ("q", "k"):
        h = header[name]
        if h["dtype"] != "F32":
            fail(f"{path}: tensor {name} is {h['dtype']}, expected F32")
        b, e = h["data_offsets"]
        out[name] = np.frombuffer(data[b:e], dtype="<f4").reshape(h["shape"]).astype(np.float64)
    return out, header.get("__metadata__", {})


def inputs_table(paths, labels):
    import numpy as np
    lines = ["| input | kv-heads | mean ‖q‖ | mean ‖k‖ | ‖LN(k)‖ | mean cos(k, LN(k)) |",
             "|---|---:|---:|---:|---:|---:|"]
    for path, label in zip(paths, labels):
        t, _ = read_qk(path)
        k, q = t["k"], t["q"]
        kn = np.linalg.norm(k, axis=-1)
        ln = (k - k.mean(-1, keepdims=True)) / np.sqrt(k.var(-1, keepdims=True) + 1e-5)
        lnn = np.linalg.norm(ln, axis=-1)
        cos = ((k * ln).sum(-1) / (kn * lnn)).mean()
        lines.append(f"| {label} | {k.shape[1]} | {np.linalg.norm(q, axis=-1).mean():.2f} | {kn.mean():.2f} | "
                     f"{lnn.mean():.2f} | {cos:.3f} |")
    return "\n".join(lines)


def headline(emb, layers):
    def avg(mid, f, key):
        vals = [result(r, mid, f)[key] for r in layers if result(r, mid, f)]
        return sum(vals) / len(vals) if vals else float("nan")

    def err(v):  # three decimals, or three digits for errors of 10 and more (untrained Trellis)
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.0f}"

    def cell(mid, f):
        x = result(emb, mid, f)
        return (f'{err(x["rel_l2"])} / {err(avg(mid, f, "rel_l2"))} '
                f'(cosine {x["cosine_mean"]:.2f} / {avg(mid, f, "cosine_mean"):.2f})')
    fr = fractions(emb)
    out = []
    for m in emb["memories"]:
        if m["own_size"]:
            x = result(emb, m["id"], "own")
            out.append(f'- {m["label"]} at its own size ({pct(x["held_fraction"])} of the cache): relative L2 '
                       f'error on the embedded layer / averaged over the {len(layers)} layers {cell(m["id"], "own")}.')
            continue
        cells = ", ".join(f'{f}: {cell(m["id"], f)}' for f in fr)
        out.append(f'- {m["label"]}, relative L2 error on the embedded layer / averaged over the {len(layers)} '
                   f'layers, by budget: {cells}.')
    return "\n".join(out)


def setup_block(emb, layers, command):
    sh, s = emb["shape"], emb["sizing"]
    lsh = layers[0]["shape"] if layers else sh
    return (f"Regenerate with `{command}`. Embedded layer: T = {sh['T']} tokens, {sh['Hq']} heads, "
            f"D = {sh['D']}. Captured layers: {lsh['B']} sequence(s) of T = {lsh['T']} tokens, {lsh['Hq']} query heads and "
            f"{lsh['Hkv']} kv-heads each. Sizing: window "
            f"share s = {s['window_share']:g}, {s['window_chunks']} window chunk(s), {s['sinks']} sink row(s), "
            f"rope_dims = {s['rope_dims']}; {len(emb['buckets'])} position buckets.")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--doc", required=True)
    ap.add_argument("--embedded", required=True)
    ap.add_argument("--layers", nargs="+", required=True)
    ap.add_argument("--sweep", nargs="*", default=[])
    ap.add_argument("--inputs", nargs="*", default=[], help="input files for the key/query norm table")
    ap.add_argument("--input-labels", nargs="*", default=[])
    ap.add_argument("--command", default="scripts/fidelity")
    ap.add_argument("--bf16", nargs="*", default=[], metavar="F32_JSON:BF16_JSON",
                    help="pairs of reports of one input: float32, and bf16 (kvmem-eval --dtype bf16)")
    ap.add_argument("--bf16-floor", nargs="*", default=[],
                    help="bf16 reports at --fractions 1 --window-share 1 --memories kvm-fixed")
    a = ap.parse_args()
    emb = load(a.embedded)
    layers = [load(p) for p in a.layers]
    blocks = {
        "setup": setup_block(emb, layers, a.command),
        "headline": headline(emb, layers),
        "embedded-table": main_table(emb),
        "embedded-buckets": bucket_table(emb),
        "layers-table": layers_table(layers, "rel_l2", lambda v: f"{v:.3f}"),
        "layers-cosine": layers_table(layers, "cosine_mean", lambda v: f"{v:.3f}"),
    }
    if a.sweep:
        blocks["sweep-table"] = sweep_table([load(p) for p in a.sweep])
    if a.bf16:
        pairs = []
        for pair in a.bf16:
            if pair.count(":") != 1:
                fail(f"--bf16 = {pair}: give F32_JSON:BF16_JSON")
            f32, bf16 = (load(p) for p in pair.split(":"))
            same = os.path.basename(f32["input"]) == os.path.basename(bf16["input"]) and f32["shape"] == bf16["shape"]
            if not same or bf16.get("dtype") != "bf16":
                fail(f"--bf16 = {pair}: not a float32 and a bf16 report of one input")
            pairs.append((f32, bf16))
        blocks["bf16-table"] = storage_table(pairs, [load(p) for p in a.bf16_floor])
    if a.inputs:
        labels = a.input_labels or [os.path.basename(p) for p in a.inputs]
        blocks["inputs-table"] = inputs_table(a.inputs, labels)
    fill(a.doc, blocks)


def fill(path, blocks):
    """Replaces each block <!-- generated:NAME --> ... <!-- /generated:NAME --> of the document at `path` by
    blocks[NAME]; a block missing from the document is an error (exit 2)."""
    try:
        with open(path) as f:
            doc = f.read()
    except OSError as e:
        fail(f"--doc {path}: {e}")
    for name, body in blocks.items():
        pat = re.compile(rf"(<!-- generated:{re.escape(name)} -->\n).*?(<!-- /generated:{re.escape(name)} -->)", re.S)
        if not pat.search(doc):
            fail(f"{path}: no block <!-- generated:{name} --> ... <!-- /generated:{name} -->")
        doc = pat.sub(lambda m: m.group(1) + body + "\n" + m.group(2), doc)
    with open(path, "w") as f:
        f.write(doc)
    print(f"report: filled {len(blocks)} blocks of {path}")


if __name__ == "__main__":
    main()
