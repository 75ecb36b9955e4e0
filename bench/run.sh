#!/usr/bin/env bash
# Builds the kvmem benchmarks in the build environment, runs the documented suite and plots it:
#   bench/results/prefill.json, decode.json, dtype.json (Google Benchmark JSON), sdpa.json (PyTorch SDPA on the same
#   shapes and threads, bench/torch_sdpa.py), meta.json (machine, date, commit),
#   bench/results/summary.md (tables and the issue's targets), docs/performance.png (log-log plots).
#
#   bench/run.sh                      # the standard grid (4 minutes on 2 quiet cores, about 12 under load)
#   KVMEM_BENCH_GRID=quick bench/run.sh   # a smoke test (one to two minutes)
#   bench/run.sh --benchmark_filter=kvm-fixed256   # extra arguments go to both programs
#
#   KVMEM_BENCH_BEFORE=/path/to/old/build bench/run.sh   # also runs an earlier build's prefill and decode
#                                                       # programs (before-*.json) and writes before_after.md
#
# KVMEM_BUILD_DIR (default build/) is the build directory; KVMEM_BENCH_MIN_TIME (default 0.2s) is
# Google Benchmark's --benchmark_min_time for prefill (decode runs a fixed number of steps).
# OMP_WAIT_POLICY (default passive: idle OpenMP threads sleep instead of spinning, which keeps the
# barriers of a step from waiting out a time slice on a machine shared with other jobs) and
# KVMEM_BENCH_NICE (default 0; e.g. -10 as root, to take precedence over other jobs) are passed on.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$here")
source "$repo/scripts/lib/env.sh"
grid=${KVMEM_BENCH_GRID:-standard}
min_time=${KVMEM_BENCH_MIN_TIME:-0.2s}
wait_policy=${OMP_WAIT_POLICY:-passive}
niceness=${KVMEM_BENCH_NICE:-0}
out=$repo/bench/results
[ "$grid" = standard ] || out=$repo/bench/results-$grid
mkdir -p "$out"

before=${KVMEM_BENCH_BEFORE:-}
if [ -n "$before" ]; then  # visible inside the build environment at the same path
  before=$(cd "$before" && pwd)
  export KVMEM_ENV_BINDS="$before${KVMEM_ENV_BINDS:+:$KVMEM_ENV_BINDS}"
fi
kvmem_env_ensure
cd "$repo"
if [ ! -f "$KVMEM_BUILD_DIR/build.ninja" ]; then
  kvmem_in_env cmake -S . -B "$KVMEM_BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVMEM_BUILD_BENCH=ON
fi
kvmem_in_env cmake --build "$KVMEM_BUILD_DIR" --parallel "${KVMEM_JOBS:-2}" --target kvmem_bench_prefill kvmem_bench_decode kvmem_bench_dtype

# What the numbers were measured on.
commit=$(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)
dirty=$(git -C "$repo" status --porcelain --untracked-files=no 2>/dev/null | grep -q . && echo true || echo false)
cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1)
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
started=$(date -u +%Y-%m-%dT%H:%M:%SZ)

run() {
  kvmem_in_env env OMP_WAIT_POLICY="$wait_policy" ${KVMEM_BENCH_KERNELS:+KVMEM_BENCH_KERNELS=$KVMEM_BENCH_KERNELS} \
    nice -n "$niceness" "$@"
}
run "$KVMEM_BUILD_DIR/bench/kvmem_bench_prefill" --grid="$grid" --benchmark_min_time="$min_time" \
  --benchmark_out="$out/prefill.json" --benchmark_out_format=json "$@"
run "$KVMEM_BUILD_DIR/bench/kvmem_bench_decode" --grid="$grid" \
  --benchmark_out="$out/decode.json" --benchmark_out_format=json "$@"
# Before/after in one run: an earlier build's programs (KVMEM_BENCH_BEFORE, built with the benchmarks, e.g. from a
# git worktree of the earlier commit) on the same grid and filters, right after this build's.
if [ -n "$before" ]; then
  run "$before/bench/kvmem_bench_prefill" --grid="$grid" --benchmark_min_time="$min_time" \
    --benchmark_out="$out/before-prefill.json" --benchmark_out_format=json "$@"
  run "$before/bench/kvmem_bench_decode" --grid="$grid" \
    --benchmark_out="$out/before-decode.json" --benchmark_out_format=json "$@"
  kvmem_in_env python3 bench/compare.py "$out" >"$out/before_after.md"
fi
# float32 against bfloat16 and float16 storage (B = 8, Hkv = 8, D = 128): its own names, so "$@"'s filters
# are not passed on.
run "$KVMEM_BUILD_DIR/bench/kvmem_bench_dtype" --grid="$grid" \
  --benchmark_out="$out/dtype.json" --benchmark_out_format=json

# The peer: PyTorch's scaled_dot_product_attention on every shape just measured, same threads (the
# environment's python3-torch; bench/torch_sdpa.py).
run python3 bench/torch_sdpa.py --device cpu --shapes-from "$out" --out "$out/sdpa.json"

cat >"$out/meta.json" <<EOF
{"commit": "$commit", "dirty": $dirty, "started": "$started", "finished": "$(date -u +%Y-%m-%dT%H:%M:%SZ)",
 "cpu": "$cpu", "cores": $(nproc), "memory_gib": $(awk '/MemTotal/ {printf "%.0f", $2 / 1048576}' /proc/meminfo),
 "kernel": "$(uname -sr)", "grid": "$grid", "min_time": "$min_time",
 "omp_wait_policy": "$wait_policy", "nice": $niceness,
 "load_before": "$load_before", "load_after": "$(cut -d' ' -f1-3 /proc/loadavg)"}
EOF
plots=$repo/docs
[ "$grid" = standard ] || plots=$out
kvmem_in_env python3 bench/plot.py "$out" --png "$plots/performance.png" --summary "$out/summary.md"
echo "results in $out; plot $plots/performance.png; summary $out/summary.md"
