#!/usr/bin/env python3
"""Round-trip test of `<runner> ovq` against the float64 OVQ reference (shared/spec/OVQ.md).

  python3 ovq_roundtrip.py --runner CMD [--cases N] [--seed S]   # CMD may contain arguments
  python3 ovq_roundtrip.py --self-test                          # reference-only checks

Each case writes random float32 (sometimes float64) inputs q, k [B,H,T,D], v [B,H,T,Dv], beta [H]
(and sometimes lengths [B] int64), runs
  CMD ovq --input IN --output OUT --mode prefill|decode --chunk C --max-centroids N
          [--budget plateau|min] [--normalize-centroids]
and compares y, centroid_keys, centroid_values, counts (float32) with the float64 reference
evaluated on the same (rounded) values: max|a-b| <= 1e-4 * max(1, max|ref|) per tensor;
centroid_rows (int64) exactly. Ends with the line `N passed, M failed`; exits 1 if anything failed.
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
from roundtrip_common import compare_tensors, report, run_modes  # noqa: E402
from ovq_reference import Dictionary, make_params, ovq_decode, ovq_prefill, ovq_sizes  # noqa: E402

TOL = 1e-4
CASE_DEFAULTS = dict(B=1, H=2, T=20, D=8, Dv=6, chunk=4, max_centroids=16, growth="plateau",
                     normalize=False, lengths=None, f64=False, dup=False, zeros=False,
                     omit_defaults=False)

FIXED_CASES = [
    ("T < chunk (empty dictionary, no commit)", dict(T=5, chunk=8)),
    ("T = 1", dict(T=1)),
    ("T = 0", dict(T=0)),
    ("T = chunk (one commit, first chunk seeding)", dict(T=8, chunk=8)),
    ("T not a multiple of chunk", dict(T=23, chunk=4)),
    ("spec sizes example C=4 N=6 T=14", dict(T=14, chunk=4, max_centroids=6, D=2, Dv=1)),
    ("chunk 1 (m=0 num_new=0 quirk)", dict(T=30, chunk=1, max_centroids=64)),
    ("chunk 1, min budget", dict(T=30, chunk=1, max_centroids=8, growth="min")),
    ("chunk 1, normalize", dict(T=25, chunk=1, max_centroids=5, normalize=True)),
    ("max-centroids 1 (plateau: never live)", dict(T=21, chunk=4, max_centroids=1)),
    ("max-centroids 1, min budget", dict(T=21, chunk=4, max_centroids=1, growth="min")),
    ("max-centroids 2", dict(T=30, chunk=2, max_centroids=2)),
    ("plateau saturating toward N", dict(T=130, chunk=4, max_centroids=8, H=1)),
    ("min budget reaches N", dict(T=45, chunk=4, max_centroids=10, growth="min")),
    ("min budget, num_new = C", dict(T=40, chunk=5, max_centroids=64, growth="min")),
    ("normalize-centroids", dict(T=41, chunk=4, normalize=True)),
    ("normalize-centroids, min budget", dict(T=41, chunk=3, normalize=True, growth="min")),
    ("duplicated keys (score and argmax ties)", dict(T=40, dup=True)),
    ("duplicated keys, normalize, chunk 3", dict(T=40, chunk=3, dup=True, normalize=True)),
    ("duplicated keys, min budget", dict(T=40, chunk=4, dup=True, growth="min")),
    ("beta 0, zero-norm q and k rows", dict(T=40, H=2, zeros=True)),
    ("chunk 16, D 16", dict(T=70, chunk=16, D=16, Dv=8, max_centroids=32)),
    ("default N 2048, chunk 8", dict(T=50, chunk=8, max_centroids=2048)),
    ("Dv != D, H = 4", dict(T=30, D=4, Dv=7, H=4)),
    ("H = 1, D = 1", dict(T=30, H=1, D=1, Dv=2)),
    ("ragged batch with a zero length", dict(B=3, T=29, lengths=[29, 0, 17])),
    ("ragged batch, lengths below one chunk", dict(B=3, T=13, chunk=4, lengths=[3, 13, 8])),
    ("all lengths zero", dict(B=2, T=3, lengths=[0, 0])),
    ("float64 inputs", dict(T=33, f64=True, H=3)),
    ("--budget omitted (plateau default)", dict(T=40, omit_defaults=True)),
]


def random_case(rng, i):
    C = [1, 2, 3, 4, 8, 16][i % 6]
    c = dict(chunk=C, max_centroids=int(rng.choice([1, 2, 3, 5, 8, 16, 64, 2048])),
             growth=["plateau", "min"][(i // 6) % 2], normalize=bool(rng.random() < 0.4),
             H=int(rng.integers(1, 5)), D=int(rng.choice([2, 4, 8, 16])),
             Dv=int(rng.choice([1, 3, 5, 8])), B=int(rng.integers(1, 4)),
             T=int(rng.integers(1, C + 1) if rng.random() < 0.15 else rng.integers(C, 12 * C + 40)),
             f64=bool(rng.random() < 0.15), dup=bool(rng.random() < 0.25),
             zeros=bool(rng.random() < 0.15), omit_defaults=bool(rng.random() < 0.3))
    if c["B"] > 1 and rng.random() < 0.7:
        c["lengths"] = [int(x) for x in rng.integers(0, c["T"] + 1, c["B"])]
        c["lengths"][0] = c["T"]
    return f"random #{i}", c


def full_case(overrides):
    return dict(CASE_DEFAULTS, **overrides)


def make_inputs(c, rng):
    B, H, T, D, Dv = (c[x] for x in ("B", "H", "T", "D", "Dv"))
    f = np.float32
    t = dict(q=rng.standard_normal((B, H, T, D)).astype(f),
             k=rng.standard_normal((B, H, T, D)).astype(f),
             v=rng.standard_normal((B, H, T, Dv)).astype(f),
             beta=rng.uniform(0.5, 2.0, H).astype(f))
    if c["dup"] and T > 1:  # repeated key tokens: exact ties in the seeding, topk and argmax
        for s in range(1, T):
            if rng.random() < 0.4:
                t["k"][:, :, s] = t["k"][:, :, s - 1 - rng.integers(0, min(s, 3))]
    if c["zeros"] and T:  # beta 0 for head 0; zero-norm q and k rows (khat = 0: similarity 0)
        t["beta"][0] = 0
        t["q"][:, :, rng.integers(0, T, max(1, T // 5))] = 0
        t["k"][:, :, rng.integers(0, T, max(1, T // 5))] = 0
        t["k"][:, :, 0] = 0  # first token of the first chunk: every sim0 ties at 0
    if c["f64"]:
        t = {n: a.astype(np.float64) for n, a in t.items()}
    if c["lengths"] is not None:
        t["lengths"] = np.array(c["lengths"], dtype=np.int64)
    return t


def params(c):
    return make_params(chunk=c["chunk"], max_centroids=c["max_centroids"], growth=c["growth"],
                       normalize_centroids=c["normalize"], count_bias=True)


def reference(c, t, near_ties=None):
    """The float64 reference's outputs; the gaps of its near-tie decisions go to `near_ties` (a list)."""
    p = params(c)
    B, H, T, D, Dv = (c[x] for x in ("B", "H", "T", "D", "Dv"))
    lens = c["lengths"] or [T] * B
    f = {n: a.astype(np.float64) for n, a in t.items() if n != "lengths"}
    y, per = np.zeros((B, H, T, Dv)), []
    for b, Tb in enumerate(lens):
        yb, K, V, n, m = ovq_prefill(f["q"][b, :, :Tb], f["k"][b, :, :Tb], f["v"][b, :, :Tb],
                                     f["beta"], p, near_ties)
        y[b, :, :Tb] = yb
        per.append((K, V, n, m))
    M = max([m for *_, m in per], default=0)
    out = dict(y=y, centroid_keys=np.zeros((B, H, M, D)), centroid_values=np.zeros((B, H, M, Dv)),
               counts=np.zeros((B, H, M)), centroid_rows=np.zeros((B, H), np.int64))
    for b, (K, V, n, m) in enumerate(per):
        out["centroid_keys"][b, :, :m], out["centroid_values"][b, :, :m] = K, V
        out["counts"][b, :, :m], out["centroid_rows"][b] = n, m
    return out


