#!/usr/bin/env python3
"""kvmem-run with trained weights files (--weights FILE [--layer L]; tools/kvmem_run/trained_inputs.hpp and
include/kvmem/io/memory_weights.hpp), against the same run on an input whose parameters were replaced by hand:

- kvm: the gate z = x . W_g of the input's attention input x, the LayerNorm affine and both temperatures of
  the chosen layer (from the input's metadata 'layer', or --layer) give the output and state of the input
  holding them, in prefill and decode; another layer gives another output;
- ovq: the trained beta gives the output of the input holding it;
- kvm with low-rank adapters: taken only for an input captured with them (its metadata adapters_sha256 is the
  file's tensors_sha256), and then the file's memory tensors give what the file without adapters gives;
- evict --scorer kvpop: a weights file of memory kvpop gives, bit for bit, what its layer's tensors give as a
  file of one layer;
- bad files and options exit 2 with the tensor, the metadata key or the option named.

  python3 weights_roundtrip.py --runner PATH/TO/kvmem-run
Prints one line per check and a final line "N passed, M failed"; exits 1 on failure.
"""
import argparse
import os
import shlex
import subprocess
import sys
import tempfile

import numpy as np

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "reference")]
import eviction_reference as er  # noqa: E402
import safetensors_np as stn  # noqa: E402
import weights_np as wn  # noqa: E402

B, HQ, HKV, T, D, HIDDEN = 2, 4, 2, 40, 8, 12
KVM_ARGS = ["--chunk", "8", "--window-chunks", "2", "--rope-dims", "0", "--sinks", "1", "--budget", "fixed",
            "--min-rows", "12", "--max-chunks", "2"]


def kvm_input(rng, with_x=True, layer="1"):
    f = np.float32
    t = dict(q=rng.standard_normal((B, HQ, T, D)).astype(f), k=rng.standard_normal((B, HKV, T, D)).astype(f),
             v=rng.standard_normal((B, HKV, T, D)).astype(f), gate=np.zeros((B, HKV, T), f),
             ln_weight=np.ones(D, f), ln_bias=np.zeros(D, f), tau_state=np.ones(HQ, f), tau_bswa=np.ones(HQ, f),
             lengths=np.array([T, 29], np.int64))
    if with_x:
        t["x"] = rng.standard_normal((B, T, HIDDEN)).astype(f)
    meta = {"source_model": "tiny-test"}
    if layer is not None:
        meta["layer"] = layer
    return t, meta


class Run:
    def __init__(self, runner, tmp):
        self.runner, self.tmp, self.n = shlex.split(runner), tmp, 0

    def __call__(self, command, tensors, meta, *args):
        """Writes the input, runs `command`, returns (exit status, stderr, output tensors or None)."""
        self.n += 1
        inp, out = (os.path.join(self.tmp, f"{w}{self.n}.safetensors") for w in ("in", "out"))
        stn.save(inp, tensors, meta)
        r = subprocess.run(self.runner + [command, "--input", inp, "--output", out] + [str(a) for a in args],
                           capture_output=True, text=True, timeout=300)
        return r.returncode, r.stderr, (stn.load(out) if r.returncode == 0 else None)


