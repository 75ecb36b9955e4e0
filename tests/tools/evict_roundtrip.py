#!/usr/bin/env python3
"""Round-trip test of `<runner> evict` against the float64 eviction reference (shared/spec/EVICTION.md).

  python3 evict_roundtrip.py --runner CMD [--cases N] [--seed S] [--only SUBSTRING]
  python3 evict_roundtrip.py --self-test          # the reference's own checks (eviction_reference.py)

Each case writes random float32 (sometimes float64) q, k, v (and for kvpop a random N(0, 0.3) weights
file), runs the tool in prefill and decode mode and compares with the reference evaluated on the same
float32-rounded values: y to max|a-b| <= 1e-4 * max(1, max|ref|), kept_positions, kept_rows and mask
exactly. Both modes must give the §1 decode state machine's answer (SnapKV: exact attention and the
one-shot selection; --tova-layer-mean: the original TOVA's layer mean, one shared set of kept positions
per sequence, eviction_reference.simulate_decode_tova_layer). Random inputs whose float64 decision gap
(runner-up vs evicted effective score, relative) is below 1e-5 are redrawn, since float32 cannot be expected to settle such near-ties; a
failing case lists the decisions of its reference with a gap below 1e-4 before the first divergence.
Bad inputs of `evict` are in cli_errors.py. Ends with `N passed, M failed`; exits 1 if anything failed.
"""
import argparse
import os
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "reference")]
import safetensors_np as stn  # noqa: E402
import eviction_reference as er  # noqa: E402
from roundtrip_common import compare_tensors, report, run_modes  # noqa: E402

TOL = 1e-4
NEAR = 1e-5          # redraw inputs whose reference has a decision gap below this (relative)
REDRAWS = 12
DTYPES = dict(y="F32", kept_positions="I64", kept_rows="I64", mask="U8")
CASE_DEFAULTS = dict(B=1, Hq=2, Hkv=2, T=40, D=8, Dv=6, s=2, w=4, k=6, scorer="knorm", lengths=None,
                     f64=False, wf64=False, n=1, norm="xlstm", h2o_norm=False, mask=False, dup=0.0,
                     theta=None, wscale=0.3, omit=False, tova_lm=False, ref_plain=False)

