"""Shared plumbing of the kvmem-run round-trip drivers (kvm_roundtrip.py, ovq_roundtrip.py, ...):
run one subcommand in prefill and decode mode on an input file and compare its output to a reference."""
import os
import shlex
import subprocess

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
