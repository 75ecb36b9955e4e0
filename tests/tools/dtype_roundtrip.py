#!/usr/bin/env python3
"""kvmem-run with bfloat16 and float16 tokens (kvm, ovq, evict, trellis; README.md "kvmem-run").

  python3 dtype_roundtrip.py --runner PATH/TO/kvmem-run

Every case writes small random inputs, rounds the token tensors (q, k, v and gate, alpha, betas,
gammas where the command has them) to BF16 (the high 16 bits of the float32, to nearest even) or F16
(numpy), runs the tool on them in prefill and decode mode and checks:

- y has the input's dtype and the state tensors stay F32;
- y is close to the F32 run of the same, already rounded, inputs (widened exactly to float32), within
  the bound of docs/numerics.md (tolerance below); eviction keeps the same positions, the float32 merge
  sums and Trellis' M1, M2 match the F32 run's to 1e-4 relative;
- a token tensor of another dtype than q's is refused with both dtypes named; `--dtype` converts
  (an F32 input run with --dtype bf16 gives the bits of the BF16 input, an F64 one with --dtype f16
  those of numpy's correctly rounded float16, ties included); an unsupported dtype (I8, U8, I32) is
  named with its tensor.

Every configuration is one whose decisions cannot differ between the two runs: KVM with T <= window +
chunk (no merge) or one merge target (sinks = C - 1, C rows); OVQ within its first chunk or with one
centroid; eviction by key norm (float64 scores of the same key values) or SnapKV (float64); Trellis
has no discrete decisions. Ends with `N passed, M failed`; exits 1 if anything failed.
"""
import argparse
import math
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import safetensors_np as stn  # noqa: E402

UNIT_ROUNDOFF = {"BF16": 2.0 ** -8, "F16": 2.0 ** -11}
FLAG = {"F32": "f32", "BF16": "bf16", "F16": "f16"}
TOKENS = {"kvm": ("q", "k", "v", "gate"), "ovq": ("q", "k", "v"), "evict": ("q", "k", "v"),
          "trellis": ("q", "k", "v", "alpha", "beta1", "gamma1", "beta2", "gamma2")}
STATE = {"kvm": ("state_keys", "state_values", "state_radius"), "ovq": ("centroid_keys", "centroid_values", "counts"),
         "evict": (), "trellis": ("m1", "m2")}
EXACT = {"kvm": ("state_rows",), "ovq": ("centroid_rows",), "evict": ("kept_positions", "kept_rows", "mask"),
         "trellis": ()}


def rounded(a, dtype):
    """float array `a` stored as `dtype` (F32, F64, BF16 or F16), rounded to nearest even."""
    if dtype == "BF16":
        return stn.bf16_round(a)
    return np.asarray(a).astype(stn.DTYPES[dtype])


def widened(a):
    """float32 values of a float array of any of the four dtypes (exact for F32, BF16, F16)."""
    return stn.bf16_to_f32(a) if a.dtype == stn.BF16 else a.astype(np.float32)


def kvm_inputs(rng, B=2, Hq=4, Hkv=2, T=12, D=8, Dv=6, q_scale=1.0):
    f = np.float32
    return dict(q=q_scale * rng.standard_normal((B, Hq, T, D)), k=rng.standard_normal((B, Hkv, T, D)),
                v=rng.standard_normal((B, Hkv, T, Dv)), gate=rng.uniform(-2, 2, (B, Hkv, T)),
                ln_weight=(1 + 0.2 * rng.standard_normal(D)).astype(f), ln_bias=(0.1 * rng.standard_normal(D)).astype(f),
                tau_state=rng.uniform(0.7, 1.3, Hq).astype(f), tau_bswa=rng.uniform(0.7, 1.3, Hq).astype(f))


def ovq_inputs(rng, B=2, H=2, T=10, D=8, Dv=6, q_scale=1.0):
    return dict(q=q_scale * rng.standard_normal((B, H, T, D)), k=rng.standard_normal((B, H, T, D)),
                v=rng.standard_normal((B, H, T, Dv)), beta=rng.uniform(0.7, 1.3, H).astype(np.float32))