KP = dict(scorer="kvpop")
FIXED_CASES = [
    # streaming: every score ties, the newest wins
    ("streaming", dict(scorer="streaming", mask=True)),
    ("streaming k=0", dict(scorer="streaming", k=0, mask=True)),
    ("streaming GQA G=4 Hkv=1", dict(scorer="streaming", Hq=4, Hkv=1, T=30, s=1, w=3, k=5)),
    ("streaming s=0 w=1", dict(scorer="streaming", s=0, w=1, k=3, mask=True)),
    # knorm: static, ties from duplicated keys
    ("knorm", dict(mask=True)),
    ("knorm duplicated keys (ties)", dict(dup=0.5, T=60, k=8, mask=True)),
    ("knorm all keys equal (all ties)", dict(dup=1.0, T=30, mask=True)),
    ("knorm k=0", dict(k=0, mask=True)),
    ("knorm s >= T", dict(T=8, s=10, w=2, mask=True)),
    ("knorm w > T", dict(T=30, s=1, w=50, mask=True)),
    ("knorm s + w = T", dict(T=11, s=5, w=6, mask=True)),
    ("knorm s + w = T + 1", dict(T=11, s=6, w=6, k=3, mask=True)),
    ("knorm s + w = T - 1", dict(T=11, s=5, w=5, k=3, mask=True)),
    ("knorm G=1 Hkv=3", dict(Hq=3, Hkv=3, mask=True)),
    ("knorm G=4 Hkv=2", dict(Hq=8, Hkv=2, T=33, mask=True)),
    ("knorm B=3 ragged lengths", dict(B=3, T=37, lengths=[37, 0, 9], dup=0.3, mask=True)),
    ("knorm D=16 Dv=4", dict(D=16, Dv=4, mask=True)),
    ("knorm D=4 Dv=12", dict(D=4, Dv=12)),
    ("knorm float64 inputs", dict(f64=True, dup=0.3, mask=True)),
    ("knorm T=0", dict(T=0, mask=True)),
    ("knorm T=1", dict(T=1, mask=True)),
    ("knorm all lengths 0", dict(B=2, T=5, lengths=[0, 0], mask=True)),
    # H2O: raw sum over the group from insertion; normalised variant
    ("h2o", dict(scorer="h2o", T=50)),
    ("h2o G=4 Hkv=2", dict(scorer="h2o", Hq=8, Hkv=2, T=45, s=1, w=3, k=5)),
    ("h2o G=1 s=0 (original H2O mapping)", dict(scorer="h2o", Hq=2, Hkv=2, s=0, w=5, k=6, T=50)),
    ("h2o --h2o-normalize", dict(scorer="h2o", h2o_norm=True, Hq=4, Hkv=2, T=50)),
    ("h2o --h2o-normalize G=1", dict(scorer="h2o", h2o_norm=True, Hq=1, Hkv=1, s=1, w=2, k=4, T=40)),
    ("h2o B=2 ragged", dict(scorer="h2o", B=2, T=41, lengths=[41, 23], s=1, w=3, k=4)),
    ("h2o k=0", dict(scorer="h2o", k=0, T=20)),
    ("h2o s + w >= T", dict(scorer="h2o", T=9, s=3, w=7)),
    ("h2o T=0", dict(scorer="h2o", T=0)),
    ("h2o T=1", dict(scorer="h2o", T=1)),
    # TOVA: group mean of the previous query's row
    ("tova (original mapping s=0 w=1)", dict(scorer="tova", s=0, w=1, k=8, T=50)),
    ("tova G=4 Hkv=2", dict(scorer="tova", Hq=8, Hkv=2, s=2, w=3, k=6, T=45)),
    ("tova G=1 Hkv=3", dict(scorer="tova", Hq=3, Hkv=3, s=1, w=2, k=5, T=40)),
    ("tova B=3 ragged", dict(scorer="tova", B=3, T=35, lengths=[12, 35, 1], s=1, w=2, k=4)),
    ("tova k=0", dict(scorer="tova", k=0, T=20)),
    ("tova w > T", dict(scorer="tova", w=30, T=20)),
    ("tova T=1", dict(scorer="tova", T=1)),
    # TOVA --tova-layer-mean: mean over all Hq query heads, every kv-head evicts the same token
    ("tova --tova-layer-mean G=1 Hkv=2 B=2 ragged (original mapping s=0 w=1)",
     dict(scorer="tova", tova_lm=True, B=2, Hq=2, Hkv=2, T=45, lengths=[45, 28], s=0, w=1, k=8)),
    ("tova --tova-layer-mean G=2 Hkv=2 B=2 ragged",
     dict(scorer="tova", tova_lm=True, B=2, Hq=4, Hkv=2, T=40, lengths=[40, 17], s=2, w=3, k=6)),
    ("tova --tova-layer-mean G=1 Hkv=3 B=2 ragged",
     dict(scorer="tova", tova_lm=True, B=2, Hq=3, Hkv=3, T=38, lengths=[25, 38], s=1, w=2, k=5)),
    ("tova --tova-layer-mean G=2 Hkv=3 B=2 ragged (one length 0)",
     dict(scorer="tova", tova_lm=True, B=2, Hq=6, Hkv=3, T=42, lengths=[42, 0], s=1, w=2, k=5)),
    ("tova --tova-layer-mean Hkv=1 G=2 = plain tova (group-mean reference)",
     dict(scorer="tova", tova_lm=True, ref_plain=True, B=2, Hq=2, Hkv=1, T=40, lengths=[40, 31], s=1, w=2, k=6)),
    # KVPOP: delayed mLSTM scores, both normalisers, decay, n = 1 and n > 1
    ("kvpop xlstm n=1", dict(KP, T=60, mask=True)),
    ("kvpop plain n=1", dict(KP, T=60, norm="plain", mask=True)),
    ("kvpop defaults (no --normalizer, no --decay-interval)", dict(KP, T=50, omit=True, mask=True)),
    ("kvpop xlstm n=3", dict(KP, T=60, n=3, theta=-8.0, wscale=0.1)),
    ("kvpop plain n=3", dict(KP, T=60, n=3, norm="plain", theta=-8.0, wscale=0.1)),
    ("kvpop n=2 G=4", dict(KP, Hq=8, Hkv=2, T=50, n=2, theta=-6.0)),
    ("kvpop G=1 Hkv=3", dict(KP, Hq=3, Hkv=3, T=40, mask=True)),
    ("kvpop G=4 Hkv=2 B=3 ragged", dict(KP, B=3, Hq=8, Hkv=2, T=45, lengths=[45, 0, 20], mask=True)),
    ("kvpop float64 inputs and weights", dict(KP, f64=True, wf64=True, mask=True)),
    ("kvpop float32 inputs, float64 weights", dict(KP, wf64=True)),
    ("kvpop D=16 Dv=4", dict(KP, D=16, Dv=4, mask=True)),
    ("kvpop D=2 Dv=5 (h=1)", dict(KP, D=2, Dv=5, mask=True)),
    ("kvpop large weights (gates saturate, soft cap)", dict(KP, wscale=3.0, T=50, mask=True)),
    ("kvpop k=0", dict(KP, k=0, mask=True)),
    ("kvpop s >= T", dict(KP, T=6, s=8, mask=True)),
    ("kvpop w > T", dict(KP, T=20, w=25, mask=True)),
    ("kvpop w = 1", dict(KP, s=1, w=1, k=5, mask=True)),
    ("kvpop s + w = T", dict(KP, T=10, s=3, w=7, mask=True)),
    ("kvpop T=0", dict(KP, T=0, mask=True)),
    ("kvpop T=1", dict(KP, T=1, mask=True)),
    ("kvpop T=0 n=3", dict(KP, T=0, n=3)),
    ("kvpop long, strong decay (log γ ≈ log 0.999), n=1, mask",
     dict(KP, B=1, Hq=2, Hkv=1, T=1500, s=4, w=16, k=4, theta=-12.0, mask=True)),
    ("kvpop long, strong decay (log γ ≈ log 0.999), n=3",
     dict(KP, B=1, Hq=2, Hkv=1, T=3000, s=4, w=32, k=4, n=3, theta=-12.0)),
    ("kvpop long, weak decay (log γ ≈ log 0.999999), n=1",
     dict(KP, B=1, Hq=2, Hkv=1, T=3000, s=4, w=32, k=4, theta=12.0, norm="plain")),
    # SnapKV: one-shot selection after the prompt, y exact
    ("snapkv T <= C_max", dict(scorer="snapkv", s=0, w=4, k=20, T=20)),
    ("snapkv T = C_max", dict(scorer="snapkv", s=0, w=4, k=16, T=20)),
    ("snapkv T > C_max", dict(scorer="snapkv", s=0, w=8, k=16, T=60)),
    ("snapkv T = C_max + 1", dict(scorer="snapkv", s=0, w=8, k=16, T=25)),
    ("snapkv G=4 Hkv=2", dict(scorer="snapkv", s=0, Hq=8, Hkv=2, w=6, k=10, T=50)),
    ("snapkv G=1", dict(scorer="snapkv", s=0, Hq=2, Hkv=2, w=5, k=7, T=40)),
    ("snapkv B=3 ragged (one below C_max)", dict(scorer="snapkv", s=0, B=3, w=5, k=10, T=48, lengths=[48, 12, 30])),
    ("snapkv k=0", dict(scorer="snapkv", s=0, w=6, k=0, T=30)),
    ("snapkv prefix shorter than the pool kernel", dict(scorer="snapkv", s=0, w=8, k=1, T=11)),
    ("snapkv D=4 Dv=9", dict(scorer="snapkv", s=0, D=4, Dv=9, w=4, k=9, T=40)),
    ("snapkv T=0", dict(scorer="snapkv", s=0, T=0)),
    ("snapkv T=1", dict(scorer="snapkv", s=0, T=1)),
]


