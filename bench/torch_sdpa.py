#!/usr/bin/env python3
"""PyTorch's scaled_dot_product_attention on the benchmarks' shapes: the peer that kvmem's numbers are read
against (scripts/gpu-check on a GPU; bench/run.sh on the CPU with --shapes-from).

Times, in one process:
  - causal prefill over T tokens: q [B, Hq, T, D], k/v [B, Hkv, T, D] (GQA through enable_gqa);
  - a decode step at position `pos`: one query per sequence against a full KV cache of pos + 1 tokens
    (the SDPA call alone: appending the token to the cache is not timed, nor is it in kvmem_bench_decode's exact step);
  - the device's copy bandwidth (a tensor copy of 1 GiB, bytes read + bytes written), the ceiling of decode.
Each case runs in float32 (kvmem's dtype today) and, on CUDA, in bfloat16 (the flash kernel, GQA
native). PyTorch has no float32 kernel on CUDA that takes GQA natively (enable_gqa falls back to the math
kernel, whose T x T scores do not fit at 16K), so a float32 prefill on CUDA gets k and v repeated to the
Hq query heads before timing and runs the memory-efficient kernel (backend "efficient, kv repeated"). Inputs are uniform in [-1, 1) as in kvmem's benchmarks. Times
are the fastest of --repeats timed runs after two warm-ups (CUDA events on a GPU), for decode the
fastest of --repeats windows of --steps steps (each window's mean step), as kvmem_bench_decode reports.

With --shapes-from DIR (kvmem's results: DIR/prefill.json, DIR/decode.json), the cases are every shape
those runs measured, each on the same number of threads (torch.set_num_threads) as kvmem's run of it;
otherwise the shapes of --grid. Writes JSON: {"context": {...}, "results": [{"op", "dtype", "T" or
"pos", "B", "Hq", "Hkv", "G", "D", "threads", "seconds", "backend"}...], "copy_bytes_per_s": ...}.

    python3 bench/torch_sdpa.py --out sdpa.json [--device cuda] [--grid gpu|quick]
    python3 bench/torch_sdpa.py --out bench/results/sdpa.json --device cpu --shapes-from bench/results
"""
import argparse
import json
import os
import re
import statistics
import sys
import time

GRIDS = {
    # scripts/gpu-check: B = 8, Hq = 32, Hkv = 8, D = 128 (kvmem_bench_* --grid=gpu)
    # (float32 prefill up to T = 16K, where kvmem's exact attention runs: beyond, the memory-efficient
    # kernel takes tens of seconds per call and only bfloat16 flash is the targets' peer)
    "gpu": {"shape": (8, 32, 8, 128), "prefill": [4096, 16384, 65536, 131072],
            "decode": [4096, 16384, 65536, 131072, 262144], "float32_prefill_max": 16384},
    # a smoke test that runs anywhere in seconds
    "quick": {"shape": (1, 4, 2, 64), "prefill": [256, 1024], "decode": [1024]},
}


def timer(torch, device):
    """A function that runs fn() `repeats` times after two warm-ups and returns the fastest run's seconds."""
    def run(fn, repeats, per_run=1):
        for _ in range(2):
            fn()
        times = []
        for _ in range(repeats):
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return min(times) / per_run
    return run


def shapes_from(results):
    """The (op, T or pos, D, G, B, Hkv, threads) cases kvmem's runs measured, from Google Benchmark names
    such as prefill/exact/T:4096/D:64/G:1/B:1/Hkv:8/threads:2/real_time."""
    field = re.compile(r"([A-Za-z_]+):(\d+)")
    cases = []
    for name in ("prefill", "decode"):
        path = os.path.join(results, f"{name}.json")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            for b in json.load(f).get("benchmarks", []):
                kv = {k: int(v) for k, v in field.findall(b["name"])}
                key = (name, kv.get("T", kv.get("pos")), kv["D"], kv["G"], kv["B"], kv["Hkv"], kv.get("threads", 0))
                if None not in key and key not in cases:
                    cases.append(key)
    if not cases:
        sys.exit(f"torch_sdpa.py: no kvmem benchmark results in {results} (prefill.json, decode.json)")
    return cases


