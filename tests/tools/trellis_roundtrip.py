#!/usr/bin/env python3
"""Round-trip test of `<runner> trellis` against the float64 Trellis reference (shared/spec/TRELLIS.md).

  python3 trellis_roundtrip.py --runner CMD [--cases N] [--seed S]   # CMD may contain arguments
  python3 trellis_roundtrip.py --self-test                          # reference-only checks

Each case writes random float32 (sometimes float64) inputs, runs the tool in prefill mode (compared with
the reference's chunkwise form, mode="chunk", C = --chunk) and in decode mode (compared with the
recurrence, mode="recurrent"; decode ignores --chunk, spec §3.3), evaluated on the same float32-rounded
values: max|a-b| <= 1e-4 * max(1, max|ref|) per tensor (y, m1, m2). Then bad inputs: each must exit with
status 2 and a message naming the tensor or flag and its value.
Ends with the line `N passed, M failed`; exits 1 if anything failed.
"""
import argparse
import os
import shlex
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "reference")]
import safetensors_np as stn  # noqa: E402
import trellis_reference as tr  # noqa: E402
from roundtrip_common import compare_tensors, report, run_modes  # noqa: E402

TOL = 1e-4
PHIS = tr.PHIS
FS = ("ln-silu", "l2-silu")  # the tool's documented choices (spec §1); softmax/identity in a few cases
CASE_DEFAULTS = dict(B=1, H=2, T=20, D=8, Dv=6, m=4, chunk=4, phi="silu", f="ln-silu", lengths=None,
                     f64=False, zero_beta=0, zero_gamma=0, raw=False, omit_defaults=False)

FIXED_CASES = [(f"phi={p} f={f}", dict(phi=p, f=f, chunk=[1, 3, 4, 5, 8][i % 5], T=19 + i % 3))
               for i, (p, f) in enumerate((p, f) for p in PHIS for f in FS)]
FIXED_CASES += [
    ("f=softmax", dict(f="softmax", chunk=3)),
    ("f=identity", dict(f="identity", chunk=3, phi="tanh")),
    ("C=1", dict(chunk=1, T=23)),
    ("C=2, T odd", dict(chunk=2, T=23)),
    ("C=4, T not a multiple", dict(chunk=4, T=23)),
    ("C=5, T not a multiple", dict(chunk=5, T=23)),
    ("C=T", dict(chunk=23, T=23)),
    ("C>T", dict(chunk=64, T=23)),
    ("beta=0 inside chunks", dict(zero_beta=3, chunk=5, T=23)),
    ("every beta=0", dict(zero_beta=1, chunk=4)),
    ("gamma=0 inside chunks", dict(zero_gamma=3, chunk=5, T=23)),
    ("every gamma=0", dict(zero_gamma=1, chunk=4)),
    ("beta=0 and gamma=0", dict(zero_beta=4, zero_gamma=3, chunk=6, phi="sigmoid", T=30)),
    ("m=1 ln-silu", dict(m=1, chunk=3)),
    ("m=1 l2-silu", dict(m=1, chunk=3, f="l2-silu")),
    ("m=1 softmax phi", dict(m=1, chunk=3, phi="softmax")),
    ("T=1", dict(T=1, chunk=4)),
    ("T=0", dict(T=0, chunk=4)),
    ("B=3 ragged lengths", dict(B=3, T=21, lengths=[21, 0, 9], chunk=4)),
    ("float64 inputs", dict(f64=True, chunk=4, phi="tanh")),
    ("unnormalized q/k/v", dict(raw=True, chunk=4)),
    ("D=16 Dv=3 m=12", dict(D=16, Dv=3, m=12, chunk=8, T=41, H=1)),
    ("defaults (chunk 16, silu, ln-silu)", dict(omit_defaults=True, chunk=16, T=40)),
]