def random_case(rng, i):
    scorer = er.SCORERS[i % len(er.SCORERS)]
    G = int(rng.choice([1, 2, 4]))
    Hkv = int(rng.integers(1, 4))
    T = int(rng.integers(0, 70))
    c = dict(scorer=scorer, B=int(rng.integers(1, 4)), Hkv=Hkv, Hq=G * Hkv, T=T,
             D=int(rng.choice([2, 4, 8, 16])), Dv=int(rng.choice([3, 4, 8])),
             s=0 if scorer == "snapkv" else int(rng.integers(0, 6)), w=int(rng.integers(1, 11)),
             k=int(rng.integers(0, 13)), f64=bool(rng.random() < 0.15))
    if c["B"] > 1 and rng.random() < 0.5:
        c["lengths"] = [int(x) for x in rng.integers(0, T + 1, c["B"])]
        c["lengths"][0] = T
    if scorer == "knorm":
        c["dup"] = float(rng.choice([0.0, 0.3, 0.6]))
    if scorer == "h2o":
        c["h2o_norm"] = bool(rng.random() < 0.5)
    if scorer == "kvpop":
        c.update(n=int(rng.choice([1, 1, 2, 3])), norm=str(rng.choice(["xlstm", "plain"])),
                 wf64=bool(rng.random() < 0.2), theta=float(rng.choice([-12.0, 0.0, 12.0])))
    c["mask"] = scorer in er.MASK_SCORERS and c.get("n", 1) == 1 and rng.random() < 0.6
    return f"random #{i}", c


