#!/usr/bin/env python3
"""bench/gpu_table.py on the committed results of a quick GPU run (bench/results/gpu-h200/quick-2026-11-29/
call3-after) and on small hand-written logs: the benchmarks' kernel clocks (names holding spaces, the join
with Google Benchmark's run names for the update share) and Nsight Compute's details page (the last launch
of each kernel, its metrics and first stall finding). Exit status 0 when every check holds."""
import contextlib
import io
import os
import sys
import tempfile

here = os.path.dirname(os.path.abspath(__file__))
repo = os.path.dirname(os.path.dirname(here))
sys.path.insert(0, os.path.join(repo, "bench"))
import gpu_table  # noqa: E402

RUN = os.path.join(repo, "bench", "results", "gpu-h200", "quick-2026-11-29", "call3-after")
checks = 0


def check(cond, what):
    global checks
    checks += 1
    if not cond:
        sys.exit(f"test_gpu_table: FAILED: {what}")


# 1. The kernel clocks of the committed run.
runs = gpu_table.load_kernels(os.path.join(RUN, "kernels-prefill.log"))
kvm = dict(runs["prefill/kvm-fixed256/T:16384/D:128/G:4/B:8/Hkv:8/threads:270336"])
check(abs(kvm["kvmem::readout"] - 650.301) < 1e-9 and abs(kvm["kvmem::update"] - 86.607) < 1e-9,
      f"KVM fixed-256's prefill kernels: {kvm}")
power = dict(runs["prefill/kvm-power-law/T:16384/D:128/G:4/B:8/Hkv:8/threads:270336"])
check("Kokkos::View::initialization [kvmem::state_keys] via memset" in power,
      f"a kernel name with spaces is one name: {sorted(power)}")
check(len(runs) == 4, f"4 prefill benchmarks print kernels (exact prints none): {sorted(runs)}")

# 2. Its tables: the update share joined from the JSON (names there end in /real_time), Nsight Compute's rows.
lines = gpu_table.kernel_lines(RUN)
row = next(l for l in lines if l.startswith("| prefill/kvm-fixed256/"))
check(row.endswith("| 12 % |") and "| kvmem::readout | 650.301 | 88 % |" in row, f"the KVM prefill row: {row}")
launches = gpu_table.load_ncu(os.path.join(RUN, "ncu-kvm-fixed256.log"))
readouts = [m for k, m, _ in launches if k == "readout"]
check(len(readouts) > 1, f"several readout launches profiled: {len(readouts)}")
last = readouts[-1]
check(last["Grid Size"] == 64 and last["Block Size"] == 128 and abs(last["Duration"] - 404.0) < 1e-9,
      f"the last readout launch: {last}")
ncu = "\n".join(gpu_table.ncu_lines(RUN))
check("| eviction_tokens | 404.6 | 64 x 128 | 96 | 6.2 % |" in ncu, "the H2O step's row of Nsight Compute")
check("| readout | 404.0 | 64 x 128 | 95 | 6.2 % | 6.2 | 3.3 | 14.4 | 29.1 | 8.2 cycles waiting for a scoreboard"
      in ncu, "the KVM readout's row with its first stall finding")

# 3. Hand-written logs: a kernel line before any benchmark is ignored, a benchmark printed twice keeps its
#    last report, a log without kernel lines gives no section, and summary.md comes out whole.
with tempfile.TemporaryDirectory() as d:
    with open(os.path.join(d, "kernels-decode.log"), "w") as f:
        f.write("[kernels]   kvmem::stray                                  9.000 ms\n"
                "[kernels] decode/x/pos:16384/B:8\n"
                "[kernels]   kvmem::readout                                1.000 ms\n"
                "[kernels] decode/x/pos:16384/B:8\n"
                "[kernels]   kvmem::readout                                0.250 ms\n"
                "[kernels]   Kokkos::View::initialization [a b] via memset      0.000 ms\n")
    with open(os.path.join(d, "kernels-prefill.log"), "w") as f:
        f.write("no kernel clock here\n")
    runs = gpu_table.load_kernels(os.path.join(d, "kernels-decode.log"))
    check(runs == {"decode/x/pos:16384/B:8": [("kvmem::readout", 0.25), ("Kokkos::View::initialization [a b] via memset", 0.0)]},
          f"hand-written kernel log: {runs}")
    lines = gpu_table.kernel_lines(d)
    check(sum(l.startswith("## Per kernel") for l in lines) == 1, f"one section: {lines}")
    out = io.StringIO()
    sys.argv = ["gpu_table.py", d]
    with contextlib.redirect_stdout(out):
        gpu_table.main()
    check("| decode/x/pos:16384/B:8 | kvmem::readout | 0.250 | 100 % |" in out.getvalue(), "summary.md's row")

print(f"test_gpu_table: {checks} checks passed")
