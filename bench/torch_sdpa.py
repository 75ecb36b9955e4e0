#!/usr/bin/env python3
"""PyTorch's scaled_dot_product_attention on the benchmarks' shapes: the peer that kvmem's numbers are read
against (scripts/gpu-check on a GPU; on a CPU with --device cpu).

Times, in one process:
  - causal prefill over T tokens: q [B, Hq, T, D], k/v [B, Hkv, T, D] (GQA through enable_gqa);
  - a decode step at position `pos`: one query per sequence against a full KV cache of pos + 1 tokens;
  - the device's copy bandwidth (a tensor copy of 1 GiB, bytes read + bytes written), the ceiling of decode.
Each case runs in float32 (kvmem's dtype today; on CUDA PyTorch picks its memory-efficient kernel) and,
on CUDA, in bfloat16 (the flash kernel). Times are the median of --repeats timed runs after two warm-ups,
taken with CUDA events on a GPU. Writes JSON: {"context": {...}, "results": [{"op", "dtype", "T" or
"pos", "B", "Hq", "Hkv", "D", "seconds", "backend"}...], "copy_bytes_per_s": ...}.

    python3 bench/torch_sdpa.py --out sdpa.json [--device cuda] [--grid gpu|quick]
"""
import argparse
import json
import statistics
import sys
import time

GRIDS = {
    # scripts/gpu-check: B = 8, Hq = 32, Hkv = 8, D = 128 (kvmem_bench_* --grid=gpu)
    "gpu": {"shape": (8, 32, 8, 128), "prefill": [4096, 16384, 65536, 131072],
            "decode": [4096, 16384, 65536, 131072, 262144]},
    # a smoke test that runs anywhere in seconds
    "quick": {"shape": (1, 4, 2, 64), "prefill": [256, 1024], "decode": [1024]},
}


def timer(torch, device):
    """A function that runs fn() `repeats` times after two warm-ups and returns the median seconds."""
    def run(fn, repeats):
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
        return statistics.median(times)
    return run


def backend_name(torch, q, k, v, causal):
    """Which SDPA kernel PyTorch would pick for these inputs (best effort; 'unknown' if it cannot say)."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        for name, b in (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                        ("cudnn", SDPBackend.CUDNN_ATTENTION), ("math", SDPBackend.MATH)):
            try:
                with sdpa_kernel([b]):
                    torch.nn.functional.scaled_dot_product_attention(q[..., :8, :], k[..., :8, :], v[..., :8, :],
                                                                     is_causal=causal, enable_gqa=True)
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
    ap.add_argument("--repeats", type=int, default=5)
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
    grid = GRIDS[a.grid]
    B, Hq, Hkv, D = grid["shape"]
    dtypes = [torch.float32] + ([torch.bfloat16] if device == "cuda" else [])
    sdpa = torch.nn.functional.scaled_dot_product_attention
    results = []
    for dtype in dtypes:
        size = torch.tensor([], dtype=dtype).element_size()
        for T in grid["prefill"]:
            if B * (2 * Hq + 2 * Hkv) * T * D * size > a.max_bytes:
                continue
            q = torch.randn(B, Hq, T, D, device=device, dtype=dtype)
            k = torch.randn(B, Hkv, T, D, device=device, dtype=dtype)
            v = torch.randn(B, Hkv, T, D, device=device, dtype=dtype)
            sec = run(lambda: sdpa(q, k, v, is_causal=True, enable_gqa=True), a.repeats)
            results.append({"op": "prefill", "dtype": str(dtype).removeprefix("torch."), "T": T, "B": B, "Hq": Hq,
                            "Hkv": Hkv, "D": D, "seconds": sec, "backend": backend_name(torch, q, k, v, True)})
            del q, k, v
        for pos in grid["decode"]:
            if B * 2 * Hkv * (pos + 1) * D * size > a.max_bytes:
                continue
            q = torch.randn(B, Hq, 1, D, device=device, dtype=dtype)
            k = torch.randn(B, Hkv, pos + 1, D, device=device, dtype=dtype)
            v = torch.randn(B, Hkv, pos + 1, D, device=device, dtype=dtype)
            sec = run(lambda: sdpa(q, k, v, is_causal=False, enable_gqa=True), a.repeats)
            results.append({"op": "decode", "dtype": str(dtype).removeprefix("torch."), "pos": pos, "B": B, "Hq": Hq,
                            "Hkv": Hkv, "D": D, "seconds": sec, "backend": backend_name(torch, q, k, v, False)})
            del q, k, v
        if device == "cuda":
            torch.cuda.empty_cache()
    src = torch.empty(1 << 28, device=device, dtype=torch.float32)  # 1 GiB
    dst = torch.empty_like(src)
    copy_sec = run(lambda: dst.copy_(src), a.repeats)
    context = {"torch": torch.__version__, "device": device, "grid": a.grid, "repeats": a.repeats,
               "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu",
               "threads": torch.get_num_threads()}
    with open(a.out, "w") as f:
        json.dump({"context": context, "results": results, "copy_bytes_per_s": 2 * src.numel() * 4 / copy_sec}, f,
                  indent=1)
    for r in results:
        where = f"T={r['T']}" if r["op"] == "prefill" else f"pos={r['pos']}"
        print(f"sdpa {r['op']:7s} {r['dtype']:8s} {where:12s} {r['seconds'] * 1e3:10.3f} ms  ({r['backend']})")
    print(f"copy bandwidth {2 * src.numel() * 4 / copy_sec / 1e9:.1f} GB/s (read + write)")


if __name__ == "__main__":
    main()