def random_case(rng, i):
    T = int(rng.integers(1, 60))
    c = dict(B=int(rng.integers(1, 4)), H=int(rng.integers(1, 4)), T=T, D=int(rng.choice([4, 8, 16])),
             Dv=int(rng.choice([3, 6, 8])), m=int(rng.choice([1, 2, 4, 8, 16])),
             chunk=int(rng.choice([1, 2, 3, 4, 5, 8, 16, T, T + 7])), phi=PHIS[i % 5], f=FS[(i // 5) % 2],
             f64=bool(rng.random() < 0.15), zero_beta=int(rng.choice([0, 0, 2, 3, 5])),
             zero_gamma=int(rng.choice([0, 0, 2, 4])), raw=bool(rng.random() < 0.2))
    if c["B"] > 1 and rng.random() < 0.5:
        c["lengths"] = [int(x) for x in rng.integers(0, T + 1, c["B"])]
        c["lengths"][0] = T
    return f"random #{i}", c


def make_inputs(c, rng):
    B, H, T, D, Dv, m = (c[x] for x in ("B", "H", "T", "D", "Dv", "m"))

    def tokens(dim):
        x = rng.standard_normal((B, H, T, dim))
        if c["raw"]:
            return x / np.sqrt(dim)
        return x / (np.linalg.norm(x, axis=-1, keepdims=True) + 1e-6)  # spec §5: unit-norm q, k, v

    def gate(lo, hi, every, at):
        g = rng.uniform(lo, hi, (B, H, T))
        if every:
            g[:, :, np.arange(T) % every == at % every] = 0.0
        return g

    t = dict(q=tokens(D), k=tokens(D), v=tokens(Dv), alpha=0.7 * rng.standard_normal((B, H, T, m)),
             beta1=gate(0.6, 1.0, c["zero_beta"], c["zero_beta"] - 1),
             gamma1=gate(0.05, 0.6, c["zero_gamma"], c["zero_gamma"] - 2),
             beta2=gate(0.6, 1.0, c["zero_beta"], c["zero_beta"] - 1),
             gamma2=gate(0.05, 0.6, c["zero_gamma"], c["zero_gamma"] - 2))
    dt = np.float64 if c["f64"] else np.float32
    t = {n: a.astype(dt) for n, a in t.items()}
    if c["lengths"] is not None:
        t["lengths"] = np.array(c["lengths"], dtype=np.int64)
    return t


def tool_args(c):
    a = ["--slots", c["m"]]
    if not (c["omit_defaults"] and c["chunk"] == 16):
        a += ["--chunk", c["chunk"]]
    if not (c["omit_defaults"] and c["phi"] == "silu"):
        a += ["--phi", c["phi"]]
    if not (c["omit_defaults"] and c["f"] == "ln-silu"):
        a += ["--f", c["f"]]
    return [str(x) for x in a]


def compare(exp, got):
    return compare_tensors(exp, got, TOL)


def run_case(runner, name, c, rng, tmp):
    c = dict(CASE_DEFAULTS, **c)
    t = make_inputs(c, rng)
    inp, out = os.path.join(tmp, "in.safetensors"), os.path.join(tmp, "out.safetensors")
    stn.save(inp, t)
    desc = (f"B={c['B']} H={c['H']} T={c['T']} lens={c['lengths']} D={c['D']} Dv={c['Dv']} m={c['m']} "
            f"C={c['chunk']} phi={c['phi']} f={c['f']} zero_beta={c['zero_beta']} "
            f"zero_gamma={c['zero_gamma']}{' f64' if c['f64'] else ''}{' raw' if c['raw'] else ''}")
    ref_mode = {"prefill": "chunk", "decode": "recurrent"}  # decode ignores --chunk (spec §3.3)

    def expected(mode):
        return tr.trellis_batch(t, c["m"], C=c["chunk"], phi=c["phi"], f=c["f"], mode=ref_mode[mode],
                                lengths=c["lengths"])
    problems, worst = run_modes(runner, "trellis", inp, out, tool_args(c), expected, compare)
    return report(name, desc, problems, worst)


def error_cases():
    """(name, edit of good inputs, flags, expected substrings): bad input must exit 2 naming the tensor or
    flag and its value, and write no output."""
    def edit(**changes):
        def build(t):
            t = dict(t)
            for k, v in changes.items():
                if v is None:
                    del t[k]
                else:
                    t[k] = v(t) if callable(v) else v
            return t
        return build

    def at(name, idx, value):
        def change(t):
            a = t[name].copy()
            a[idx] = value
            return a
        return change

    same = edit()
    yield "alpha last dim != --slots", same, ["--slots", "5"], ["tensor 'alpha' shape", "--slots = 5"]
    yield "k with another T", edit(k=lambda t: t["k"][:, :, :7]), [], ["tensor 'k' shape", "T (from q)"]
    yield "v with another batch", edit(v=lambda t: t["v"][:1]), [], ["tensor 'v' shape", "B (from q)"]
    yield "alpha with another H", edit(alpha=lambda t: t["alpha"][:, :1]), [], ["tensor 'alpha' shape", "H (from q)"]
    yield "gamma2 of rank 2", edit(gamma2=lambda t: t["gamma2"][0]), [], ["tensor 'gamma2' shape", "rank 3"]
    yield "beta1 with another T", edit(beta1=lambda t: t["beta1"][:, :, :3]), [], ["tensor 'beta1' shape", "T (from q)"]
    yield "beta1 missing", edit(beta1=None), [], ["'beta1'", "missing"]
    yield "alpha missing", edit(alpha=None), [], ["'alpha'", "missing"]
    yield "int32 q", edit(q=lambda t: t["q"].astype(np.int32)), [], ["tensor 'q' dtype = I32"]
    yield "lengths too long", edit(lengths=np.array([9, 3], np.int64)), [], ["lengths[0] = 9"]
    yield "negative gamma1", edit(gamma1=at("gamma1", (1, 0, 3), -0.5)), [], ["gamma1[1, 0, 3] = -0.5"]
    yield "beta2 above 1", edit(beta2=at("beta2", (0, 1, 2), 1.5)), [], ["beta2[0, 1, 2] = 1.5", "[0, 1]"]
    yield "NaN beta1", edit(beta1=at("beta1", (0, 0, 0), np.nan)), [], ["beta1[0, 0, 0] = nan"]
    yield "infinite gamma2", edit(gamma2=at("gamma2", (1, 1, 7), np.inf)), [], ["gamma2[1, 1, 7] = inf"]
    yield "--slots 0", same, ["--slots", "0"], ["--slots = 0"]
    yield "--chunk 0", same, ["--chunk", "0"], ["--chunk = 0"]
    yield "--phi unknown", same, ["--phi", "gelu"], ["--phi = gelu", "unknown phi"]
    yield "--f unknown", same, ["--f", "relu"], ["--f = relu", "unknown activation"]
    yield "--mode unknown", same, ["--mode", "stream"], ["--mode", "stream"]
    yield "--slots missing", same, ["--slots", None], ["--slots", "required"]


def run_error_cases(runner, tmp):
    rng = np.random.default_rng(0)
    c = dict(CASE_DEFAULTS, B=2, H=2, T=8, m=4)
    good = make_inputs(c, rng)
    res = []
    for i, (name, build, flags, expect) in enumerate(error_cases()):
        inp, out = os.path.join(tmp, f"bad{i}.safetensors"), os.path.join(tmp, f"bad{i}-out.safetensors")
        stn.save(inp, build(good))
        argv = {"--slots": "4", "--chunk": "4"}
        for k, v in zip(flags[::2], flags[1::2]):
            argv[k] = v
        cmd = shlex.split(runner) + ["trellis", "--input", inp, "--output", out]
        for k, v in argv.items():
            if v is not None:
                cmd += [k, v]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        text = r.stdout + r.stderr
        ok = r.returncode == 2 and all(e in text for e in expect) and not os.path.exists(out)
        first = text.strip().splitlines()[0] if text.strip() else "(no output)"
        print(f"{'PASS' if ok else 'FAIL'} bad input, {name}: exit {r.returncode}: {first}"
              + ("" if ok else f" | expected exit 2 and {expect}"), flush=True)
        res.append(ok)
    return res


def self_test(seed):
    """Checks of the reference itself (spec §8): VJPs, C = 1, matrix form vs loop, the worked example."""
    rng = np.random.default_rng(seed)
    results = []

    def check(name, ok, info=""):
        results.append(bool(ok))
        print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + info if info else ''}", flush=True)

    # 1. VJP closed forms = finite differences of <phi(z), e>
    for phi in PHIS:
        worst = 0.0
        for m in (1, 2, 5, 9):
            z, e = 1.5 * rng.standard_normal(m), rng.standard_normal(m)
            h, fd = 1e-6, np.zeros(m)
            for j in range(m):
                dz = np.zeros(m)
                dz[j] = h
                fd[j] = (tr.phi_fn(phi, z + dz) @ e - tr.phi_fn(phi, z - dz) @ e) / (2 * h)
            worst = max(worst, float(np.max(np.abs(tr.vjp(phi, z, e) - fd) / (1 + np.abs(fd)))))
        check(f"VJP of {phi} = finite differences", worst < 1e-7, f"worst {worst:.1e}")

    def rand_head(T, D, Dv, m, zero_beta=0, zero_gamma=0):
        def unit(x):
            return x / np.linalg.norm(x, axis=-1, keepdims=True)
        q, k, v = unit(rng.standard_normal((T, D))), unit(rng.standard_normal((T, D))), unit(
            rng.standard_normal((T, Dv)))
        g = [rng.uniform(0.6, 1.0, T), rng.uniform(0.05, 0.6, T), rng.uniform(0.6, 1.0, T),
             rng.uniform(0.05, 0.6, T)]
        if zero_beta:
            g[0][zero_beta - 1::zero_beta] = 0
            g[2][zero_beta - 1::zero_beta] = 0
        if zero_gamma:
            g[1][zero_gamma - 1::zero_gamma] = 0
            g[3][zero_gamma - 1::zero_gamma] = 0
        return (q, k, v, 0.7 * rng.standard_normal((T, m)), *g)

    def close(a, b, tol=1e-11):
        return all(x.shape == y.shape and (x.size == 0 or np.max(np.abs(x - y)) <= tol * max(1, np.max(np.abs(y))))
                   for x, y in zip(a, b))

    # 2. chunk form with C = 1 = recurrence, zero and non-zero initial state; 3. matrix form = loop
    bad2 = bad3 = 0
    for i in range(60):
        phi, f = PHIS[i % 5], tr.FS[(i // 5) % 4]
        T = int(rng.integers(0, 30))
        args = rand_head(T, 6, 5, int(rng.choice([1, 3, 4])), zero_beta=int(rng.choice([0, 2, 3])),
                         zero_gamma=int(rng.choice([0, 2, 3])))
        m = args[3].shape[1]
        init = {} if i % 2 else dict(M1=0.5 * rng.standard_normal((m, 6)), M2=0.5 * rng.standard_normal((m, 5)))
        rec = tr.trellis_forward(*args, m=m, C=7, phi=phi, f=f, mode="recurrent", **init)
        bad2 += not close(tr.trellis_forward(*args, m=m, C=1, phi=phi, f=f, mode="chunk", **init), rec)
        bad2 += not close(tr.trellis_forward(*args, m=m, C=1, phi=phi, f=f, mode="loop", **init), rec, 0)
        for C in (2, 4, 5, max(T, 1), T + 3):
            bad3 += not close(tr.trellis_forward(*args, m=m, C=C, phi=phi, f=f, mode="chunk", **init),
                              tr.trellis_forward(*args, m=m, C=C, phi=phi, f=f, mode="loop", **init))
    check("chunk form with C = 1 = recurrence (60 random heads)", bad2 == 0, f"{bad2} mismatches")
    check("chunk matrix form = stale-gradient loop, C in {2,4,5,T,>T}", bad3 == 0, f"{bad3} mismatches")

    # 4. worked example (§3.3): pass-1 readouts, m = dk = 1, phi = identity
    def example(C, beta1_1=1.0, mode="chunk"):
        one = np.ones((3, 1))
        beta = np.ones(3)
        beta[1] = beta1_1
        r, _ = (tr.compress_chunk(np.zeros((1, 1)), one, one, one, beta, np.full(3, 0.25), "identity", C, False)
                if mode == "chunk" else
                tr.compress_recurrent(np.zeros((1, 1)), one, one, one, beta, np.full(3, 0.25), "identity", False))
        return r[:, 0].tolist()
    check("worked example C=1", example(1) == [0.5, 0.75, 0.875] == example(1, mode="recurrent"))
    check("worked example C=2", example(2) == [0.5, 1.0, 1.0])
    check("worked example C=3", example(3) == [0.5, 1.0, 1.5])
    check("worked example C=3, beta_1=0", example(3, 0.0) == [0.5, 0.5, 1.0])

    # 5. edge cases: T = 0 keeps the state; softmax with m = 1 only decays; identity = gated delta rule
    args = rand_head(0, 4, 3, 2)
    M1, M2 = rng.standard_normal((2, 4)), rng.standard_normal((2, 3))
    y, A, Bm = tr.trellis_forward(*args, m=2, C=4, M1=M1, M2=M2)
    check("T = 0", y.shape == (0, 3) and np.array_equal(A, M1) and np.array_equal(Bm, M2))
    args = rand_head(9, 4, 3, 1)
    M1, M2 = rng.standard_normal((1, 4)), rng.standard_normal((1, 3))
    _, A, Bm = tr.trellis_forward(*args, m=1, C=4, phi="softmax", mode="chunk", M1=M1, M2=M2)
    check("softmax with m = 1: the memory only decays",
          np.allclose(A, np.prod(args[4]) * M1, rtol=1e-13, atol=0) and
          np.allclose(Bm, np.prod(args[6]) * M2, rtol=1e-13, atol=0))
    q, k, v, al, b1, g1, b2, g2 = rand_head(12, 4, 3, 3)
    M = np.zeros((3, 4))
    for t in range(12):
        M = b1[t] * M - 2 * g1[t] * np.outer(M @ k[t] - al[t], k[t])
    _, A, _ = tr.trellis_forward(q, k, v, al, b1, g1, b2, g2, m=3, phi="identity", mode="recurrent")
    check("phi = identity is the gated delta rule", np.allclose(A, M, rtol=1e-13, atol=1e-14))
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runner", help="launcher command, invoked as RUNNER trellis --input ...")
    ap.add_argument("--cases", type=int, default=len(FIXED_CASES) + 25,
                    help=f"number of cases (the first {len(FIXED_CASES)} are fixed)")
    ap.add_argument("--seed", type=int, default=4321)
    ap.add_argument("--self-test", action="store_true", help="check the reference only")
    ap.add_argument("--no-errors", action="store_true", help="skip the bad-input cases")
    a = ap.parse_args()
    if a.self_test:
        res = self_test(a.seed)
    elif not a.runner:
        ap.error("--runner is required unless --self-test is given")
    else:
        rng = np.random.default_rng(a.seed)
        cases = [FIXED_CASES[i] if i < len(FIXED_CASES) else random_case(rng, i) for i in range(a.cases)]
        with tempfile.TemporaryDirectory() as tmp:
            res = [run_case(a.runner, n, c, rng, tmp) for n, c in cases]
            if not a.no_errors:
                res += run_error_cases(a.runner, tmp)
    print(f"{sum(res)} passed, {len(res) - sum(res)} failed")
    return 0 if all(res) else 1


if __name__ == "__main__":
    sys.exit(main())
