#!/usr/bin/env python3
"""The markdown table of a GPU run (scripts/gpu-check): kvmem's prefill and decode times next to PyTorch's
scaled_dot_product_attention over the full KV cache on the same shapes, with the issue's targets.

    python3 bench/gpu_table.py RESULTS_DIR > RESULTS_DIR/summary.md

RESULTS_DIR holds prefill.json and decode.json (Google Benchmark JSON of kvmem_bench_prefill/_decode
--grid=gpu), dtype.json (kvmem_bench_dtype --grid=gpu: the readout on tensor cores), sdpa.json (bench/torch_sdpa.py) and meta.json (scripts/gpu-check); a missing file leaves its
columns empty.
"""
import json
import os
import re
import sys

FIELD = re.compile(r"([A-Za-z]+):(\d+)")


def load_kvmem(path):
    """{(op, memory, T or pos): row} from a Google Benchmark JSON file; row has 'sec' and the counters."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        # A benchmark stopped at KVMEM_GPU_STEP_LIMIT leaves its file open: keep the complete entries.
        end = text.rfind("\n    }")
        try:
            data = json.loads(text[:end + 6] + "\n  ]\n}") if end >= 0 else {}
        except json.JSONDecodeError:
            data = {}
        print(f"gpu_table.py: {path} was cut off; {len(data.get('benchmarks', []))} complete results kept",
              file=sys.stderr)
    rows = {}
    for b in data.get("benchmarks", []):
        if b.get("run_type") == "aggregate" or "error_occurred" in b:
            continue
        op, memory = b["name"].split("/")[:2]
        fields = {k: int(v) for k, v in FIELD.findall(b["name"])}
        at = fields.get("T", fields.get("pos"))
        sec = b["seconds"] if "seconds" in b else b["step_us"] * 1e-6 if "step_us" in b else None
        rows[(op, memory, at)] = dict(b, sec=sec)
    return rows


def load_sdpa(path):
    """{(op, dtype, T or pos): seconds} and the copy bandwidth from bench/torch_sdpa.py's JSON."""
    if not os.path.exists(path):
        return {}, None, {}
    with open(path) as f:
        data = json.load(f)
    table = {(r["op"], r["dtype"], r.get("T", r.get("pos"))): r for r in data["results"]}
    return table, data.get("copy_bytes_per_s"), data.get("context", {})


def ms(sec):
    return "-" if sec is None else f"{sec * 1e3:.3f}"


def ratio(a, b):
    return "-" if a is None or b is None or b == 0 else f"{a / b:.3g}x"


def table(title, axis, op, kvmem, sdpa, memories, extra=None):
    """Markdown lines of one table: a row per T or position with SDPA f32/bf16, each kvmem memory's time,
    kvm-fixed256's speedup over SDPA bf16 and, if `extra` = (header, fraction_of(at)) is given, that
    fraction as a percentage."""
    headers = [axis, "SDPA f32", "SDPA bf16"] + [m + (" (kvmem)" if m == "exact" else "") for m in memories]
    headers.append("kvm-fixed256 vs SDPA bf16")
    if extra:
        headers.append(extra[0])
    lines = ["", title, "", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for at in sorted({k[2] for k in kvmem if k[0] == op} | {k[2] for k in sdpa if k[0] == op}):
        f32 = sdpa.get((op, "float32", at), {}).get("seconds")
        bf16 = sdpa.get((op, "bfloat16", at), {}).get("seconds")
        cells = [kvmem.get((op, m, at), {}).get("sec") for m in memories]
        row = [str(at), ms(f32), ms(bf16)] + [ms(c) for c in cells] + [ratio(bf16, cells[memories.index("kvm-fixed256")])]
        if extra:
            frac = extra[1](at)
            row.append("-" if frac is None else f"{frac * 100:.0f} %")
        lines.append("| " + " | ".join(row) + " |")
    return lines


def dtype_lines(path, sdpa):
    """The storage-type rows of kvmem_bench_dtype --grid=gpu (dtype.json): each memory's 16-bit decode step
    and prefill, KVM's readout on tensor cores (kvm-fixed256) against its portable readout
    (kvm-fixed256-portable) in the same process, and SDPA bf16 at the same position / T."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        data = json.load(f)
    rows = {}
    for b in data.get("benchmarks", []):
        if b.get("run_type") == "aggregate" or "error_occurred" in b:
            continue
        parts = b["name"].split("/")  # dtype/<op>/<memory>/<dtype>/...
        fields = {k: int(v) for k, v in FIELD.findall(b["name"])}
        rows[(parts[1], parts[2], parts[3], fields.get("T", fields.get("pos")))] = b["seconds"]
    lines = ["", "## Storage types and the readout on tensor cores (ms; kvmem_bench_dtype --grid=gpu, G = 4)", "",
             "| op | at | dtype | exact | kvm-fixed256 | kvm-fixed256-portable | tensor cores vs portable | SDPA bf16 |",
             "|---|---|---|---|---|---|---|---|"]
    for op, at, dt in sorted({(k[0], k[3], k[2]) for k in rows}):
        cells = [rows.get((op, m, dt, at)) for m in ("exact", "kvm-fixed256", "kvm-fixed256-portable")]
        bf16 = sdpa.get((op, "bfloat16", at), {}).get("seconds")
        lines.append("| " + " | ".join([op, str(at), dt] + [ms(c) for c in cells] + [ratio(cells[2], cells[1]), ms(bf16)]) + " |")
    return lines


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    d = sys.argv[1]
    pre = load_kvmem(os.path.join(d, "prefill.json"))
    dec = load_kvmem(os.path.join(d, "decode.json"))
    sdpa, copy_bw, ctx = load_sdpa(os.path.join(d, "sdpa.json"))
    meta = {}
    if os.path.exists(os.path.join(d, "meta.json")):
        with open(os.path.join(d, "meta.json")) as f:
            meta = json.load(f)
    out = ["# kvmem on a GPU", ""]
    out.append(f"Commit {meta.get('commit', '?')}, {meta.get('device', ctx.get('device_name', '?'))}, "
               f"{meta.get('started', '?')}; PyTorch {ctx.get('torch', '?')}. B = 8, Hq = 32, Hkv = 8, D = 128; "
               "kvmem in float32, SDPA in float32 and bfloat16 (flash) over the full KV cache.")
    if copy_bw:
        out.append(f"Copy bandwidth (PyTorch, read + write): {copy_bw / 1e9:.0f} GB/s.")
    out += table("## Prefill (ms)", "T", "prefill", pre, sdpa, ("exact", "kvm-fixed256", "kvm-power-law", "evict-h2o256"))
    out += table("## Decode step (ms)", "position", "decode", dec, sdpa, ("exact", "exact-unsplit", "kvm-fixed256", "evict-h2o256"),
                 ("exact readout / copy bandwidth", lambda at: dec.get(("decode", "exact", at), {}).get("frac_copy_bw")))
    out += dtype_lines(os.path.join(d, "dtype.json"), sdpa)
    out += ["", "Targets (issue 14): decode readout >= 60 % of the copy bandwidth at B = 8; kvm-fixed256 prefill at "
            "T = 64K >= 5x faster than flash SDPA over the full cache; kvm-fixed256 decode at position 128K >= 15x "
            "faster than SDPA decode.", ""]
    print("\n".join(out))


if __name__ == "__main__":
    main()