def same(a, b, tol):
    """Every tensor of a in b with the same shape, max |a - b| <= tol * max(1, max |a|)."""
    if a is None or b is None or set(a) != set(b):
        return False
    return all(a[n].shape == b[n].shape and np.max(np.abs(a[n].astype(np.float64) - b[n].astype(np.float64)),
                                                    initial=0.0) <= tol * max(1.0, float(np.max(np.abs(a[n]), initial=0.0)))
               for n in a)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runner", required=True, help="kvmem-run binary")
    a = ap.parse_args()
    passed = failed = 0

    def check(name, ok, detail=""):
        nonlocal passed, failed
        passed, failed = passed + bool(ok), failed + (not ok)
        print(f"{'PASS' if ok else 'FAIL'} {name}" + ("" if ok else f" | {detail[:400]}"), flush=True)

    rng = np.random.default_rng(7)
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        run = Run(a.runner, tmp)
        path = lambda name: os.path.join(tmp, name)  # noqa: E731
        shape = wn.shape_of(2, HIDDEN, HQ, HKV, D)
        layers = {i: wn.random_layer(rng, "kvm", shape) for i in range(2)}
        wn.save(path("kvm.safetensors"), "kvm", shape, layers)
        t, meta = kvm_input(rng)

        # 1. KVM: the weights file's layer == the input holding its parameters (prefill and decode).
        for mode in ("prefill", "decode"):
            rc, err, got = run("kvm", t, meta, "--weights", path("kvm.safetensors"), "--mode", mode, *KVM_ARGS)
            rc2, err2, want = run("kvm", wn.apply_kvm(t, layers[1]), meta, "--mode", mode, *KVM_ARGS)
            check(f"kvm {mode}: --weights (layer 1 from the input's metadata) == the input holding layer 1's parameters",
                  rc == 0 and rc2 == 0 and same(want, got, 1e-6), err + err2)
        rc, err, got0 = run("kvm", t, meta, "--weights", path("kvm.safetensors"), "--layer", "0", *KVM_ARGS)
        _, _, want0 = run("kvm", wn.apply_kvm(t, layers[0]), meta, *KVM_ARGS)
        _, _, neutral = run("kvm", t, meta, *KVM_ARGS)
        check("kvm: --layer 0 == layer 0's parameters, and differs from the neutral input's output",
              rc == 0 and same(want0, got0, 1e-6) and not same(neutral, got0, 1e-3), err)

        # 1b. A file with low-rank adapters applies to a layer captured with them on (metadata adapters_sha256 =
        #     the file's tensors_sha256): its memory tensors act as those of the file without adapters.
        ashape = wn.shape_of(2, HIDDEN, HQ, HKV, D, 2)
        one = lambda *shape: np.ones(shape, np.float32)  # noqa: E731
        alayers = {i: dict(l, q_adapter_down=one(2, HIDDEN), q_adapter_up=one(HQ * D, 2), k_adapter_down=one(2, HIDDEN),
                           k_adapter_up=one(HKV * D, 2)) for i, l in layers.items()}
        wn.save(path("kvm_adapters.safetensors"), "kvm", ashape, alayers, metadata={"tensors_sha256": "t1"})
        _, _, plain = run("kvm", t, meta, "--weights", path("kvm.safetensors"), *KVM_ARGS)
        rc, err, got = run("kvm", t, dict(meta, adapters_sha256="t1"), "--weights", path("kvm_adapters.safetensors"),
                           *KVM_ARGS)
        check("kvm: adapters on a layer captured with them (adapters_sha256 = the file's tensors_sha256) == the file "
              "without adapters", rc == 0 and same(plain, got, 0), err)
        for name, m in [("no adapters_sha256", meta), ("other adapters", dict(meta, adapters_sha256="t2"))]:
            rc, err, _ = run("kvm", t, m, "--weights", path("kvm_adapters.safetensors"), *KVM_ARGS)
            check(f"kvm: adapters on an input captured with {name} -> exit 2 naming adapters_sha256",
                  rc == 2 and "adapters_sha256" in err and "causal_lm.py --adapters" in err, f"exit {rc}: {err}")

        # 2. OVQ: the trained beta.
        f = np.float32
        H = 3
        o = dict(q=rng.standard_normal((1, H, 30, D)).astype(f), k=rng.standard_normal((1, H, 30, D)).astype(f),
                 v=rng.standard_normal((1, H, 30, D)).astype(f), beta=np.ones(H, f))
        oshape = wn.shape_of(1, HIDDEN, H, H, D)
        olayers = {0: wn.random_layer(rng, "ovq", oshape)}
        wn.save(path("ovq.safetensors"), "ovq", oshape, olayers)
        ovq_args = ["--chunk", "4", "--max-centroids", "8"]
        rc, err, got = run("ovq", o, {"layer": "0"}, "--weights", path("ovq.safetensors"), *ovq_args)
        rc2, err2, want = run("ovq", dict(o, beta=olayers[0]["beta"]), {}, *ovq_args)
        check("ovq: --weights == the input holding the trained beta", rc == 0 and rc2 == 0 and same(want, got, 0), err + err2)

        # 3. KVPOP: a weights file of memory kvpop == its layer's tensors as a file of one layer (bit for bit).
        e = dict(q=rng.standard_normal((1, HQ, 50, D)).astype(f), k=rng.standard_normal((1, HKV, 50, D)).astype(f),
                 v=rng.standard_normal((1, HKV, 50, D)).astype(f))
        kvpop = {i: er.random_kvpop_weights(rng, HKV, D, D) for i in range(2)}
        wn.save(path("kvpop.safetensors"), "kvpop", shape, kvpop)
        stn.save(path("kvpop1.safetensors"), kvpop[1])
        ev_args = ["--scorer", "kvpop", "--sinks", "2", "--window", "8", "--top-k", "10"]
        rc, err, got = run("evict", e, {"layer": "1", "source_model": "tiny-test"}, "--weights", path("kvpop.safetensors"), *ev_args)
        rc2, err2, want = run("evict", e, {}, "--weights", path("kvpop1.safetensors"), *ev_args)
        check("evict kvpop: a weights file's layer 1 == that layer as a file of one layer, bit for bit",
              rc == 0 and rc2 == 0 and same(want, got, 0), err + err2)
        rc, err, _ = run("evict", e, {}, "--weights", path("kvpop1.safetensors"), "--layer", "1", *ev_args)
        check("evict kvpop: --layer with a file of one layer exits 2", rc == 2 and "--layer" in err, err)
        for name, w, m, message in [
                ("weights of another model", wn.save(path("kvpop_other.safetensors"), "kvpop", shape, kvpop,
                                                     model="another-model") or path("kvpop_other.safetensors"),
                 {"source_model": "tiny-test", "layer": "0"}, "another-model"),
                ("low-rank adapters", wn.save(path("kvpop_lora.safetensors"), "kvpop", wn.shape_of(2, HIDDEN, HQ, HKV, D, 2),
                                              kvpop) or path("kvpop_lora.safetensors"), {"layer": "0"}, "adapter_rank"),
                ("other kv-heads", wn.save(path("kvpop_heads.safetensors"), "kvpop", wn.shape_of(2, HIDDEN, HQ, 4, D),
                                           kvpop) or path("kvpop_heads.safetensors"), {"layer": "0"}, "shape.kv_heads"),
                ("a layer the file lacks", path("kvpop.safetensors"), {"layer": "7"}, "outside [0, 2)")]:
            rc, err, _ = run("evict", e, m, "--weights", w, *ev_args)
            check(f"evict kvpop: {name} -> exit 2 naming {message!r}", rc == 2 and message in err, f"exit {rc}: {err}")

        # 4. Bad files and options.
        def bad(name, memory, shape_, layers_, **meta_):
            wn.save(path(name), memory, shape_, layers_, metadata=meta_.get("metadata"), model=meta_.get("model", "tiny-test"))
            return path(name)

        short = {i: dict(l, ln_weight=l["ln_weight"][:D - 1]) for i, l in layers.items()}
        missing = {i: {n: x for n, x in l.items() if n != "tau_window"} for i, l in layers.items()}
        t_nox, meta_nox = kvm_input(rng, with_x=False)
        t_nolayer, meta_nolayer = kvm_input(rng, layer=None)
        t_hidden = dict(t, x=t["x"][:, :, :HIDDEN - 1])
        stn.save(path("plain.safetensors"), layers[0])
        cases = [
            ("an input without x", t_nox, meta_nox, ["--weights", path("kvm.safetensors")], "tensor 'x'"),
            ("x of another hidden size", t_hidden, meta, ["--weights", path("kvm.safetensors")], "tensor 'x' shape"),
            ("ovq weights to kvm", t, meta, ["--weights", path("ovq.safetensors")], "metadata memory"),
            ("weights of another model", t, meta,
             ["--weights", bad("other.safetensors", "kvm", shape, layers, model="another-model")], "another-model"),
            ("a layer the file lacks", t, meta, ["--weights", path("kvm.safetensors"), "--layer", "2"], "outside [0, 2)"),
            ("a misshapen tensor", t, meta, ["--weights", bad("short.safetensors", "kvm", shape, short)],
             "layers.1.ln_weight"),
            ("a missing tensor", t, meta, ["--weights", bad("missing.safetensors", "kvm", shape, missing)],
             "layers.1.tau_window"),
            ("other query heads", t, meta,
             ["--weights", bad("heads.safetensors", "kvm", wn.shape_of(2, HIDDEN, 8, HKV, D), layers)], "shape.query_heads"),
            ("low-rank adapters", t, meta,
             ["--weights", bad("adapters.safetensors", "kvm", wn.shape_of(2, HIDDEN, HQ, HKV, D, 2), layers)],
             "adapter_rank"),
            ("not a kvmem weights file", t, meta, ["--weights", path("plain.safetensors")], "metadata format"),
            ("no layer anywhere", t_nolayer, meta_nolayer, ["--weights", path("kvm.safetensors")], "--layer"),
            ("--layer without --weights", t, meta, ["--layer", "1"], "--layer"),
            ("--layer -1", t, meta, ["--weights", path("kvm.safetensors"), "--layer", "-1"], "--layer"),
            ("KVM's weights with --merge proportional", t, meta,
             ["--weights", path("kvm.safetensors"), "--merge", "proportional"], "--merge proportional"),
        ]
        for name, tens, m, args, message in cases:
            rc, err, _ = run("kvm", tens, m, *args, *KVM_ARGS)
            check(f"kvm: {name} -> exit 2 naming {message!r}", rc == 2 and message in err, f"exit {rc}: {err}")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
