#!/usr/bin/env python3
"""Round-trip test of `<runner> kvm` against the float64 KVM reference (shared/spec/KVM.md).

  python3 kvm_roundtrip.py --runner CMD [--cases N] [--seed S]   # CMD may contain arguments
  python3 kvm_roundtrip.py --self-test                          # reference-only checks

Each case writes random float32 (sometimes float64) inputs, runs the tool in prefill and decode
mode and compares every output with the float64 reference evaluated on the same (float32-rounded)
values: max|a-b| <= 1e-4 * max(1, max|ref|) per tensor, state_rows exactly.
Ends with the line `N passed, M failed`; exits 1 if anything failed.
"""
import argparse
import os
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "reference")]
import safetensors_np as stn  # noqa: E402
from roundtrip_common import compare_tensors, report, run_modes  # noqa: E402
from kvm_reference import _budget, kvm_decode, kvm_prefill, make_params  # noqa: E402

TOL = 1e-4
BUDGET_FLAG = {"fixed": "fixed", "power_law": "power-law", "saturation": "saturating"}
OPT_FLAGS = {"min_len": "--min-rows", "growth_factor": "--growth-factor",
             "growth_exponent": "--growth-exponent", "round_down": "--round-down",
             "saturation_n": "--saturation-n", "max_chunks": "--max-chunks"}
PARAM_DEFAULTS = dict(chunk=4, window_chunks=2, rope_dims=4, sinks=1, schedule="fixed",
                      min_len=-1, growth_factor=1.0, growth_exponent=0.5, round_down=1,
                      saturation_n=1024, max_chunks=1)
FLAG_DEFAULTS = {k: PARAM_DEFAULTS[k] for k in OPT_FLAGS}  # = the tool's documented defaults
CASE_DEFAULTS = dict(B=1, Hq=2, Hkv=2, T=20, D=8, Dv=6, lengths=None, f64=False, zero_v=False,
                     dup=False, omit_defaults=False, **PARAM_DEFAULTS)

PL = dict(schedule="power_law", growth_factor=2.0, min_len=2, max_chunks=100)
FIXED_CASES = [
    ("T < chunk", dict(T=5, chunk=8)),
    ("T = 1", dict(T=1)),
    ("T not a multiple of chunk", dict(T=23, chunk=3, **PL)),
    ("T <= window", dict(T=12, chunk=4, window_chunks=3, **PL)),
    ("T = L+C", dict(T=12, chunk=4, **PL)),
    ("T = L+C+1", dict(T=13, chunk=4, **PL)),
    ("spec worked trace", dict(T=11, chunk=2, D=6, **PL)),
    ("fixed default (min_len -1)", dict(T=40, chunk=4)),
    ("fixed budget below chunk", dict(T=40, chunk=8, min_len=3, max_chunks=4)),
    ("power_law budget below chunk", dict(T=40, chunk=8, schedule="power_law",
                                          growth_factor=0.5, max_chunks=4)),
    ("fixed growth to cap 2C", dict(T=50, chunk=4, min_len=100, max_chunks=2)),
    ("saturation", dict(T=60, chunk=4, schedule="saturation", saturation_n=16, min_len=1,
                        max_chunks=100)),
    ("saturation round_down 3", dict(T=60, chunk=3, schedule="saturation", saturation_n=64,
                                     round_down=3, min_len=1, max_chunks=1000)),
    ("power_law p=0.7 round_down 2", dict(T=45, chunk=3, schedule="power_law",
                                          growth_factor=1.5, growth_exponent=0.7,
                                          round_down=2, max_chunks=100)),
    ("GQA 4/2", dict(Hq=4, Hkv=2, T=30, **PL)),
    ("GQA 4/1", dict(Hq=4, Hkv=1, T=30, chunk=3, **PL)),
    ("Hq = Hkv = 1", dict(Hq=1, Hkv=1, T=30, chunk=2, **PL)),
    ("ragged batch with a zero length", dict(B=3, Hq=4, Hkv=2, T=29, lengths=[29, 0, 17], **PL)),
    ("all lengths zero", dict(B=2, T=3, lengths=[0, 0])),
    ("chunk 1, sinks 0", dict(T=20, chunk=1, window_chunks=3, sinks=0, **PL)),
    ("chunk 16, window 1, sinks 2", dict(T=70, chunk=16, window_chunks=1, sinks=2, D=16,
                                         rope_dims=8, schedule="power_law", growth_factor=4.0,
                                         max_chunks=4)),
    ("rope_dims 0", dict(T=30, rope_dims=0, **PL)),
    ("rope_dims D", dict(T=30, rope_dims=8, **PL)),
    ("sinks 0", dict(T=30, sinks=0, **PL)),
    ("sinks 2", dict(T=30, sinks=2, **PL)),
    ("zero-norm value rows", dict(T=40, zero_v=True, **PL)),
    ("duplicated key tokens (ties)", dict(T=40, dup=True, **PL)),
    ("duplicated keys, fixed budget", dict(T=40, dup=True, sinks=0, chunk=3)),
    ("float64 inputs", dict(T=33, f64=True, Hq=4, Hkv=2, **PL)),
    ("optional flags omitted", dict(T=40, omit_defaults=True)),
]