def evict_inputs(rng, B=2, Hq=4, Hkv=2, T=30, D=8, Dv=6):
    return dict(q=0.5 * rng.standard_normal((B, Hq, T, D)), k=rng.standard_normal((B, Hkv, T, D)),
                v=rng.standard_normal((B, Hkv, T, Dv)), lengths=np.array([T, T - 7], np.int64))


def trellis_inputs(rng, B=2, H=2, T=20, D=8, Dv=6, m=4):
    def unit(dim):
        x = rng.standard_normal((B, H, T, dim))
        return x / np.linalg.norm(x, axis=-1, keepdims=True)
    return dict(q=unit(D), k=unit(D), v=unit(Dv), alpha=0.7 * rng.standard_normal((B, H, T, m)),
                beta1=rng.uniform(0.6, 1.0, (B, H, T)), gamma1=rng.uniform(0.05, 0.6, (B, H, T)),
                beta2=rng.uniform(0.6, 1.0, (B, H, T)), gamma2=rng.uniform(0.05, 0.6, (B, H, T)))


# (name, subcommand, inputs(rng), flags, merges): `merges` says that the memory reads rounded state rows
# (read caches) as well as the inputs as given.
KVM_FLAGS = ["--chunk", "4", "--window-chunks", "2", "--rope-dims", "2", "--sinks", "1"]
CASES = [
    ("kvm T = window + chunk (no merge)", "kvm", lambda r: kvm_inputs(r, T=12), KVM_FLAGS, False),
    ("kvm one merge target (sinks = C - 1, C rows)", "kvm", lambda r: kvm_inputs(r, T=30, q_scale=0.3),
     ["--chunk", "2", "--window-chunks", "1", "--rope-dims", "0", "--sinks", "1", "--max-chunks", "1",
      "--budget", "fixed", "--min-rows", "2"], True),
    ("ovq T < chunk (no commit)", "ovq", lambda r: ovq_inputs(r, T=7), ["--chunk", "8", "--max-centroids", "4"], False),
    ("ovq one centroid", "ovq", lambda r: ovq_inputs(r, T=30, q_scale=0.3), ["--chunk", "4", "--max-centroids", "1"], True),
    ("evict knorm with --mask", "evict", evict_inputs,
     ["--scorer", "knorm", "--sinks", "2", "--window", "4", "--top-k", "6", "--mask"], False),
    ("evict snapkv", "evict", evict_inputs, ["--scorer", "snapkv", "--sinks", "0", "--window", "4", "--top-k", "6"], False),
    ("trellis", "trellis", trellis_inputs, ["--slots", "4", "--chunk", "4"], False),
]


def logit_bound(sub, t):
    """A = the largest |logit| the memory can form, s * sum_c |q_c| |key_c| with s = max tau / sqrt(D), for
    keys as held: the input keys, and (KVM) LayerNorm'd state keys, whose elements are at most
    sqrt(D) |w| + |b| (a normalized vector has norm sqrt(D))."""
    q = np.abs(widened(t["q"])).astype(np.float64)
    D = q.shape[-1]
    key = float(np.max(np.abs(widened(t["k"]))))
    tau = 1.0
    if sub == "kvm":
        key = max(key, math.sqrt(D) * float(np.max(np.abs(t["ln_weight"]))) + float(np.max(np.abs(t["ln_bias"]))))
        tau = float(max(np.max(t["tau_state"]), np.max(t["tau_bswa"])))
    elif sub == "ovq":
        tau = float(np.max(t["beta"]))
    return tau / math.sqrt(D) * float(np.max(q.sum(axis=-1))) * key


def tolerance(sub, t, dtype, merges, y32):
    """max|y - y_F32| allowed. Both runs see the same token values and take the same decisions, and every
    sum is float32 in both, so what differs is what the 16-bit run rounds (u = its unit roundoff):
    - without merges (KVM's window, OVQ's open chunk, eviction's cache, Trellis' float32 state) the memory
      reads the inputs as they are and only y is rounded when stored: u |y|, plus float32 reassociation
      (below 1e-5 here); tolerance 2 u max|y|.
    - with merges the state rows' read caches (keys and values) are rounded as well: the bound of
      docs/numerics.md with u_k = u_v = u, (e^{2uA} - 1)(1 + u) V + 2 u V (held values, storing y), where
      A = logit_bound and V = the largest ||v||_2 (a KVM read value rho_i V_i / ||V_i|| has some token's
      norm; it bounds every element of every value read); tolerance that plus u V for float32."""
    u = UNIT_ROUNDOFF[dtype]
    if not merges:
        return 2 * u * max(float(np.max(np.abs(y32))), 1e-30)
    V = float(np.max(np.linalg.norm(widened(t["v"]).astype(np.float64), axis=-1)))
    A = logit_bound(sub, t)
    return (math.expm1(2 * u * A) * (1 + u) + 3 * u) * V