def make_inputs(c, rng):
    B, Hq, Hkv, T, D, Dv = (c[x] for x in ("B", "Hq", "Hkv", "T", "D", "Dv"))
    f = np.float32
    t = dict(q=rng.standard_normal((B, Hq, T, D)).astype(f), k=rng.standard_normal((B, Hkv, T, D)).astype(f),
             v=rng.standard_normal((B, Hkv, T, Dv)).astype(f))
    if c["dup"] and T > 1:   # exact copies of earlier keys: equal scores, settled by position
        for s in range(1, T):
            if rng.random() < c["dup"]:
                t["k"][:, :, s] = t["k"][:, :, int(rng.integers(0, s))] if c["dup"] < 1 else t["k"][:, :, 0]
    if c["f64"]:
        t = {n: a.astype(np.float64) for n, a in t.items()}
    if c["lengths"] is not None:
        t["lengths"] = np.array(c["lengths"], dtype=np.int64)
    w = None
    if c["scorer"] == "kvpop":
        w = er.random_kvpop_weights(rng, Hkv, D, Dv, scale=c["wscale"], theta=c["theta"],
                                    dtype=np.float64 if c["wf64"] else np.float32)
    return t, w


def reference(c, t, w):
    """The expected outputs and decision gap. ref_plain: the plain (group-mean) tova reference is the
    expectation, after checking that the layer-mean reference gives exactly the same kept positions and
    y to 1e-12 (Hkv = 1, where the two are the same policy)."""
    def ref(layer_mean):
        return er.evict_reference(t, c["scorer"], c["s"], c["w"], c["k"], weights=w, decay_interval=c["n"],
                                  normalizer=c["norm"], h2o_normalize=c["h2o_norm"], want_mask=c["mask"],
                                  check_mask=True, tova_layer_mean=layer_mean)
    if not c["ref_plain"]:
        return ref(c["tova_lm"])
    plain, lm = ref(False), ref(True)
    for n in ("kept_positions", "kept_rows"):
        if not np.array_equal(plain[0][n], lm[0][n]):
            raise AssertionError(f"reference: layer-mean {n} != plain tova {n} (Hkv = {c['Hkv']})")
    if plain[0]["y"].size and np.max(np.abs(plain[0]["y"] - lm[0]["y"])) > 1e-12:
        raise AssertionError("reference: layer-mean y != plain tova y")
    return plain