def backend_name(torch, q, k, v, causal, gqa=True):
    """Which SDPA kernel PyTorch would pick for these inputs (best effort; 'unknown' if it cannot say)."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        for name, b in (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                        ("cudnn", SDPBackend.CUDNN_ATTENTION), ("math", SDPBackend.MATH)):
            try:
                with sdpa_kernel([b]):
                    torch.nn.functional.scaled_dot_product_attention(q[..., :8, :], k[..., :8, :], v[..., :8, :],
                                                                     is_causal=causal, enable_gqa=gqa)
                return name
            except RuntimeError:
                continue
    except ImportError:
        pass
    return "unknown"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--grid", default="gpu", choices=sorted(GRIDS))
    ap.add_argument("--shapes-from", default=None, metavar="DIR",
                    help="time the shapes of kvmem's results in DIR (prefill.json, decode.json) instead of --grid")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16, help="decode steps per timed window")
    ap.add_argument("--max-bytes", type=float, default=60e9,
                    help="skip a case whose q/k/v/out tensors would take more bytes than this")
    a = ap.parse_args()
    try:
        import torch
    except ImportError:
        sys.exit("torch_sdpa.py: PyTorch is not installed (python3 -c 'import torch' fails)")
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("torch_sdpa.py: --device cuda, but PyTorch sees no GPU")
    run = timer(torch, device)
    if a.shapes_from:
        cases = shapes_from(a.shapes_from)
    else:
        B, Hq, Hkv, D = GRIDS[a.grid]["shape"]
        cases = [("prefill", T, D, Hq // Hkv, B, Hkv, 0) for T in GRIDS[a.grid]["prefill"]] + \
                [("decode", pos, D, Hq // Hkv, B, Hkv, 0) for pos in GRIDS[a.grid]["decode"]]
    dtypes = [torch.float32] + ([torch.bfloat16] if device == "cuda" else [])
    sdpa = torch.nn.functional.scaled_dot_product_attention
    default_threads = torch.get_num_threads()
    uniform = lambda *shape, dtype: torch.rand(*shape, device=device, dtype=dtype) * 2 - 1
    results = []
    for dtype in dtypes:
        size = torch.tensor([], dtype=dtype).element_size()
        for op, n, D, G, B, Hkv, threads in cases:
            Hq = G * Hkv
            if device == "cpu":
                torch.set_num_threads(threads or default_threads)
            if op == "prefill":
                if dtype == torch.float32 and not a.shapes_from and n > GRIDS[a.grid].get("float32_prefill_max", n):
                    continue
                repeat_kv = device == "cuda" and dtype == torch.float32 and G > 1
                kv_heads = Hq if repeat_kv else Hkv
                if B * (2 * Hq + 2 * kv_heads) * n * D * size > a.max_bytes:
                    continue
                q, k, v = uniform(B, Hq, n, D, dtype=dtype), uniform(B, Hkv, n, D, dtype=dtype), \
                    uniform(B, Hkv, n, D, dtype=dtype)
                if repeat_kv:
                    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
                sec = run(lambda: sdpa(q, k, v, is_causal=True, enable_gqa=not repeat_kv), a.repeats)
                backend = backend_name(torch, q, k, v, True, gqa=not repeat_kv) + (", kv repeated" if repeat_kv else "")
            else:
                if B * 2 * Hkv * (n + 1) * D * size > a.max_bytes:
                    continue
                q = uniform(B, Hq, 1, D, dtype=dtype)
                k, v = uniform(B, Hkv, n + 1, D, dtype=dtype), uniform(B, Hkv, n + 1, D, dtype=dtype)

                def steps():
                    for _ in range(a.steps):
                        sdpa(q, k, v, is_causal=False, enable_gqa=True)
                sec = run(steps, a.repeats, per_run=a.steps)
                backend = backend_name(torch, q, k, v, False)
            results.append({"op": op, "dtype": str(dtype).removeprefix("torch."), ("T" if op == "prefill" else "pos"): n,
                            "B": B, "Hq": Hq, "Hkv": Hkv, "G": G, "D": D,
                            "threads": torch.get_num_threads() if device == "cpu" else 0,
                            "seconds": sec, "backend": backend})
            del q, k, v
        if device == "cuda":
            torch.cuda.empty_cache()
    torch.set_num_threads(default_threads)
    src = torch.empty(1 << 28, device=device, dtype=torch.float32)  # 1 GiB
    dst = torch.empty_like(src)
    copy_sec = run(lambda: dst.copy_(src), a.repeats)
    context = {"torch": torch.__version__, "device": device, "grid": a.grid, "repeats": a.repeats,
               "shapes_from": a.shapes_from, "steps": a.steps,
               "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu",
               "threads": torch.get_num_threads()}
    with open(a.out, "w") as f:
        json.dump({"context": context, "results": results, "copy_bytes_per_s": 2 * src.numel() * 4 / copy_sec}, f,
                  indent=1)
    for r in results:
        where = f"T={r['T']}" if r["op"] == "prefill" else f"pos={r['pos']}"
        print(f"sdpa {r['op']:7s} {r['dtype']:8s} {where:12s} D={r['D']:<4d} G={r['G']} B={r['B']} Hkv={r['Hkv']} "
              f"threads={r['threads']} {r['seconds'] * 1e3:10.3f} ms  ({r['backend']})")
    print(f"copy bandwidth {2 * src.numel() * 4 / copy_sec / 1e9:.1f} GB/s (read + write)")


if __name__ == "__main__":
    main()