def run(runner, sub, tensors, flags, tmp, mode="prefill"):
    """Runs `runner sub` on `tensors`; returns (exit status, output text, outputs or None)."""
    inp, out = os.path.join(tmp, "in.safetensors"), os.path.join(tmp, "out.safetensors")
    for p in (inp, out):
        if os.path.exists(p):
            os.remove(p)
    stn.save(inp, tensors)
    argv = [runner, sub, "--input", inp, "--output", out, "--mode", mode] + list(flags)
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    got = stn.load(out) if r.returncode == 0 and os.path.exists(out) else None
    return r.returncode, r.stdout + r.stderr, got


def as_dtype(t, sub, dtype):
    """`t` with its token tensors stored as `dtype` (weights and lengths as they are)."""
    return {n: rounded(a, dtype) if n in TOKENS[sub] else a for n, a in t.items()}


def check_case(runner, tmp, name, sub, build, flags, merges, dtype, seed):
    """A 16-bit run against the F32 run of the same rounded tokens, in both modes. Returns problems."""
    t16 = as_dtype(build(np.random.default_rng(seed)), sub, dtype)
    t32 = {n: widened(a) if n in TOKENS[sub] else a for n, a in t16.items()}
    problems, worst = [], 0.0
    for mode in ("prefill", "decode"):
        rc16, text16, got16 = run(runner, sub, t16, flags, tmp, mode)
        rc32, text32, got32 = run(runner, sub, t32, flags, tmp, mode)
        if got16 is None or got32 is None:
            problems.append(f"{mode}: exit {rc16}/{rc32}: {(text16 + text32).strip().splitlines()[-1:]}")
            continue
        y16, y32 = got16["y"], got32["y"]
        if y16.dtype != stn.DTYPES[dtype] or y32.dtype != stn.DTYPES["F32"]:
            problems.append(f"{mode}: y dtypes {y16.dtype} / {y32.dtype}, want {dtype} / F32")
            continue
        err = float(np.max(np.abs(widened(y16).astype(np.float64) - y32))) if y32.size else 0.0
        tol = tolerance(sub, t16, dtype, merges, y32)
        worst = max(worst, err / tol)
        if not err <= tol:
            problems.append(f"{mode}: max|y - y_F32| = {err:.3g} > {tol:.3g}")
        for n in STATE[sub]:  # float32 state from the same values and decisions
            a, b = got16[n], got32[n]
            scale = max(1.0, float(np.max(np.abs(b)))) if b.size else 1.0
            if a.dtype != stn.DTYPES["F32"] or a.shape != b.shape or (a.size and np.max(np.abs(a - b)) > 1e-4 * scale):
                problems.append(f"{mode}: {n} ({a.dtype}, {list(a.shape)}) differs from the F32 run's")
        for n in EXACT[sub]:
            if (n in got16) != (n in got32) or (n in got32 and not np.array_equal(got16[n], got32[n])):
                problems.append(f"{mode}: {n} differs from the F32 run's")
        if f"dtype={FLAG[dtype]}" not in text16 or f"({FLAG[dtype]}):" not in text16:
            problems.append(f"{mode}: the summary does not name dtype {FLAG[dtype]}: {text16.strip()[:300]}")
    return problems, worst