def tool_args(c, weights_path):
    a = ["--sinks", c["s"], "--window", c["w"], "--top-k", c["k"], "--scorer", c["scorer"]]
    if c["scorer"] == "kvpop":
        a += ["--weights", weights_path]
        if not (c["omit"] and c["n"] == 1):
            a += ["--decay-interval", c["n"]]
        if not (c["omit"] and c["norm"] == "xlstm"):
            a += ["--normalizer", c["norm"]]
    if c["h2o_norm"]:
        a.append("--h2o-normalize")
    if c["tova_lm"]:
        a.append("--tova-layer-mean")
    if c["mask"]:
        a.append("--mask")
    return [str(x) for x in a]


def _first_divergence(c, exp, got):
    """Per (b, kv head): the first query whose y rows differ beyond the tolerance, or None."""
    G = c["Hq"] // c["Hkv"]
    e, g = exp["y"], got["y"].astype(np.float64)
    scale = max(1.0, float(np.max(np.abs(e)))) if e.size else 1.0
    bad = np.abs(e - g).max(axis=-1) > TOL * scale                       # [B, Hq, T]
    first = {}
    for b in range(c["B"]):
        for h in range(c["Hkv"]):
            qs = np.flatnonzero(bad[b, h * G:(h + 1) * G].any(axis=0))
            if qs.size:
                first[b, h] = int(qs[0])
    return first


def compare_with_diagnostics(c, gap):
    def compare(exp, got):
        errs, worst = compare_tensors(exp, got, TOL, DTYPES)
        if not errs:
            return errs, worst
        details, divergence = [], {}
        shapes_ok = all(n in got and got[n].shape == exp[n].shape for n in exp)
        if shapes_ok and exp["y"].size:
            divergence = _first_divergence(c, exp, got)
            details += [f"y first differs at b={b} kv-head={h} q={qs}" for (b, h), qs in sorted(divergence.items())[:4]]
        if "kept_rows" in got and got["kept_rows"].shape == exp["kept_rows"].shape:
            for b in range(c["B"]):
                for h in range(c["Hkv"]):
                    n_e, n_g = int(exp["kept_rows"][b, h]), int(got["kept_rows"][b, h])
                    ke = exp["kept_positions"][b, h, :n_e].tolist()
                    gp = got.get("kept_positions")
                    ok = gp is not None and gp.ndim == 3 and gp.shape[:2] == (c["B"], c["Hkv"])
                    kg = gp[b, h, :n_g].tolist() if ok else None
                    if kg != ke and len(details) < 10:
                        if kg is None:
                            details.append(f"kept b={b} h={h}: rows {n_g}, want {n_e}")
                        else:
                            details.append(f"kept b={b} h={h}: tool {kg} ref {ke} (missing {sorted(set(ke) - set(kg))},"
                                           f" extra {sorted(set(kg) - set(ke))})")
        if c["mask"] and "mask" in got and got["mask"].shape == exp["mask"].shape:
            diff = np.argwhere(got["mask"] != exp["mask"])
            if diff.size:
                b, h, qi = (int(x) for x in diff[0][:3])
                row_e, row_g = np.flatnonzero(exp["mask"][b, h, qi]), np.flatnonzero(got["mask"][b, h, qi])
                details.append(f"mask first differs at b={b} h={h} q={qi}: tool {row_g.tolist()} ref {row_e.tolist()}")
        # near-ties of the float64 reference at or before the first divergence explain a flip
        # (layer mean: one decision per sequence, recorded with h = "all", precedes any kv-head's divergence)
        first = {}
        for (b, h), qs in divergence.items():
            first[b, h] = qs
            first[b, "all"] = min(qs, first.get((b, "all"), qs))
        near = [x for x in sorted(gap.near, key=lambda x: x[3]) if (x[1], x[2]) in first
                and x[3] <= first[x[1], x[2]]] if divergence else sorted(gap.near, key=lambda x: x[0])[:3]
        if near:
            details.append("float64 near-ties before the divergence: " + "; ".join(x[4] for x in near[:3]))
        else:
            details.append(f"no float64 near-tie involved (smallest decision gap {gap.rel:.2e}"
                           f"{': ' + gap.where if gap.where else ''})")
        return errs + details, worst
    return compare