def tool_args(c):
    a = ["--chunk", c["chunk"], "--max-centroids", c["max_centroids"]]
    if not (c["omit_defaults"] and c["growth"] == "plateau"):
        a += ["--budget", c["growth"]]
    if c["normalize"]:
        a += ["--normalize-centroids"]
    return [str(x) for x in a]


def compare(exp, got):
    return compare_tensors(exp, got, TOL, {"centroid_rows": "I64"})


def exact(exp, got):
    """Bit equality of every output (the tolerance 0)."""
    return compare_tensors(exp, got, 0.0, {"centroid_rows": "I64"})


def run_case(runner, name, c, rng, tmp):
    """One case against the reference. Where the reference met a near-tie (a decision between scores
    equal in exact arithmetic, which float32 may decide the other way: duplicated keys with normalized
    rows), the tool's decode is compared bit for bit with its own prefill instead, and the counts' total
    with the reference's."""
    t = make_inputs(c, rng)
    near_ties = []
    exp = reference(c, t, near_ties)
    inp, out = os.path.join(tmp, "in.safetensors"), os.path.join(tmp, "out.safetensors")
    stn.save(inp, t)
    desc = (f"B={c['B']} H={c['H']} T={c['T']} lens={c['lengths']} D={c['D']} Dv={c['Dv']} "
            f"C={c['chunk']} N={c['max_centroids']} {c['growth']}"
            f"{' normalize' if c['normalize'] else ''}{' dup' if c['dup'] else ''}"
            f"{' zeros' if c['zeros'] else ''}{' f64' if c['f64'] else ''} "
            f"rows={exp['centroid_rows'].max() if exp['centroid_rows'].size else 0}")
    if not near_ties:
        problems, worst = run_modes(runner, "ovq", inp, out, tool_args(c), exp, compare)
        return report(name, desc, problems, worst)
    own = os.path.join(tmp, "prefill.safetensors")
    problems, _ = run_modes_once(runner, inp, own, tool_args(c))
    if not problems:
        mine = stn.load(own)
        if not np.array_equal(mine["counts"].sum(axis=-1), exp["counts"].sum(axis=-1)):
            problems.append(f"counts' total {mine['counts'].sum(axis=-1).tolist()} != "
                            f"{exp['counts'].sum(axis=-1).tolist()}")
        more, _ = run_modes(runner, "ovq", inp, out, tool_args(c), mine, exact)
        problems += more
    return report(name, desc + f" (near-tie in the reference, gap {min(near_ties):.1e}: decode == prefill "
                  "bit for bit, counts' total)", problems, 0.0)