def f16_double_rounding_traps(rng, shape):
    """float64 values just above the midpoint of two float16 values whose lower one is even: float32 keeps
    only the midpoint, so rounding through float32 to nearest even gives the lower one; the correctly
    rounded float16 (numpy's float64 -> float16) is the upper one."""
    h = (rng.standard_normal(shape) * 2).astype(np.float16)
    bits = h.view(np.uint16) & np.uint16(0xFFFE)  # even mantissa
    lo = bits.view(np.float16).astype(np.float64)
    away = np.where(lo >= 0, np.float16(np.inf), np.float16(-np.inf)).astype(np.float16)
    hi = np.nextafter(bits.view(np.float16), away).astype(np.float64)
    x = (lo + hi) / 2 + (hi - lo) * 2.0 ** -30
    assert np.array_equal(x.astype(np.float32).astype(np.float64), (lo + hi) / 2), "float32 keeps the midpoint"
    assert np.array_equal(x.astype(np.float16).astype(np.float64), hi), "numpy rounds float64 -> float16 correctly"
    return x


def conversion_cases():
    """(name, subcommand, tensors, flags, want y dtype, tensors whose run must give the same y bits or None)."""
    rng = np.random.default_rng(7)
    kvm = kvm_inputs(rng)
    f32 = as_dtype(kvm, "kvm", "F32")
    yield ("kvm F32 input --dtype bf16", "kvm", f32, KVM_FLAGS + ["--dtype", "bf16"], "BF16",
           as_dtype(f32, "kvm", "BF16"))
    mixed = dict(as_dtype(kvm, "kvm", "BF16"), k=f32["k"], gate=rounded(kvm["gate"], "F16"))
    yield ("kvm mixed BF16/F32/F16 input --dtype bf16", "kvm", mixed, KVM_FLAGS + ["--dtype", "bf16"], "BF16",
           dict(mixed, k=rounded(f32["k"], "BF16"), gate=rounded(widened(mixed["gate"]), "BF16")))
    yield ("kvm BF16 input --dtype f32", "kvm", as_dtype(kvm, "kvm", "BF16"), KVM_FLAGS + ["--dtype", "f32"], "F32",
           {n: widened(a) if n in TOKENS["kvm"] else a for n, a in as_dtype(kvm, "kvm", "BF16").items()})
    yield "kvm F32 input runs as F32", "kvm", f32, KVM_FLAGS, "F32", None
    yield "kvm F64 input runs as F32", "kvm", as_dtype(kvm, "kvm", "F64"), KVM_FLAGS, "F32", None
    ev = evict_inputs(rng)
    ev["q"] = f16_double_rounding_traps(rng, ev["q"].shape)
    ev64 = as_dtype(ev, "evict", "F64")
    flags = ["--scorer", "knorm", "--sinks", "2", "--window", "4", "--top-k", "6"]
    yield ("evict F64 input --dtype f16 (correct rounding, ties after float32)", "evict", ev64, flags + ["--dtype", "f16"],
           "F16", as_dtype(ev64, "evict", "F16"))
    tr = as_dtype(trellis_inputs(rng), "trellis", "F32")
    yield ("trellis F32 input --dtype f16", "trellis", tr, ["--slots", "4", "--dtype", "f16"], "F16",
           as_dtype(tr, "trellis", "F16"))
    ov = as_dtype(ovq_inputs(rng), "ovq", "F16")
    yield ("ovq F16 input --dtype bf16", "ovq", ov, ["--dtype", "bf16"], "BF16",
           {n: rounded(widened(a), "BF16") if n in TOKENS["ovq"] else a for n, a in ov.items()})


def check_conversion(runner, tmp, name, sub, tensors, flags, want, same_as):
    rc, text, got = run(runner, sub, tensors, flags, tmp)
    if got is None:
        return [f"exit {rc}: {text.strip()[-300:]}"]
    if got["y"].dtype != stn.DTYPES[want]:
        return [f"y dtype {got['y'].dtype}, want {want}"]
    if same_as is not None:
        flags_without = [a for i, a in enumerate(flags) if a != "--dtype" and (i == 0 or flags[i - 1] != "--dtype")]
        rc2, text2, ref = run(runner, sub, same_as, flags_without, tmp)
        if ref is None:
            return [f"reference run: exit {rc2}: {text2.strip()[-300:]}"]
        if ref["y"].dtype != got["y"].dtype or ref["y"].tobytes() != got["y"].tobytes():
            return ["y differs from the run of the input rounded by numpy"]
    return []


