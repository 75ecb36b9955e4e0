"""Shared plumbing of the kvmem-run round-trip drivers (kvm_roundtrip.py, ovq_roundtrip.py, ...):
run one subcommand in prefill and decode mode on an input file and compare its output to a reference."""
import os
import shlex
import subprocess

import numpy as np

import safetensors_np as stn


def run_modes(runner, subcommand, inp, out, args, expected, compare):
    """Runs `runner subcommand --input inp --output out --mode M args` for M in prefill, decode and
    compares each output with `compare(expected, got) -> (errors, worst)`. Returns (problems, worst).
    `expected` is the reference output, or a function mode -> reference output where the modes differ
    (trellis: prefill is chunkwise, decode the recurrence)."""
    problems, worst = [], 0.0
    for mode in ("prefill", "decode"):
        if os.path.exists(out):
            os.remove(out)
        cmd = shlex.split(runner) + [subcommand, "--input", inp, "--output", out, "--mode", mode] + list(args)
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as ex:
            problems.append(f"{mode}: {ex}")
            continue
        if r.returncode != 0:
            tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or [""]
            problems.append(f"{mode}: exit {r.returncode}: {tail[0][:200]}")
            continue
        try:
            got = stn.load(out)
        except (OSError, ValueError) as ex:
            problems.append(f"{mode}: bad output: {ex}")
            continue
        errs, w = compare(expected(mode) if callable(expected) else expected, got)
        worst = max(worst, w)
        problems += [f"{mode}: {e}" for e in errs]
    return problems, worst


def report(name, desc, problems, worst):
    """Prints the case's PASS/FAIL line; returns whether it passed."""
    ok = not problems
    print(f"{'PASS' if ok else 'FAIL'} {name}: {desc} worst_rel={worst:.2e}"
          + ("" if ok else " | " + "; ".join(problems)), flush=True)
    return ok


def compare_tensors(exp, got, tol, dtypes=None):
    """Checks every tensor of `exp` in `got`: dtype (dtypes.get(name, "F32")) and shape, then integer
    tensors exactly and float ones to max|a-b| <= tol * max(1, max|ref|). Returns (errors, worst)."""
    errs, worst = [], 0.0
    for name, e in exp.items():
        g, want = got.get(name), (dtypes or {}).get(name, "F32")
        if g is None:
            errs.append(f"{name} missing")
        elif g.dtype != stn.DTYPES[want]:
            errs.append(f"{name} dtype {g.dtype}, want {want}")
        elif g.shape != e.shape:
            errs.append(f"{name} shape {list(g.shape)}, want {list(e.shape)}")
        elif want not in ("F32", "F64"):
            if not np.array_equal(g, e):
                bad = int(np.count_nonzero(g != e))
                errs.append(f"{name}: {bad} of {e.size} entries differ")
        elif e.size:
            err = float(np.max(np.abs(g.astype(np.float64) - e)))
            scale = max(1.0, float(np.max(np.abs(e))))
            worst = max(worst, err / scale) if err == err else float("inf")
            if not err <= tol * scale:
                errs.append(f"{name} max|err| {err:.3g} > {tol * scale:.3g}")
    return errs, worst