def run_modes_once(runner, inp, out, args):
    """The tool's prefill output into `out`; (problems, None)."""
    cmd = shlex.split(runner) + ["ovq", "--input", inp, "--output", out, "--mode", "prefill"] + [str(x) for x in args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        return [f"prefill: exit {r.returncode}"], None
    return [], None


def self_test(seed):
    rng = np.random.default_rng(seed)
    results = []

    def check(name, ok, info=""):
        results.append(bool(ok))
        print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + info if info else ''}", flush=True)

    def close(a, b, tol=1e-12):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return a.shape == b.shape and (a.size == 0 or float(np.max(np.abs(a - b))) <= tol)

    # §3 sizes example and the plateau formula against exact integer arithmetic
    s = ovq_sizes(dict(chunk=4, max_centroids=6), 14)
    check("sizes example C=4 N=6 T=14 -> [0,2,3,4,4]", s == [0, 2, 3, 4, 4], f"{s}")
    ok = ovq_sizes(dict(chunk=4, max_centroids=6), 0) == [0]
    for C in (1, 2, 3, 7, 128, 256):
        for N in (1, 2, 3, 5, 64, 1024, 2048):
            T = 50 * C + 3
            sz, prev = ovq_sizes(dict(chunk=C, max_centroids=N), T), 0
            for c in range(1, len(sz)):
                t = min(T, c * C)
                prev = max(prev, min(t * N // (t + N), N))
                ok = ok and sz[c] == prev and sz[c] - sz[c - 1] <= C and sz[c] < N
            sz = ovq_sizes(dict(chunk=C, max_centroids=N, growth="min"), T)
            ok = ok and all(sz[c] == min(T, c * C, N) for c in range(len(sz)))
    check("sizes: plateau == integer formula, < N, num_new <= C; min(t, N)", ok)
    sb = ovq_sizes(dict(chunk=4, max_centroids=100, budget=lambda t: 0 if t < 8 else 30 - t), 30)
    check("sizes: custom budget (monotone, capped at +C per chunk)",
          sb == [0, 0, 4, 8, 12, 12, 12, 12, 12], f"{sb}")

    # §5 worked example
    d = Dictionary(6, 2, 1)
    a0 = d.commit(0, 2, np.array([[1, 0], [0, 1], [0.6, 0.8], [-1, 0]], float),
                  np.array([[1], [2], [3], [4]], float))
    ok0 = (a0.tolist() == [0, 0, 0, 1] and close(d.keys[:2], [[1.6 / 3, 0.6], [-1, 0]])
           and close(d.values[:2, 0], [2, 4]) and d.counts.tolist() == [3, 1, 0, 0, 0, 0])
    a1 = d.commit(2, 1, np.array([[1, 0], [0, -1], [-0.6, -0.8], [0.8, 0.6]], float),
                  np.array([[5], [6], [7], [8]], float))
    ok1 = (a1.tolist() == [0, 2, 1, 0] and close(d.keys[:3], [[0.68, 0.48], [-0.8, -0.4], [0, -1]])
           and close(d.values[:3, 0], [3.8, 5.5, 6]) and d.counts.tolist() == [5, 2, 1, 0, 0, 0]
           and not d.keys[3:].any() and not d.values[3:].any())
    check("worked example (Dk, Dv, counts after both chunks)", ok0 and ok1,
          f"Dk={d.keys[:3].round(4).tolist()} Dv={d.values[:3, 0].round(4).tolist()} "
          f"counts={d.counts[:3].tolist()}")

    def rand(H, T, D, Dv):
        return (rng.standard_normal((H, T, D)), rng.standard_normal((H, T, D)),
                rng.standard_normal((H, T, Dv)), rng.uniform(0.5, 2.0, H))

    def unit(x):
        return x / (np.linalg.norm(x, axis=-1, keepdims=True) + 1e-5)

    # T < C: plain causal attention over the chunk's own tokens, no dictionary
    q, k, v, beta = rand(2, 5, 4, 3)
    y, K, V, n, m = ovq_prefill(q, k, v, beta, dict(chunk=8, max_centroids=16))
    lg = np.einsum("htd,hsd->hts", unit(q), unit(k)) * (beta[:, None, None] * 2.0)
    lg = np.where(np.tril(np.ones((5, 5), bool)), lg, -np.inf)
    w = np.exp(lg - lg.max(-1, keepdims=True))
    check("T < C is causal attention within the chunk",
          m == 0 and K.shape == (2, 0, 4) and close(y, (w / w.sum(-1, keepdims=True)) @ v, 1e-14))

    # C = 1 quirk: token 0 is folded into row 0 before it is live; row 0 = mean of tokens 0, 1
    q, k, v, beta = rand(1, 2, 3, 2)
    y, K, V, n, m = ovq_prefill(q, k, v, beta, dict(chunk=1, max_centroids=50))
    check("m == 0, num_new == 0 quirk (C = 1)", m == 1 and n.tolist() == [[2.0]]
          and close(V[0, 0], v[0].mean(0)) and close(K[0, 0], unit(k[0]).mean(0)))
    y, K, V, n, m = ovq_prefill(*rand(2, 21, 3, 2), dict(chunk=4, max_centroids=1))
    check("N = 1 plateau: dictionary never live", m == 0 and K.shape == (2, 0, 3))

    # beta = 0: weights proportional to counts (centroids) and 1 (raw tokens)
    q, k, v, beta = rand(1, 11, 4, 2)
    beta[0] = 0
    p = dict(chunk=4, max_centroids=6)
    y = ovq_prefill(q, k, v, beta, p)[0]
    _, K, V, n, m = ovq_prefill(q[:, :8], k[:, :8], v[:, :8], beta, p)
    want = (n[0] @ V[0] + v[0, 8:].sum(0)) / (n[0].sum() + 3)
    check("beta = 0: weights are the counts", m == 3 and close(y[0, 10], want, 1e-14))

    # T = 0
    r = ovq_prefill(*rand(2, 0, 4, 3), dict(chunk=3, max_centroids=8))
    rd = ovq_decode(*rand(2, 0, 4, 3), dict(chunk=3, max_centroids=8))
    check("T = 0", r[0].shape == (2, 0, 3) and r[1].shape == (2, 0, 4) and r[4] == rd[4] == 0)

    # prefill == decode on random configurations
    worst, bad = 0.0, 0
    for i in range(300):
        C = int(rng.choice([1, 2, 3, 4, 5, 8, 16]))
        N = int(rng.choice([1, 2, 3, 4, 7, 16, 64, 2048]))
        T = int(rng.integers(0, C + 1 if i % 5 == 0 else 8 * C + 20))
        H, D, Dv = int(rng.integers(1, 4)), int(rng.integers(1, 7)), int(rng.integers(1, 5))
        q, k, v, beta = rand(H, T, D, Dv)
        if i % 3 == 0 and T > 2:  # duplicated keys: ties in seeding, new-row choice and argmax
            for t in range(1, T):
                if rng.random() < 0.4:
                    k[:, t] = k[:, t - 1 - rng.integers(0, min(t, 3))]
        if i % 7 == 0 and T > 1:
            beta[0], q[0, 0], k[0, 1] = 0.0, 0.0, 0.0
        p = dict(chunk=C, max_centroids=N, growth=["plateau", "min"][i % 2],
                 normalize_centroids=(i % 4) >= 2, count_bias=i % 9 != 0)
        if i % 10 == 0:
            p["budget"] = lambda t, C=C: 2 * C if (t // C) % 3 == 0 else t // 2
        r1, r2 = ovq_prefill(q, k, v, beta, p), ovq_decode(q, k, v, beta, p)
        ok = r1[4] == r2[4] == ovq_sizes(p, T)[T // C]
        for a_, b_ in zip(r1[:4], r2[:4]):
            if a_.shape != b_.shape or not np.all(np.isfinite(a_)):
                ok = False
            elif a_.size:
                e = np.max(np.abs(a_ - b_)) / max(1.0, np.max(np.abs(a_)))
                worst, ok = max(worst, e), ok and e <= 1e-12
        bad += not ok
    check("prefill == decode on 300 random configurations", bad == 0,
          f"{bad} mismatches, worst rel {worst:.2e}")

    # the harness's batch assembly: ragged lengths, padding, rows
    c = full_case(dict(B=3, T=13, chunk=4, lengths=[13, 0, 6]))
    t = make_inputs(c, rng)
    e = reference(c, t)
    check("harness: ragged batch reference", e["centroid_rows"].tolist() == [[6, 6], [0, 0], [3, 3]]
          and e["centroid_keys"].shape == (3, 2, 6, 8) and not e["y"][1].any()
          and not e["y"][2, :, 6:].any() and not e["counts"][2, :, 3:].any()
          and e["counts"][0].sum() == 2 * 12
          and tool_args(c) == ["--chunk", "4", "--max-centroids", "16", "--budget", "plateau"])
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runner", help="launcher command, invoked as RUNNER ovq --input ... ")
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