def error_cases():
    """(name, subcommand, tensors, flags, expected substrings): each must exit 2 naming them."""
    rng = np.random.default_rng(11)
    kvm = as_dtype(kvm_inputs(rng), "kvm", "BF16")
    yield ("kvm k F32, q BF16", "kvm", dict(kvm, k=widened(kvm["k"])), KVM_FLAGS,
           ["tensor 'k' dtype = F32", "tensor 'q' dtype = BF16", "--dtype"])
    yield ("kvm gate F16, q BF16", "kvm", dict(kvm, gate=rounded(widened(kvm["gate"]), "F16")), KVM_FLAGS,
           ["tensor 'gate' dtype = F16", "tensor 'q' dtype = BF16"])
    yield ("kvm q I8", "kvm", dict(kvm, q=np.zeros(kvm["q"].shape, np.int8)), KVM_FLAGS, ["tensor 'q' dtype = I8"])
    yield ("kvm q U8 with --dtype bf16", "kvm", dict(kvm, q=np.zeros(kvm["q"].shape, np.uint8)),
           KVM_FLAGS + ["--dtype", "bf16"], ["tensor 'q' dtype = U8"])
    yield ("kvm v I32, q BF16", "kvm", dict(kvm, v=np.zeros(kvm["v"].shape, np.int32)), KVM_FLAGS,
           ["tensor 'v' dtype = I32"])
    yield ("kvm --dtype f64", "kvm", kvm, KVM_FLAGS + ["--dtype", "f64"], ["--dtype", "f64"])
    ev = as_dtype(evict_inputs(rng), "evict", "F32")
    yield ("evict k BF16, q F32 (not narrowed silently)", "evict", dict(ev, k=rounded(ev["k"], "BF16")),
           ["--scorer", "knorm"], ["tensor 'k' dtype = BF16", "tensor 'q' dtype = F32"])
    ov = as_dtype(ovq_inputs(rng), "ovq", "F16")
    yield ("ovq v F32, q F16", "ovq", dict(ov, v=widened(ov["v"])), [], ["tensor 'v' dtype = F32", "tensor 'q' dtype = F16"])
    yield "ovq q U8", "ovq", dict(ov, q=np.zeros(ov["q"].shape, np.uint8)), [], ["tensor 'q' dtype = U8"]
    tr = as_dtype(trellis_inputs(rng), "trellis", "BF16")
    yield ("trellis gamma2 F16, q BF16", "trellis", dict(tr, gamma2=rounded(widened(tr["gamma2"]), "F16")),
           ["--slots", "4"], ["tensor 'gamma2' dtype = F16", "tensor 'q' dtype = BF16"])
    yield ("trellis alpha U8", "trellis", dict(tr, alpha=np.zeros(tr["alpha"].shape, np.uint8)), ["--slots", "4"],
           ["tensor 'alpha' dtype = U8"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runner", required=True)
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        for i, (name, sub, build, flags, merges) in enumerate(CASES):
            for dtype in ("BF16", "F16"):
                problems, worst = check_case(args.runner, tmp, name, sub, build, flags, merges, dtype, seed=100 + i)
                ok = not problems
                print(f"{'PASS' if ok else 'FAIL'} {dtype} {name}: worst err/tol = {worst:.2f}"
                      + ("" if ok else " | " + "; ".join(problems)), flush=True)
                results.append(ok)
        for name, sub, tensors, flags, want, same_as in conversion_cases():
            problems = check_conversion(args.runner, tmp, name, sub, tensors, flags, want, same_as)
            print(f"{'PASS' if not problems else 'FAIL'} {name}" + ("" if not problems else " | " + "; ".join(problems)))
            results.append(not problems)
        for name, sub, tensors, flags, expect in error_cases():
            rc, text, got = run(args.runner, sub, tensors, flags, tmp)
            ok = rc == 2 and got is None and all(e in text for e in expect)
            first = text.strip().splitlines()[0] if text.strip() else "(no output)"
            print(f"{'PASS' if ok else 'FAIL'} {name}: exit {rc}: {first}"
                  + ("" if ok else f"\n     expected exit 2 and {expect}; output:\n{text}"))
            results.append(ok)
    print(f"{sum(results)} passed, {len(results) - sum(results)} failed")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
