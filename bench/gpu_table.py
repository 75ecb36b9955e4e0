#!/usr/bin/env python3
"""The markdown table of a GPU run (scripts/gpu-check): kvmem's prefill and decode times next to PyTorch's
scaled_dot_product_attention over the full KV cache on the same shapes, with the issue's targets.

    python3 bench/gpu_table.py RESULTS_DIR > RESULTS_DIR/summary.md

RESULTS_DIR holds prefill.json and decode.json (Google Benchmark JSON of kvmem_bench_prefill/_decode
--grid=gpu), dtype.json (kvmem_bench_dtype --grid=gpu: the readout on tensor cores), sdpa.json (bench/torch_sdpa.py), meta.json (scripts/gpu-check) and, from a quick run, the per-kernel
profile (kernels-prefill.log, kernels-decode.log with prefill-blocking.json, decode-blocking.json) and
Nsight Compute's details (ncu-*.log); a missing file leaves its columns or section out.
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


KERNEL_LINE = re.compile(r"^\[kernels\] {3}(.+?)\s+([0-9.]+) ms$")  # a name may hold spaces


def load_kernels(path):
    """{benchmark name: [(kernel, ms per prefill or step)]} from the "[kernels]" lines that the benchmarks
    print with KVMEM_BENCH_KERNELS=1 (scripts/gpu-check's kernels-*.log, launches made synchronous)."""
    if not os.path.exists(path):
        return {}
    runs, current = {}, None
    with open(path, errors="replace") as f:
        for line in f:
            line = line.rstrip("\n")
            m = KERNEL_LINE.match(line)
            if m:  # a kernel's line (ignored before any benchmark's)
                if current is not None:
                    runs[current].append((m.group(1), float(m.group(2))))
            elif line.startswith("[kernels] "):
                current = line[len("[kernels] "):].strip()
                runs[current] = []
    return runs


def kernel_lines(d):
    """The per-kernel profile of a quick run: for each benchmark of kernels-prefill.log and
    kernels-decode.log, its kernels by time (ms per prefill or decode step, each launch synchronous), each
    kernel's share of their sum, and the blocking run's update share of the step."""
    lines = []
    for log, json_name, what in (("kernels-prefill.log", "prefill-blocking.json", "prefill at T = 16K"),
                                 ("kernels-decode.log", "decode-blocking.json", "decode step at position 16K")):
        runs = load_kernels(os.path.join(d, log))
        if not runs:
            continue
        # Google Benchmark's run names end in /iterations:N, /min_time:S, /real_time; the kernel clock's do not.
        rows = {re.sub(r"(/(iterations|min_time|repeats):[^/]*|/real_time)+$", "", b["name"]): b
                for b in load_kvmem(os.path.join(d, json_name)).values()}
        lines += ["", f"## Per kernel: {what} (ms; {log}, every launch synchronous)", "",
                  "| benchmark | kernel | ms | share of kernels | update share of the step |", "|---|---|---|---|---|"]
        for name, kernels in runs.items():
            total = sum(t for _, t in kernels) or 1.0
            share = rows.get(name, {}).get("update_share")
            for i, (kernel, t) in enumerate(sorted(kernels, key=lambda kt: -kt[1])):
                lines.append(f"| {name if i == 0 else ''} | {kernel} | {t:.3f} | {t / total * 100:.0f} % | "
                             f"{'' if i or share is None else f'{share * 100:.0f} %'} |")
    return lines


NCU_METRIC = re.compile(r"^\s{4}(Duration|Grid Size|Block Size|Registers Per Thread|Achieved Occupancy|"
                        r"Memory Throughput|Compute \(SM\) Throughput|Warp Cycles Per Issued Instruction|"
                        r"Avg\. Active Threads Per Warp)\s+(\S+)?\s+([0-9.,]+)$")
NCU_STALL = re.compile(r"each warp of this workload spends ([0-9.]+) cycles being stalled ([^.]*?)(?:\.|$)")


def load_ncu(path):
    """[(kernel, {metric: value}, stall)] from Nsight Compute's details page (scripts/gpu-check's ncu-*.log):
    one entry per profiled launch, the kernel named by the function whose lambda it runs (or the functor's
    name), `stall` the first warp-stall finding of its Warp State Statistics."""
    if not os.path.exists(path):
        return []
    launches, current = [], None
    with open(path, errors="replace") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("  ") and not line.startswith("   ") and "ParallelFor<" in line:
            m = re.search(r"ParallelFor<(?:void )?(?:\w+::)*(\w+)", line)
            current = (m.group(1) if m else line.strip()[:40], {}, None)
            launches.append(current)
        elif current is not None:
            m = NCU_METRIC.match(line)
            if m:
                current[1][m.group(1)] = float(m.group(3).replace(",", ""))
            elif current[2] is None and "cycles being stalled" in line:
                text = " ".join(x.strip() for x in lines[i:i + 2])
                s = NCU_STALL.search(text)
                if s:
                    launches[-1] = current = (current[0], current[1], f"{s.group(1)} cycles {s.group(2).strip()}")
    return launches


def ncu_lines(d):
    """Nsight Compute's view of a quick run's decode steps at 4K (ncu-<memory>.log): for each kvmem kernel
    its last profiled launch (the last decode step's), with duration, grid, occupancy, throughputs and
    the first warp-stall finding."""
    lines = []
    for name in sorted(f for f in os.listdir(d) if f.startswith("ncu-") and f.endswith(".log")):
        last = {}
        for kernel, metrics, stall in load_ncu(os.path.join(d, name)):
            last[kernel] = (metrics, stall)
        if not last:
            continue
        lines += ["", f"## Nsight Compute: {name[4:-4]}, last launch of each kernel ({name}; clocks not fixed)", "",
                  "| kernel | us | grid x block | registers | achieved occupancy | memory % | SM % | "
                  "cycles per issue | active threads per warp | first stall finding |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for kernel, (m, stall) in last.items():
            def g(k, fmt="{:.0f}"):
                return fmt.format(m[k]) if k in m else "-"
            lines.append(f"| {kernel} | {g('Duration', '{:.1f}')} | {g('Grid Size')} x {g('Block Size')} | "
                         f"{g('Registers Per Thread')} | {g('Achieved Occupancy', '{:.1f}')} % | "
                         f"{g('Memory Throughput', '{:.1f}')} | {g('Compute (SM) Throughput', '{:.1f}')} | "
                         f"{g('Warp Cycles Per Issued Instruction', '{:.1f}')} | "
                         f"{g('Avg. Active Threads Per Warp', '{:.1f}')} | {stall or '-'} |")
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
    out += table("## Prefill (ms)", "T", "prefill", pre, sdpa,
                 ("exact", "kvm-fixed256", "kvm-power-law", "ovq-plateau256", "evict-h2o256"))
    out += table("## Decode step (ms)", "position", "decode", dec, sdpa,
                 ("exact", "exact-unsplit", "kvm-fixed256", "kvm-power-law", "kvm-power-law-h2o256", "ovq-plateau256",
                  "evict-h2o256"),
                 ("exact readout / copy bandwidth", lambda at: dec.get(("decode", "exact", at), {}).get("frac_copy_bw")))
    out += dtype_lines(os.path.join(d, "dtype.json"), sdpa)
    out += kernel_lines(d)
    out += ncu_lines(d)
    out += ["", "Targets (issue 14): decode readout >= 60 % of the copy bandwidth at B = 8; kvm-fixed256 prefill at "
            "T = 64K >= 5x faster than flash SDPA over the full cache; kvm-fixed256 decode at position 128K >= 15x "
            "faster than SDPA decode.", ""]
    print("\n".join(out))


if __name__ == "__main__":
    main()
