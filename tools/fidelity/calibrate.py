#!/usr/bin/env python3
"""Training-free calibration of KVM's and OVQ's learned scalars, per layer and head, from a short calibration
text captured with tools/capture/causal_lm.py (never the evaluation text).

  calibrate.py fit   --layers-dir CAL_DIR --output calibration.json [--fraction 1/8]
  calibrate.py apply --calibration calibration.json --input layer.safetensors --kvm OUT1 --ovq OUT2

`fit` sets, for each layer of CAL_DIR (layer<L>.safetensors, one sequence):

1. The state-key LayerNorm affine w_s, b_s [D] (spec KVM.md §2; one per layer, shared by heads), closed
   form: the per-channel least-squares fit of the raw key by its normalized form, k_c ~ w_c * xhat_c + b_c
   with xhat = (k - mean(k)) / sqrt(var(k) + 1e-5) over the D channels, pooled over the layer's kv-heads
   and tokens and weighted by the attention each key receives (so the attention sink, often a key of a
   small norm that takes most of a head's attention, is reproduced first). A state row then looks like a
   key of the model (its channel means and spread) instead of a unit-variance vector.
2. KVM's state temperature tau_s [Hq] (the window temperature tau_b stays 1: window keys are the model's
   own), by search: KVM fixed at --fraction of the calibration text with every tau_s in TAU_GRID, and each
   query head keeps the value with the lowest relative L2 error of its attention output against exact
   causal attention (heads do not interact: tau_s only scales a head's state logits). The search runs
   with the fitted affine and with the neutral one (1, 0); the layer keeps the one with the lower error,
   so calibration never raises the error on the calibration text.
3. OVQ's beta [Hq] (spec OVQ.md §2: logits beta * sqrt(D) * cos(q, k)), closed form then search: the
   model's logit q . k / sqrt(D) = |q| |k| cos / sqrt(D), so beta0 = mean|q| * mean|k| / D per head; then
   OVQ at --fraction with beta0 times each factor of BETA_GRID, per head the lowest error.

The merge-gate bias is left at 0: a constant gate g scales a merged row's key and value sums alike, and
LN_s and the radius read (rho * V / |V|) remove both scales, so a bias has no effect on a row that only
merges gated tokens. The JSON also reports each layer's error before and after, on the calibration text.

`apply` writes two calibrated copies of a captured layer for kvmem-eval: --kvm with ln_weight, ln_bias and
tau_state set (tau_bswa = 1), --ovq with tau_bswa = beta (kvmem-eval's OVQ reads beta from tau_bswa).

Errors (a missing directory or layer, a calibration text shorter than MIN_TOKENS tokens) print one line
naming the problem and exit with status 2.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "capture"))
sys.path.insert(0, HERE)
from capture import read_safetensors, write_safetensors  # noqa: E402

TAU_GRID = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0)
BETA_GRID = (0.5, 0.75, 1.0, 1.5, 2.0)
MIN_TOKENS = 512  # a 1/8 memory of fewer tokens has too few rows for the search to mean anything


class CalibrationError(Exception):
    """Bad input of calibrate.py; the CLI prints it and exits with status 2."""


def parse_fraction(s: str) -> float:
    """'1/8', '0.125' -> 0.125; raises CalibrationError naming --fraction."""
    try:
        v = float(s.split("/")[0]) / float(s.split("/")[1]) if "/" in s else float(s)
    except (ValueError, ZeroDivisionError):
        raise CalibrationError(f"--fraction {s!r}: not a fraction (write 1/8 or 0.125)")
    if not 0 < v <= 1:
        raise CalibrationError(f"--fraction {s!r}: must be in (0, 1]")
    return v


def ln_affine(k: np.ndarray, weight: np.ndarray, eps: float = 1e-5) -> tuple[np.ndarray, np.ndarray]:
    """Weighted least-squares w, b [D] with k ~ w * LN(k) + b per channel: k [..., D] (every leading index a
    sample), weight [...] >= 0 (the attention each key receives)."""
    x = k.reshape(-1, k.shape[-1]).astype(np.float64)
    a = weight.reshape(-1, 1).astype(np.float64) / weight.sum()
    xhat = (x - x.mean(1, keepdims=True)) / np.sqrt(x.var(1, keepdims=True) + eps)
    xm, km = (a * xhat).sum(0), (a * x).sum(0)
    var = (a * (xhat - xm) ** 2).sum(0)
    w = (a * (xhat - xm) * (x - km)).sum(0) / np.maximum(var, 1e-12)
    return w.astype(np.float32), (km - w * xm).astype(np.float32)


def attention_received(q: torch.Tensor, k: torch.Tensor, block: int = 512) -> np.ndarray:
    """[Hkv, T]: the causal softmax attention each key receives, summed over its query heads and queries
    (q [1, Hq, T, D], k [1, Hkv, T, D]), computed a block of queries at a time."""
    Hq, T, D = q.shape[1], q.shape[2], q.shape[3]
    G = Hq // k.shape[1]
    out = torch.zeros(k.shape[1], T, dtype=torch.float64)
    keys = k[0].repeat_interleave(G, 0)
    for b in range(0, T, block):
        e = min(T, b + block)
        s = q[0, :, b:e] @ keys[:, :e].transpose(1, 2) / D ** 0.5
        s = s.masked_fill(torch.arange(e)[None, :] > torch.arange(b, e)[:, None], float("-inf"))
        received = s.softmax(-1).double().sum(1).reshape(k.shape[1], G, e).sum(1)  # [Hkv, e]
        out[:, :e] += received
    return out.numpy()


def exact(q, k, v) -> torch.Tensor:
    """Exact causal attention, GQA: q [1, Hq, T, D], k, v [1, Hkv, T, D] -> [1, Hq, T, Dv]."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def head_errors(y: torch.Tensor, ref: torch.Tensor) -> np.ndarray:
    """Relative L2 error of each query head over its tokens, [Hq]."""
    return ((y - ref).square().sum((0, 2, 3)).sqrt() / ref.square().sum((0, 2, 3)).sqrt()).double().numpy()


