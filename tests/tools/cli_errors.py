#!/usr/bin/env python3
"""kvmem-run's answers to bad input: every case must exit with status 2 and an error line that names
the parameter (tensor, flag or file) and its value; never a crash, a hang or a silently wrong answer.

Usage: cli_errors.py --runner PATH/TO/kvmem-run
"""
import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_np  # noqa: E402


def good_tensors(B=2, Hq=4, Hkv=2, T=40, D=8, Dv=6, seed=0):
    rng = np.random.default_rng(seed)
    f = np.float32
    return {
        "q": rng.standard_normal((B, Hq, T, D)).astype(f),
        "k": rng.standard_normal((B, Hkv, T, D)).astype(f),
        "v": rng.standard_normal((B, Hkv, T, Dv)).astype(f),
        "gate": rng.standard_normal((B, Hkv, T)).astype(f),
        "ln_weight": np.ones(D, f), "ln_bias": np.zeros(D, f),
        "tau_state": np.ones(Hq, f), "tau_bswa": np.ones(Hq, f),
    }


GOOD_FLAGS = ["--chunk", "4", "--window-chunks", "2", "--rope-dims", "2", "--sinks", "1"]


def cases():
    """(name, tensors-or-bytes-builder, extra flags, expected substrings)."""
    t = good_tensors

    def edit(**changes):
        def build():
            x = t()
            for k, v in changes.items():
                if v is None:
                    del x[k]
                else:
                    x[k] = v(x) if callable(v) else v
            return x
        return build

    yield "q of rank 3", edit(q=lambda x: x["q"][0]), [], ["tensor 'q' shape", "rank 4"]
    yield "k with another T", edit(k=lambda x: x["k"][:, :, :30]), [], ["tensor 'k' shape", "T (from q)"]
    yield "v with another batch", edit(v=lambda x: x["v"][:1]), [], ["tensor 'v' shape", "B (from q)"]
    yield "Hq not a multiple of Hkv", edit(q=lambda x: x["q"][:, :3], tau_state=np.ones(3, np.float32),
                                           tau_bswa=np.ones(3, np.float32)), [], ["Hq = 3", "Hkv = 2"]
    yield "v heads differ from k", edit(v=lambda x: x["v"][:, :1]), [], ["tensor 'v' shape", "Hkv (from k)"]
    yield "ln_weight size != D", edit(ln_weight=np.ones(7, np.float32)), [], ["tensor 'ln_weight' shape", "D (from q) = 8"]
    yield "tau_state size != Hq", edit(tau_state=np.ones(2, np.float32)), [], ["tensor 'tau_state' shape"]
    yield "gate missing", edit(gate=None), [], ["'gate'", "missing"]
    yield "q missing", edit(q=None), [], ["'q'", "missing"]
    yield "int32 q", edit(q=lambda x: x["q"].astype(np.int32)), [], ["tensor 'q' dtype = I32"]
    yield "lengths too long", edit(lengths=np.array([40, 41], np.int64)), [], ["lengths[1] = 41"]
    yield "lengths negative", edit(lengths=np.array([-1, 3], np.int64)), [], ["lengths[0] = -1"]
    yield "lengths of float dtype", edit(lengths=np.array([3, 4], np.float32)), [], ["tensor 'lengths' dtype = F32"]
    yield "lengths of wrong size", edit(lengths=np.array([3], np.int64)), [], ["tensor 'lengths' shape"]
    yield "chunk 0", t, ["--chunk", "0"], ["--chunk = 0"]
    yield "window-chunks 0", t, ["--window-chunks", "0"], ["--window-chunks = 0"]
    yield "rope-dims > D", t, ["--rope-dims", "9"], ["--rope-dims = 9", "head_dim = 8"]
    yield "sinks >= chunk with merges", t, ["--sinks", "4"], ["--sinks = 4", "must be < chunk (4)"]
    yield "round-down 0", t, ["--round-down", "0"], ["--round-down = 0"]
    yield "negative min-rows", t, ["--budget", "power-law", "--min-rows", "-3"], ["--min-rows = -3"]
    yield "saturation-n 0", t, ["--budget", "saturating", "--saturation-n", "0"], ["--saturation-n = 0"]
    yield "unknown budget", t, ["--budget", "cubic"], ["--budget", "cubic"]
    yield "unknown mode", t, ["--mode", "stream"], ["--mode", "stream"]
    yield "truncated file", lambda: ("truncate", t()), [], ["header length", "truncated or corrupt"]
    yield "header not JSON", lambda: ("bytes", b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all"), [], ["not valid JSON"]
    yield "data cut short", lambda: ("cut", t()), [], ["data_offsets"]
    yield "missing file", lambda: ("missing", None), [], ["cannot be opened"]


def materialize(build, path):
    """Writes the case's input to `path`; returns the path to pass (maybe a nonexistent one)."""
    x = build()
    if isinstance(x, dict):
        safetensors_np.save(path, x)
        return path
    kind, payload = x
    if kind == "missing":
        return path + ".does-not-exist"
    if kind == "bytes":
        with open(path, "wb") as f:
            f.write(payload)
        return path
    safetensors_np.save(path, payload)
    with open(path, "rb") as f:
        data = f.read()
    n = int.from_bytes(data[:8], "little")
    data = data[: 8 + n // 2] if kind == "truncate" else data[:-17]
    with open(path, "wb") as f:
        f.write(data)
    return path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runner", required=True)
    args = ap.parse_args()
    passed = failed = 0
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        for i, (name, build, flags, expect) in enumerate(cases()):
            inp = materialize(build, os.path.join(tmp, f"in{i}.safetensors"))
            out = os.path.join(tmp, f"out{i}.safetensors")
            argv = [args.runner, "kvm", "--input", inp, "--output", out]
            argv += GOOD_FLAGS
            argv += flags
            r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
            text = r.stdout + r.stderr
            ok = r.returncode == 2 and all(e in text for e in expect) and not os.path.exists(out)
            status = "PASS" if ok else "FAIL"
            first = text.strip().splitlines()[0] if text.strip() else "(no output)"
            print(f"{status} {name}: exit {r.returncode}: {first}")
            if not ok:
                print(f"     expected exit 2 and {expect}; full output:\n{text}")
            passed += ok
            failed += not ok
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