def run_case(runner, name, c, rng, tmp):
    c = dict(CASE_DEFAULTS, **c)
    for redraw in range(REDRAWS):
        t, w = make_inputs(c, rng)
        exp, gap = reference(c, t, w)
        if gap.rel >= NEAR:
            break
    inp, out = os.path.join(tmp, "in.safetensors"), os.path.join(tmp, "out.safetensors")
    wpath = os.path.join(tmp, "weights.safetensors")
    stn.save(inp, t)
    if w is not None:
        stn.save(wpath, w)
    lg = ""
    if c["scorer"] == "kvpop":
        lg = " log γ=[" + ",".join(f"{x:.3g}" for x in er.log_gamma(w["theta"].astype(np.float64))) + "]"
    desc = (f"{c['scorer']} B={c['B']} Hq={c['Hq']} Hkv={c['Hkv']} T={c['T']} lens={c['lengths']} D={c['D']} "
            f"Dv={c['Dv']} s={c['s']} w={c['w']} k={c['k']}"
            + (f" n={c['n']} {c['norm']}{lg}" if c["scorer"] == "kvpop" else "")
            + (" normalize" if c["h2o_norm"] else "") + (" layer-mean" if c["tova_lm"] else "")
            + (" (ref: plain tova)" if c["ref_plain"] else "") + (" mask" if c["mask"] else "")
            + (f" dup={c['dup']}" if c["dup"] else "") + (" f64" if c["f64"] else "")
            + (" w64" if c["wf64"] else "") + f" rows={exp['kept_rows'].max() if exp['kept_rows'].size else 0}"
            + (f" gap={gap.rel:.1e}" if np.isfinite(gap.rel) else "")
            + (f" (redrawn {redraw}x for near-ties)" if redraw else "")
            + (" NEAR-TIE LEFT (no draw avoided it)" if gap.rel < NEAR else ""))
    problems, worst = run_modes(runner, "evict", inp, out, tool_args(c, wpath), exp,
                                compare_with_diagnostics(c, gap))
    return report(name, desc, problems, worst)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runner", help="launcher command, invoked as RUNNER evict --input ...")
    ap.add_argument("--cases", type=int, default=len(FIXED_CASES) + 24,
                    help=f"number of cases (the first {len(FIXED_CASES)} are fixed)")
    ap.add_argument("--seed", type=int, default=2718)
    ap.add_argument("--only", help="run only the cases whose name contains this")
    ap.add_argument("--self-test", action="store_true", help="check the reference only")
    a = ap.parse_args()
    if a.self_test:
        res = er.self_test()
    elif not a.runner:
        ap.error("--runner is required unless --self-test is given")
    else:
        rng = np.random.default_rng(a.seed)
        cases = [FIXED_CASES[i] if i < len(FIXED_CASES) else random_case(rng, i) for i in range(a.cases)]
        res = []
        with tempfile.TemporaryDirectory() as tmp:
            for i, (n, c) in enumerate(cases):
                crng = np.random.default_rng([a.seed, i])   # each case has its own stream: --only reproduces it
                if a.only is None or a.only in n:
                    res.append(run_case(a.runner, n, c, crng, tmp))
    print(f"{sum(res)} passed, {len(res) - sum(res)} failed")
    return 0 if all(res) else 1


if __name__ == "__main__":
    sys.exit(main())