def run_kvm(q, k, v, fraction, ln_weight=None, ln_bias=None, tau_state=None) -> torch.Tensor:
    """KVM fixed at `fraction` (lm_memories' sizing) over one captured sequence -> y [1, Hq, T, Dv]."""
    import lm_memories

    cal = None if ln_weight is None else {0: {"ln_weight": ln_weight, "ln_bias": ln_bias, "tau_state": tau_state}}
    mem = lm_memories.factory("kvm-fixed", q.shape[2], fraction, cal)(
        0, head_dim=q.shape[3], query_heads=q.shape[1], kv_heads=k.shape[1], value_dim=v.shape[3], batch=1)
    return mem.prefill(q, k, v)


def run_ovq(q, k, v, fraction, beta=None) -> torch.Tensor:
    """OVQ at `fraction` (lm_memories' sizing) over one captured sequence -> y [1, Hq, T, Dv]."""
    import lm_memories

    cal = None if beta is None else {0: {"beta": beta}}
    mem = lm_memories.factory("ovq", q.shape[2], fraction, cal)(
        0, head_dim=q.shape[3], query_heads=q.shape[1], kv_heads=k.shape[1], value_dim=v.shape[3], batch=1)
    return mem.prefill(q, k, v)


def pick(errors_by_value: dict[float, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Per head, the grid value with the lowest error (ties: the first in grid order), and that error."""
    values = list(errors_by_value)
    table = np.stack([errors_by_value[x] for x in values])  # [grid, Hq]
    best = table.argmin(0)
    return np.array([values[i] for i in best], np.float32), table[best, np.arange(table.shape[1])]


def fit_layer(path: str, fraction: float) -> dict:
    """The calibration of one captured layer (see the module docstring) with before/after errors."""
    t, _ = read_safetensors(path)
    T = int(t["lengths"][0]) if "lengths" in t else t["q"].shape[2]
    if T < MIN_TOKENS:
        raise CalibrationError(f"{path}: calibration text of {T} tokens; calibration needs at least {MIN_TOKENS}")
    q, k, v = (torch.from_numpy(np.array(t[n][:1, :, :T])) for n in ("q", "k", "v"))
    Hq, D, G = q.shape[1], q.shape[3], q.shape[1] // k.shape[1]
    ref = exact(q, k, v)
    kvm_before = head_errors(run_kvm(q, k, v, fraction), ref)
    received = attention_received(q, k)  # [Hkv, T]
    w, b = ln_affine(t["k"][0, :, :T], received)
    key_norms = k[0].norm(dim=-1).double()  # [Hkv, T]
    sink = {"attention_share": float(received[:, 0].sum() / (Hq * T)),
            "key_norm_ratio": float((key_norms[:, 0] / key_norms.mean(1)).mean())}
    ln_only = head_errors(run_kvm(q, k, v, fraction, w, b, np.ones(Hq, np.float32)), ref)
    searches = {}  # the tau search with the fitted LN_s affine and with the neutral one; the better is kept
    for name, (lw, lb) in (("fitted", (w, b)), ("neutral", (np.ones(D, np.float32), np.zeros(D, np.float32)))):
        tau, err = pick({x: head_errors(run_kvm(q, k, v, fraction, lw, lb, np.full(Hq, x, np.float32)), ref)
                         for x in TAU_GRID})
        searches[name] = (err.mean(), lw, lb, tau, err)
    ln_kind = min(searches, key=lambda n: searches[n][0])
    _, w, b, tau, kvm_after = searches[ln_kind]
    qn = q[0].norm(dim=-1).mean(-1).double().numpy()                        # [Hq]
    kn = k[0].norm(dim=-1).mean(-1).double().numpy().repeat(G)              # [Hq], kv-head of each query head
    beta0 = (qn * kn / D).astype(np.float32)
    ovq_before = head_errors(run_ovq(q, k, v, fraction), ref)
    factor, ovq_after = pick({x: head_errors(run_ovq(q, k, v, fraction, beta0 * x), ref) for x in BETA_GRID})
    return {"tokens": T, "sink": sink, "ln_affine": ln_kind, "ln_weight": w.tolist(), "ln_bias": b.tolist(), "tau_state": tau.tolist(),
            "beta": (beta0 * factor).tolist(), "beta_closed_form": beta0.tolist(),
            "errors": {"kvm_before": kvm_before.tolist(), "kvm_ln_only": ln_only.tolist(),
                       "kvm_after": kvm_after.tolist(), "ovq_before": ovq_before.tolist(),
                       "ovq_after": ovq_after.tolist()}}


def layer_files(directory: str) -> dict[int, str]:
    """{layer: path} of directory/layer<L>.safetensors; raises CalibrationError when there is none."""
    if not os.path.isdir(directory):
        raise CalibrationError(f"--layers-dir {directory!r}: does not exist")
    found = {int(re.search(r"layer(\d+)\.safetensors$", p).group(1)): p
             for p in glob.glob(os.path.join(directory, "layer*.safetensors"))}
    if not found:
        raise CalibrationError(f"--layers-dir {directory!r}: has no layer<L>.safetensors (capture it first)")
    return dict(sorted(found.items()))


def fit(args) -> None:
    fraction = parse_fraction(args.fraction)
    layers = {}
    for layer, path in layer_files(args.layers_dir).items():
        layers[str(layer)] = fit_layer(path, fraction)
        e = layers[str(layer)]["errors"]
        print(f"calibrate: layer {layer}: KVM rel L2 {np.mean(e['kvm_before']):.4f} -> {np.mean(e['kvm_after']):.4f}, "
              f"OVQ {np.mean(e['ovq_before']):.4f} -> {np.mean(e['ovq_after']):.4f}", flush=True)
    with open(args.output, "w") as f:
        json.dump({"fraction": fraction, "tau_grid": TAU_GRID, "beta_grid": BETA_GRID, "layers_dir": args.layers_dir,
                   "layers": layers}, f)


def load_calibration(path: str) -> dict[int, dict]:
    """{layer: {ln_weight, ln_bias, tau_state, beta, ...}} from a fit's JSON; raises CalibrationError."""
    try:
        with open(path) as f:
            return {int(k): v for k, v in json.load(f)["layers"].items()}
    except (OSError, ValueError, KeyError) as e:
        raise CalibrationError(f"--calibration {path!r}: not a calibrate.py fit ({e})")


def apply(args) -> None:
    cal = load_calibration(args.calibration)
    t, meta = read_safetensors(args.input)
    layer = int(meta.get("layer", -1))
    if layer not in cal:
        raise CalibrationError(f"--input {args.input!r}: layer {layer} is not in the calibration {args.calibration!r}")
    c = cal[layer]
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    kvm = dict(t, ln_weight=f32(c["ln_weight"]), ln_bias=f32(c["ln_bias"]), tau_state=f32(c["tau_state"]),
               tau_bswa=np.ones_like(t["tau_bswa"]))
    note = f"calibrated by tools/fidelity/calibrate.py from {args.calibration}"
    write_safetensors(args.kvm, kvm, dict(meta, neutral_parameters="none", calibration=note))
    write_safetensors(args.ovq, dict(t, tau_bswa=f32(c["beta"])),
                      dict(meta, neutral_parameters="gate, ln_*, tau_state (unused by OVQ)",
                           calibration=note + "; tau_bswa = OVQ beta"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("fit", help="calibrate every captured layer of a calibration text")
    p.add_argument("--layers-dir", required=True, help="directory of layer<L>.safetensors (tools/capture/causal_lm.py)")
    p.add_argument("--output", required=True, help="calibration JSON")
    p.add_argument("--fraction", default="1/8", help="memory fraction the search runs at (default 1/8)")
    p = sub.add_parser("apply", help="write calibrated copies of a captured layer for kvmem-eval")
    p.add_argument("--calibration", required=True)
    p.add_argument("--input", required=True)
    p.add_argument("--kvm", required=True, help="output: KVM's scalars set")
    p.add_argument("--ovq", required=True, help="output: tau_bswa = OVQ beta")
    args = ap.parse_args(argv)
    try:
        fit(args) if args.command == "fit" else apply(args)
    except (CalibrationError, ValueError) as e:
        print(f"calibrate: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
