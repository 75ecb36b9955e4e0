#!/usr/bin/env python3
"""kvmem-run's answers to bad input: every case must exit with status 2 and an error line that names
the parameter (tensor, flag or file) and its value; never a crash, a hang or a silently wrong answer.
Subcommands kvm and evict (evict: flags, the --weights file of kvpop, --mask; spec EVICTION.md).

Usage: cli_errors.py --runner PATH/TO/kvmem-run [--subcommand kvm|evict]
"""
import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "reference")]
import safetensors_np  # noqa: E402
from eviction_reference import random_kvpop_weights  # noqa: E402


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
    yield "unknown merge", t, ["--merge", "average"], ["--merge", "average"]
    yield "proportional merge with row eviction", t, ["--merge", "proportional", "--evict-rows-above", "6"], \
        ["--evict-rows-above = 6", "--merge kvm only"]
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


EVICT_FLAGS = ["--sinks", "2", "--window", "4", "--top-k", "6", "--scorer", "kvpop"]


def evict_tensors(B=2, Hq=4, Hkv=2, T=40, D=8, Dv=6, seed=0):
    x = good_tensors(B, Hq, Hkv, T, D, Dv, seed)
    return {n: x[n] for n in ("q", "k", "v")}


def evict_weights(Hkv=2, D=8, Dv=6, **changes):
    w = random_kvpop_weights(np.random.default_rng(1), Hkv, D, Dv)
    for k, v in changes.items():
        if v is None:
            del w[k]
        else:
            w[k] = v
    return w


def evict_cases():
    """(name, tensors builder, extra flags, expected substrings, --weights builder or None). The flags
    replace those of EVICT_FLAGS; a weights builder adds --weights FILE."""
    t, wts = evict_tensors, evict_weights
    f = np.float32
    yield "--window 0", t, ["--window", "0"], ["--window", "0"], wts
    yield "--top-k -1", t, ["--top-k", "-1"], ["--top-k", "-1"], wts
    yield "--decay-interval 0", t, ["--decay-interval", "0"], ["--decay-interval", "0"], wts
    yield "snapkv with --sinks 1", t, ["--scorer", "snapkv", "--sinks", "1"], ["--sinks", "1"], None
    yield "kvpop without --weights", t, [], ["--weights"], None
    yield "weights without w_q", t, [], ["w_q", "missing"], lambda: wts(w_q=None)
    yield "weights with misshapen w_s", t, [], ["w_s", "shape"], lambda: wts(w_s=np.zeros((2, 5), f))
    yield "weights with another Hkv", t, [], ["w_k", "shape"], lambda: wts(w_k=np.zeros((3, 14, 4), f))
    yield "weights theta of rank 2", t, [], ["'theta'", "2"], lambda: wts(theta=np.zeros((2, 1), f))
    yield "weights of int32 dtype", t, [], ["b_f", "I32"], lambda: wts(b_f=np.zeros(2, np.int32))
    yield "weights file missing", t, ["--weights", "/tmp/kvmem-no-such-weights.safetensors"], \
        ["kvmem-no-such-weights.safetensors"], None
    yield "odd D with kvpop", lambda: evict_tensors(D=7), [], ["7", "even"], lambda: wts(D=6, Dv=7)
    yield "--mask with h2o", t, ["--scorer", "h2o", "--mask"], ["--mask", "h2o"], None
    yield "--mask with tova", t, ["--scorer", "tova", "--mask"], ["--mask", "tova"], None
    yield "--mask with kvpop --decay-interval 3", t, ["--mask", "--decay-interval", "3"], \
        ["--mask", "--decay-interval"], wts
    yield "--tova-layer-mean with h2o", t, ["--scorer", "h2o", "--tova-layer-mean"], ["--tova-layer-mean"], None
    yield "--merge-evicted with snapkv", t, ["--scorer", "snapkv", "--sinks", "0", "--merge-evicted"], \
        ["--merge-evicted", "snapkv"], None
    yield "--merge-evicted with --mask", t, ["--scorer", "knorm", "--mask", "--merge-evicted"], \
        ["--mask", "--merge-evicted"], None
    yield "--chunk -1", t, ["--chunk", "-1"], ["--chunk = -1", ">= 0"], None
    yield "--observation-window -2", t, ["--chunk", "0", "--observation-window", "-2"], ["--observation-window = -2"], None
    yield "--prompt with --mode decode", t, ["--chunk", "0", "--prompt", "10", "--mode", "decode"], \
        ["--prompt = 10", "--mode prefill"], None
    yield "--prompt with the one-shot snapkv", t, ["--scorer", "snapkv", "--sinks", "0", "--prompt", "10"], \
        ["--prompt = 10", "one-shot snapkv"], None
    yield "unknown scorer", t, ["--scorer", "oracle"], ["--scorer", "oracle"], None
    yield "unknown normalizer", t, ["--normalizer", "l2"], ["--normalizer", "l2"], wts
    yield "Hq not a multiple of Hkv", lambda: dict(evict_tensors(), q=evict_tensors()["q"][:, :3]), \
        ["--scorer", "knorm"], ["Hq = 3", "Hkv = 2"], None
    yield "k missing", lambda: {n: a for n, a in evict_tensors().items() if n != "k"}, \
        ["--scorer", "knorm"], ["'k'", "missing"], None
    yield "lengths too long", lambda: dict(evict_tensors(), lengths=np.array([40, 41], np.int64)), \
        ["--scorer", "tova"], ["lengths[1] = 41"], None


def run_case(runner, sub, i, tmp, name, build, flags, expect, weights=None):
    inp = materialize(build, os.path.join(tmp, f"{sub}{i}.safetensors"))
    out = os.path.join(tmp, f"{sub}-out{i}.safetensors")
    argv = [runner, sub, "--input", inp, "--output", out]
    if sub == "kvm":
        argv += GOOD_FLAGS + flags
    else:   # flags replace the good ones; one without a value (--mask) is appended
        good = dict(zip(EVICT_FLAGS[::2], EVICT_FLAGS[1::2]))
        rest, j = [], 0
        while j < len(flags):
            if j + 1 < len(flags) and not flags[j + 1].startswith("--"):
                good[flags[j]] = flags[j + 1]
                j += 2
            else:
                rest.append(flags[j])
                j += 1
        if weights is not None:
            wpath = os.path.join(tmp, f"{sub}-weights{i}.safetensors")
            safetensors_np.save(wpath, weights())
            good.setdefault("--weights", wpath)
        argv += [a for kv in good.items() for a in kv] + rest
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    text = r.stdout + r.stderr
    ok = r.returncode == 2 and all(e in text for e in expect) and not os.path.exists(out)
    first = text.strip().splitlines()[0] if text.strip() else "(no output)"
    print(f"{'PASS' if ok else 'FAIL'} {sub}: {name}: exit {r.returncode}: {first}")
    if not ok:
        print(f"     expected exit 2 and {expect}; command: {' '.join(argv)}\n     full output:\n{text}")
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runner", required=True)
    ap.add_argument("--subcommand", choices=("kvm", "evict"), help="only this subcommand's cases")
    args = ap.parse_args()
    sections = {"kvm": cases, "evict": evict_cases}
    res = []
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        for sub, gen in sections.items():
            if args.subcommand in (None, sub):
                res += [run_case(args.runner, sub, i, tmp, *c) for i, c in enumerate(gen())]
    print(f"{sum(res)} passed, {len(res) - sum(res)} failed")
    return 0 if all(res) else 1


if __name__ == "__main__":
    sys.exit(main())