def random_case(rng, i):
    C = [1, 2, 3, 4, 8, 16][i % 6]
    nb = [1, 2, 3][(i // 6) % 3]
    L = nb * C
    hq, hkv = [(1, 1), (2, 2), (4, 2), (4, 1), (3, 3)][rng.integers(5)]
    c = dict(chunk=C, window_chunks=nb, Hq=hq, Hkv=hkv, sinks=int(rng.integers(3)),
             schedule=["fixed", "power_law", "saturation"][(i // 2) % 3],
             D=int(rng.choice([4, 6, 8])), Dv=int(rng.choice([3, 5, 8])),
             T=int(rng.integers(L + C if rng.random() < 0.7 else 1, max(L + 5 * C, 90) + 1)),
             B=int(rng.integers(1, 4)),
             min_len=int(rng.choice([-1, 1, C, 2 * C + 1])), max_chunks=int(rng.choice([1, 3, 50])),
             growth_factor=float(rng.choice([0.5, 1.0, 2.5, 4.0])),
             growth_exponent=float(rng.choice([0.5, 0.5, 0.6])),
             round_down=int(rng.choice([1, 1, 2, 4])), saturation_n=int(rng.choice([8, 64, 1024])),
             f64=bool(rng.random() < 0.15), zero_v=bool(rng.random() < 0.2),
             dup=bool(rng.random() < 0.2), omit_defaults=bool(rng.random() < 0.3))
    # r = D-1 would leave every memory key one of two directions (routing decided by rounding)
    c["rope_dims"] = int(rng.choice([0, rng.integers(1, c["D"] - 1), c["D"]]))
    if c["B"] > 1 and rng.random() < 0.7:
        c["lengths"] = [int(x) for x in rng.integers(0, c["T"] + 1, c["B"])]
        c["lengths"][0] = c["T"]
    return f"random #{i}", c


def full_case(overrides):
    c = dict(CASE_DEFAULTS, **overrides)
    lens = c["lengths"] or [c["T"]] * c["B"]
    C, L = c["chunk"], c["chunk"] * c["window_chunks"]
    if max(lens) > L + C:  # an update happens: the tool rejects sinks >= chunk
        c["sinks"] = min(c["sinks"], C - 1)
    return c


def make_inputs(c, rng):
    B, Hq, Hkv, T, D, Dv = (c[x] for x in ("B", "Hq", "Hkv", "T", "D", "Dv"))
    f = np.float32
    t = dict(q=rng.standard_normal((B, Hq, T, D)).astype(f),
             k=rng.standard_normal((B, Hkv, T, D)).astype(f),
             v=rng.standard_normal((B, Hkv, T, Dv)).astype(f),
             gate=rng.uniform(-2, 2, (B, Hkv, T)).astype(f),
             ln_weight=(1 + 0.2 * rng.standard_normal(D)).astype(f),
             ln_bias=(0.1 * rng.standard_normal(D)).astype(f),
             tau_state=rng.uniform(0.7, 1.3, Hq).astype(f),
             tau_bswa=rng.uniform(0.7, 1.3, Hq).astype(f))
    if c["zero_v"] and T:  # initial row with rho = 0, plus later rows (appended or merged)
        t["v"][:, 0, 0] = 0
        t["v"][:, -1, rng.integers(0, T, max(1, T // 5))] = 0
    if c["dup"] and T > 1:  # identical initial rows and identical tokens inside blocks
        t["k"][:, :, 1] = t["k"][:, :, 0]
        for s in range(2, T):
            if rng.random() < 0.4:
                t["k"][:, :, s] = t["k"][:, :, s - 1]
    if c["f64"]:
        t = {n: a.astype(np.float64) for n, a in t.items()}
    if c["lengths"] is not None:
        t["lengths"] = np.array(c["lengths"], dtype=np.int64)
    return t


def reference(c, t):
    p = make_params({k: c[k] for k in PARAM_DEFAULTS})
    B, Hq, Hkv, T, D, Dv = (c[x] for x in ("B", "Hq", "Hkv", "T", "D", "Dv"))
    lens = c["lengths"] or [T] * B
    f = {n: a.astype(np.float64) for n, a in t.items() if n != "lengths"}
    y, per = np.zeros((B, Hq, T, Dv)), []
    for b, Tb in enumerate(lens):
        yb, K, V, rho, m = kvm_prefill(f["q"][b, :, :Tb], f["k"][b, :, :Tb], f["v"][b, :, :Tb],
                                       f["gate"][b, :, :Tb], f["ln_weight"], f["ln_bias"],
                                       f["tau_state"], f["tau_bswa"], p)
        y[b, :, :Tb] = yb
        per.append((K, V, rho, m))
    M = max(m for *_, m in per)
    out = dict(y=y, state_keys=np.zeros((B, Hkv, M, D)), state_values=np.zeros((B, Hkv, M, Dv)),
               state_radius=np.zeros((B, Hkv, M)), state_rows=np.zeros((B, Hkv), np.int64))
    for b, (K, V, rho, m) in enumerate(per):
        out["state_keys"][b, :, :m], out["state_values"][b, :, :m] = K, V
        out["state_radius"][b, :, :m], out["state_rows"][b] = rho, m
    return out


def tool_args(c):
    a = ["--chunk", c["chunk"], "--window-chunks", c["window_chunks"], "--rope-dims",
         c["rope_dims"], "--sinks", c["sinks"], "--budget", BUDGET_FLAG[c["schedule"]]]
    for k, flag in OPT_FLAGS.items():
        if not (c["omit_defaults"] and c[k] == FLAG_DEFAULTS[k]):
            a += [flag, repr(c[k])]
    return [str(x) for x in a]


def compare(exp, got):
    return compare_tensors(exp, got, TOL, {"state_rows": "I64"})


def run_case(runner, name, c, rng, tmp):
    t = make_inputs(c, rng)
    exp = reference(c, t)
    inp, out = os.path.join(tmp, "in.safetensors"), os.path.join(tmp, "out.safetensors")
    stn.save(inp, t)
    desc = (f"B={c['B']} Hq={c['Hq']} Hkv={c['Hkv']} T={c['T']} lens={c['lengths']} D={c['D']} "
            f"Dv={c['Dv']} C={c['chunk']} nb={c['window_chunks']} r={c['rope_dims']} "
            f"S={c['sinks']} {c['schedule']} rows={exp['state_rows'].max() if c['B'] else 0}")
    problems, worst = run_modes(runner, "kvm", inp, out, tool_args(c), exp, compare)
    return report(name, desc, problems, worst)


def self_test(seed):
    rng = np.random.default_rng(seed)
    results = []

    def check(name, ok, info=""):
        results.append(bool(ok))
        print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + info if info else ''}", flush=True)

    def rand(Hq, Hkv, T, D, Dv, zscale=2.0):
        return (rng.standard_normal((Hq, T, D)), rng.standard_normal((Hkv, T, D)),
                rng.standard_normal((Hkv, T, Dv)), rng.uniform(-zscale, zscale, (Hkv, T)),
                1 + 0.2 * rng.standard_normal(D), 0.1 * rng.standard_normal(D),
                rng.uniform(0.7, 1.3, Hq), rng.uniform(0.7, 1.3, Hq))

    # safetensors round trip and offset validation
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "x.safetensors")
        ts = dict(a=np.arange(6, dtype=np.float32).reshape(2, 3), b=np.array([1.5, -2.0]),
                  c=np.array([3, -4], np.int64), d=np.array([[7]], np.int32),
                  e=np.zeros((2, 0, 3), np.float32))
        stn.save(path, ts)
        back = stn.load(path)
        check("safetensors round trip", back.keys() == ts.keys() and all(
            back[n].dtype == ts[n].dtype and np.array_equal(back[n], ts[n]) for n in ts))
        with open(path, "ab") as fh:
            fh.write(b"\0")
        try:
            stn.load(path)
            check("safetensors rejects trailing bytes", False)
        except ValueError as ex:
            check("safetensors rejects trailing bytes", True, str(ex))

    # budget examples (spec §5.2, C = 256, first update ctx = 768, avail = 512)
    b1 = _budget(make_params(chunk=256, schedule="power_law", growth_factor=16.0), 768)
    b2 = _budget(make_params(chunk=256, schedule="saturation", saturation_n=1024), 768)
    b3 = _budget(make_params(chunk=256, schedule="fixed", min_len=256), 768)
    check("budget examples 443/438/256", (b1, b2, b3) == (443, 438, 256), f"{(b1, b2, b3)}")

    # worked trace of spec §4
    p = make_params(chunk=2, window_chunks=2, schedule="power_law", growth_factor=2.0,
                    growth_exponent=0.5, min_len=2, max_chunks=100, sinks=1, rope_dims=2)
    args = rand(2, 1, 11, 6, 4)
    tr, trd = [], []
    y, K, V, rho, m = kvm_prefill(*args, p, trace=tr)
    yd, Kd, Vd, rhod, md = kvm_decode(*args, p, trace=trd)
    ups = [(d["ctx"], d["avail"], d["B"], d["Mstar"], d["n_app"], d["merged"], d["rows"])
           for d in tr if "ctx" in d]
    want = [(6, 4, 4, 4, 2, 0, 4), (8, 6, 5, 5, 1, 1, 5), (10, 8, 6, 6, 1, 1, 6)]
    qs = [(d["query"], d["window"], d["covers"]) for d in tr if "query" in d]
    want_q = [((4, 6), (2, 6), 2), ((6, 8), (4, 8), 4), ((8, 10), (6, 10), 6),
              ((10, 11), (8, 11), 8)]
    check("spec trace: prefill updates", ups == want and qs == want_q and m == 6, f"{ups}")
    dn = [(d["n"], d["block"]) for d in trd if "n" in d]
    dups = [(d["ctx"], d["avail"], d["rows"]) for d in trd if "ctx" in d]
    check("spec trace: decode updates", dn == [(7, (2, 4)), (9, (4, 6)), (11, (6, 8))]
          and dups == [(6, 4, 4), (8, 6, 5), (10, 8, 6)] and trd[-1] == dict(final_cov=8)
          and md == 6, f"{dn}")

    # small edge cases
    q, k, v, z, w, b, ts_, tb = rand(2, 2, 1, 4, 3)
    y, K, V, rho, m = kvm_prefill(q, k, v, z, w, b, ts_, tb, make_params(chunk=4, rope_dims=2))
    check("T = 1", m == 1 and np.allclose(y[:, 0], v[:, 0], atol=1e-14, rtol=0)
          and np.allclose(V[:, 0], v[:, 0])
          and np.allclose(rho[:, 0], np.linalg.norm(v[:, 0], axis=-1)))
    q, k, v, z, w, b, ts_, tb = rand(4, 2, 6, 4, 3)
    y, K, V, rho, m = kvm_prefill(q, k, v, z, w, b, ts_, tb, make_params(chunk=3, rope_dims=2))
    kk, vv = np.repeat(k, 2, axis=0), np.repeat(v, 2, axis=0)
    lg = np.einsum("htd,hsd->hts", q, tb[:, None, None] * kk) / 2.0
    lg = np.where(np.tril(np.ones((6, 6), bool)), lg, -np.inf)
    a = np.exp(lg - lg.max(-1, keepdims=True))
    direct = (a / a.sum(-1, keepdims=True)) @ vv
    check("T <= L is plain causal attention (GQA)", m == 3 and np.max(np.abs(y - direct)) < 1e-13)
    p = make_params(chunk=3, rope_dims=2)
    y, K, V, rho, m = kvm_prefill(*rand(2, 1, 0, 4, 3), p)
    yd, *_, md = kvm_decode(*rand(2, 1, 0, 4, 3), p)
    check("T = 0", y.shape == (2, 0, 3) and K.shape == (1, 0, 4) and m == md == 0)

    # prefill == decode on random configurations
    worst, bad = 0.0, 0
    for i in range(300):
        C = int(rng.choice([1, 2, 3, 4, 5, 8, 16]))
        nb = int(rng.integers(1, 4))
        D, Dv = int(rng.choice([2, 4, 6])), int(rng.integers(1, 6))
        hq, hkv = [(1, 1), (2, 2), (4, 2), (4, 1), (6, 3)][rng.integers(5)]
        T = int(rng.integers(0, min(nb * C + 6 * C, 80) + 1))
        p = make_params(chunk=C, window_chunks=nb, rope_dims=int(rng.integers(0, D + 1)),
                        sinks=int(rng.integers(0, min(C, 3))),
                        schedule=["fixed", "power_law", "saturation"][i % 3],
                        min_len=int(rng.choice([-1, 0, 1, C, 3 * C])),
                        growth_factor=float(rng.choice([0.5, 1.0, 2.0, 5.0])),
                        growth_exponent=float(rng.choice([0.5, 0.3, 0.8])),
                        round_down=int(rng.choice([0, 1, 2, 3])),
                        saturation_n=int(rng.choice([4, 32, 1024])),
                        max_chunks=int(rng.choice([1, 2, 10, 1000])))
        args = rand(hq, hkv, T, D, Dv, zscale=float(rng.choice([2.0, 6.0])))
        if T > 2 and i % 4 == 0:  # duplicated keys and zero values
            args[1][:, 1::3] = args[1][:, 0:1]
            args[2][:, ::4] = 0
        r1, r2 = kvm_prefill(*args, p), kvm_decode(*args, p)
        ok = r1[4] == r2[4]
        for a_, b_ in zip(r1[:4], r2[:4]):
            if a_.shape != b_.shape:
                ok = False
            elif a_.size:
                e = np.max(np.abs(a_ - b_)) / max(1.0, np.max(np.abs(a_)))
                worst, ok = max(worst, e), ok and e <= 1e-12
        bad += not ok
    check("prefill == decode on 300 random configurations", bad == 0,
          f"{bad} mismatches, worst rel {worst:.2e}")
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runner", help="launcher command, invoked as RUNNER kvm --input ... ")
    ap.add_argument("--cases", type=int, default=len(FIXED_CASES) + 30,
                    help=f"number of cases (the first {len(FIXED_CASES)} are fixed)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--self-test", action="store_true", help="check the reference only")
    a = ap.parse_args()
    if a.self_test:
        res = self_test(a.seed)
    elif not a.runner:
        ap.error("--runner is required unless --self-test is given")
    else:
        rng = np.random.default_rng(a.seed)
        cases = [FIXED_CASES[i] if i < len(FIXED_CASES) else random_case(rng, i)
                 for i in range(a.cases)]
        with tempfile.TemporaryDirectory() as tmp:
            res = [run_case(a.runner, n, full_case(c), rng, tmp) for n, c in cases]
    print(f"{sum(res)} passed, {len(res) - sum(res)} failed")
    return 0 if all(res) else 1


if __name__ == "__main__":
    sys.exit(main())
