"""The Python door's cost: kvmem's torch ops against the same C++ memory driven from C++ alone (one
process, same tensors), and a transformers generate() loop with kvmem against transformers' own attention.

    python bench/python_overhead.py [--out bench/results/python.json] [--quick] [--only ops|generate]

The op overhead is best read with one thread (OMP_NUM_THREADS=1 KVMEM_NUM_THREADS=1): with several, the
time between two Python calls lets OpenMP's threads go to sleep, and waking them at the next call adds
tens of microseconds that the C++ loop, calling back to back, does not pay.

1. Op overhead. For KVM (fixed budget, 256 state rows) and H2O eviction (sinks 4, window 256, top-k 256):
   a prefill of T tokens and T decode steps (B = 1, Hq = 8, Hkv = 2, D = 64), each timed as
   (a) ``_kvmem.time_calls`` (C++ calls in a C++ loop, timed in C++: the baseline) and
   (b) ``Memory.prefill`` / ``Memory.decode`` from Python (argument checks, torch.library dispatch,
   nanobind, the same C++ call). Reported: median prefill time of each and their ratio (target < 1.05 at
   T = 4096), median decode step of each and the difference (target < 20 us).
2. generate(). A Llama of SmolLM2-135M's shapes (30 layers, hidden 576, 9 query heads, 3 kv-heads, head_dim
   64; random weights: speed does not depend on them) generates N tokens after a P-token prompt, greedy,
   with transformers' sdpa attention and DynamicCache, and with KvmemCache (KVM and H2O at 1/4 of the
   cache). Reported: tokens/s of the generate() call (prefill included) and the cache's bytes: held (keys and
   values kept) and allocated (peak allocation, scratch included).
Medians of several repeats; JSON with the machine's thread count and torch's version.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

import kvmem
import kvmem.transformers as kt
from kvmem import _kvmem, ops

B, HQ, HKV, D = 1, 8, 2, 64


def memories():
    return {
        "kvm-fixed256": lambda: kvmem.KvmMemory(D, HQ, HKV, batch=B, chunk=256, window_chunks=2, max_rows=256,
                                                budget=kvmem.budget.Fixed(256)),
        "evict-h2o": lambda: kvmem.EvictionMemory(D, HQ, HKV, batch=B, scorer="h2o", sinks=4, window=256, top_k=256),
    }


def op_overhead(T: int, repeats: int, decode_steps: int):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, T, D, generator=g) for h in (HQ, HKV, HKV))
    y = torch.empty(B, HQ, T, D)
    rows = []
    for name, make in memories().items():
        m = make()
        cpp = _kvmem.time_calls(m.handle, ops.describe(q, k, v, y), "prefill", repeats)
        py = []
        for _ in range(repeats):
            m.reset()
            start = time.perf_counter()
            m.prefill(q, k, v, y=y)
            py.append(time.perf_counter() - start)
        qd, kd, vd, yd = q[:, :, :decode_steps], k[:, :, :decode_steps], v[:, :, :decode_steps], y[:, :, :decode_steps]
        cpp_steps = _kvmem.time_calls(m.handle, ops.describe(qd, kd, vd, yd), "decode", 1)
        m.reset()
        py_steps = []
        steps = [tuple(x[:, :, t:t + 1] for x in (qd, kd, vd, yd)) for t in range(decode_steps)]  # an engine's per-step tensors
        for q1, k1, v1, y1 in steps:
            start = time.perf_counter()
            m.decode(q1, k1, v1, y=y1)
            py_steps.append(time.perf_counter() - start)
        p_cpp, p_py = statistics.median(cpp), statistics.median(py)
        d_cpp, d_py = statistics.median(cpp_steps), statistics.median(py_steps)
        rows.append(dict(memory=name, T=T, prefill_cpp_s=p_cpp, prefill_python_s=p_py, prefill_ratio=p_py / p_cpp,
                         decode_steps=decode_steps, decode_cpp_us=d_cpp * 1e6, decode_python_us=d_py * 1e6,
                         decode_overhead_us=(d_py - d_cpp) * 1e6))
        print(f"{name:<14} prefill T={T}: C++ {p_cpp * 1e3:8.2f} ms  Python {p_py * 1e3:8.2f} ms  ratio {p_py / p_cpp:5.3f}   "
              f"decode step: C++ {d_cpp * 1e6:7.1f} us  Python {d_py * 1e6:7.1f} us  overhead {(d_py - d_cpp) * 1e6:6.1f} us",
              flush=True)
    return rows


def generate_loop(prompt: int, new: int, repeats: int):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                                   rope_theta=100000.0, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(1))
    rows_quarter = (prompt + new) // 4
    caches = {
        "transformers sdpa + DynamicCache": lambda: transformers.DynamicCache(config=cfg),
        f"kvmem KVM 1/4 ({rows_quarter} rows)": lambda: kt.KvmemCache(model, kt.kvm(
            chunk=64, window_chunks=2, max_rows=rows_quarter - 128, budget=kvmem.budget.Fixed(rows_quarter - 128))),
        f"kvmem H2O 1/4 ({rows_quarter} rows)": lambda: kt.KvmemCache(model, kt.eviction(
            "h2o", sinks=4, window=rows_quarter // 4, top_k=rows_quarter - 4 - rows_quarter // 4)),
    }
    out = []
    for name, make in caches.items():
        speeds, peak = [], 0
        for _ in range(repeats):
            if name.startswith("transformers"):
                model.set_attn_implementation("sdpa")
            cache = make()
            start = time.perf_counter()
            with torch.no_grad():
                model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=new,
                               min_new_tokens=new, do_sample=False)
            speeds.append(new / (time.perf_counter() - start))
            if isinstance(cache, kt.KvmemCache):
                held, peak = cache.held_bytes(), cache.allocated_bytes()
            else:
                held = peak = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
        out.append(dict(cache=name, prompt=prompt, new_tokens=new, tokens_per_s=statistics.median(speeds),
                        held_cache_bytes=held, peak_cache_bytes=peak))
        print(f"generate {prompt}+{new}: {name:<36} {statistics.median(speeds):7.1f} tok/s  cache held {held / 2**20:7.2f} MiB, "
              f"allocated {peak / 2**20:7.2f} MiB", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "python.json"))
    ap.add_argument("--quick", action="store_true", help="smaller sizes (a smoke test, seconds)")
    ap.add_argument("--only", choices=["ops", "generate"], help="run one of the two parts")
    a = ap.parse_args()
    T, repeats, steps = (512, 3, 64) if a.quick else (4096, 7, 512)
    ops = [] if a.only == "generate" else op_overhead(T, repeats, steps)
    gen = [] if a.only == "ops" else generate_loop(*((512, 8, 1) if a.quick else (1024, 64, 3)))
    meta = dict(backend=kvmem.backend(), torch=torch.__version__, torch_threads=torch.get_num_threads(),
                machine=platform.machine(), cpu_count=os.cpu_count(), date=time.strftime("%Y-%m-%d %H:%M:%S"),
                load_average=os.getloadavg())
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(dict(context=meta, op_overhead=ops, generate=gen), f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
