"""KVM's training form (kvmem.train.kvm.kvm_prefill) against the float64 reference (tests/reference/
kvm_reference.py) and the C++ memory (kvmem.KvmMemory, kvmem.ProportionalMemory) on the shapes of the C++
oracle cases (tests/unit/test_kvm_reference.cpp), every budget schedule; its gradients; its errors."""

import os
import sys

import numpy as np
import pytest
import torch

import kvmem
from kvmem.train.kvm import kvm_prefill, merge_gate

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "reference"))
import kvm_reference as ref  # noqa: E402

# (name, shape and memory arguments); the base case is the C++ oracle's: chunk 4, window 2 chunks, rope 3, 1 sink
BASE = dict(B=2, Hq=2, Hkv=1, T=40, D=8, Dv=6, chunk=4, window_chunks=2, rope_dims=3, sinks=1, max_rows=4,
            budget=kvmem.budget.Fixed(-1), rule="kvm", zero_values=False)
CASES = {
    "T < chunk": dict(T=3),
    "one token": dict(T=1),
    "T == window": dict(T=8),
    "no update yet": dict(T=12),
    "first update": dict(T=13),
    "T not a multiple of chunk": dict(T=37),
    "power-law": dict(T=60, max_rows=40, budget=kvmem.budget.PowerLaw(-1, 2.0, 0.5)),
    "saturating": dict(T=60, max_rows=40, budget=kvmem.budget.Saturating(-1, 24.0, 1)),
    "plateau": dict(T=60, max_rows=40, budget=kvmem.budget.Plateau(24.0)),
    "budget below chunk": dict(T=50, max_rows=4, budget=kvmem.budget.Fixed(2)),
    "fixed, three chunks of rows": dict(T=50, max_rows=12, budget=kvmem.budget.Fixed(9)),
    "power-law rounded down": dict(T=45, max_rows=40, budget=kvmem.budget.PowerLaw(3, 3.0, 0.5, 2)),
    "zero values": dict(T=40, zero_values=True),
    "GQA": dict(T=41, Hq=4, Hkv=2),
    "no sinks": dict(T=41, Hq=3, Hkv=3, sinks=0),
    "three sinks": dict(T=41, sinks=3),
    "no rope channels": dict(T=41, rope_dims=0),
    "every channel rope": dict(T=41, rope_dims=8),
    "chunk 1": dict(T=30, chunk=1, window_chunks=1, sinks=0, max_rows=8, budget=kvmem.budget.PowerLaw(-1, 1.0, 0.5)),
    "chunk 3, window 3 chunks": dict(T=35, chunk=3, window_chunks=3, max_rows=9),
    "wider heads": dict(T=70, D=16, Dv=12, chunk=8, rope_dims=8, Hq=4, Hkv=2, max_rows=24,
                        budget=kvmem.budget.PowerLaw(-1, 2.0, 0.5)),
    "proportional": dict(T=50, rule="proportional", rope_dims=0, max_rows=12, budget=kvmem.budget.Fixed(9)),
}
SCHEDULE = {"fixed": "fixed", "power-law": "power_law", "saturating": "saturation", "plateau": "saturation"}


def make(name, dtype=torch.float64, seed=7):
    c = dict(BASE, **CASES[name])
    g = torch.Generator().manual_seed(seed)
    B, Hq, Hkv, T, D, Dv = (c[x] for x in ("B", "Hq", "Hkv", "T", "D", "Dv"))
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    t = dict(q=r(B, Hq, T, D), k=r(B, Hkv, T, D), v=r(B, Hkv, T, Dv), gate=r(B, Hkv, T),
             ln_weight=1 + 0.2 * r(D), ln_bias=0.2 * r(D), tau_state=0.5 + torch.rand(Hq, generator=g, dtype=torch.float64),
             tau_window=0.5 + torch.rand(Hq, generator=g, dtype=torch.float64))
    if c["zero_values"]:
        t["v"][:, :, ::3] = 0.0
    if c["rule"] == "proportional":  # kvmem.ProportionalMemory has no learned weights: the neutral ones
        t.update(gate=None, ln_weight=None, ln_bias=None, tau_state=None, tau_window=None)
    t = {k: None if x is None else x.to(dtype) for k, x in t.items()}
    args = {k: c[k] for k in ("chunk", "window_chunks", "rope_dims", "sinks", "max_rows", "budget", "rule")}
    return c, t, args


def reference(c, t, b):
    """The float64 reference's prefill of sequence b."""
    s = c["budget"]
    p = dict(chunk=c["chunk"], window_chunks=c["window_chunks"], rope_dims=c["rope_dims"], sinks=c["sinks"],
             schedule=SCHEDULE[s.kind], max_chunks=c["max_rows"] // c["chunk"], rule=c["rule"],
             min_len=getattr(s, "min_rows", -1), round_down=getattr(s, "round_down", 1))
    if s.kind == "power-law":
        p.update(growth_factor=s.growth_factor, growth_exponent=s.growth_exponent)
    elif s.kind in ("saturating", "plateau"):
        p.update(saturation_n=getattr(s, "saturation_n", getattr(s, "n", None)))
    D, Hq, Hkv, T = c["D"], c["Hq"], c["Hkv"], c["T"]
    one = lambda x, n, fill: np.full(n, fill) if x is None else x.numpy()  # noqa: E731
    z = np.zeros((Hkv, T)) if t["gate"] is None else t["gate"][b].numpy()
    return ref.kvm_prefill(t["q"][b].numpy(), t["k"][b].numpy(), t["v"][b].numpy(), z, one(t["ln_weight"], D, 1.0),
                           one(t["ln_bias"], D, 0.0), one(t["tau_state"], Hq, 1.0), one(t["tau_window"], Hq, 1.0), p)


@pytest.mark.parametrize("name", CASES)
def test_float64_equals_the_reference(name):
    c, t, args = make(name)
    out = kvm_prefill(**t, **args)
    for b in range(c["B"]):
        y, keys, values, radius, rows = reference(c, t, b)
        assert out.rows == rows
        for got, want in ((out.y[b], y), (out.keys[b], keys), (out.values[b], values), (out.radius[b], radius)):
            np.testing.assert_allclose(got.detach().numpy(), want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", CASES)
def test_float32_equals_the_cpp_memory(name):
    c, t, args = make(name, torch.float32)
    shape = dict(batch=c["B"], chunk=c["chunk"], window_chunks=c["window_chunks"], sinks=c["sinks"],
                 max_rows=c["max_rows"], budget=c["budget"], value_dim=c["Dv"])
    if c["rule"] == "proportional":
        mem = kvmem.ProportionalMemory(c["D"], c["Hq"], c["Hkv"], **shape)
        y = mem.prefill(t["q"], t["k"], t["v"])
    else:
        mem = kvmem.KvmMemory(c["D"], c["Hq"], c["Hkv"], rope_dims=c["rope_dims"], ln_weight=t["ln_weight"],
                              ln_bias=t["ln_bias"], tau_state=t["tau_state"], tau_window=t["tau_window"], **shape)
        y = mem.prefill(t["q"], t["k"], t["v"], t["gate"])
    out = kvm_prefill(**t, **args)
    state = mem.state()
    assert state["rows"] == [out.rows] * c["B"]
    torch.testing.assert_close(out.y, y, rtol=1e-4, atol=2e-5)
    M = out.rows
    torch.testing.assert_close(out.keys, state["keys"][:, :, :M], rtol=1e-4, atol=2e-5)
    torch.testing.assert_close(out.values, state["values"][:, :, :M], rtol=1e-4, atol=2e-5)
    scalar = "counts" if c["rule"] == "proportional" else "radius"
    torch.testing.assert_close(getattr(out, scalar), state[scalar][:, :, :M], rtol=1e-4, atol=2e-5)


def test_gradients_match_finite_differences():
    c, t, args = make("GQA", seed=3)
    t = {k: x.clone().requires_grad_(True) for k, x in t.items()}
    args.update(max_rows=8, budget=kvmem.budget.Fixed(6))
    names = list(t)

    def f(*xs):
        return kvm_prefill(**dict(zip(names, xs)), **args).y

    assert torch.autograd.gradcheck(f, tuple(t[n] for n in names), eps=1e-6, atol=1e-6, fast_mode=True)


def test_every_learned_weight_gets_a_gradient():
    """A training-sized layer (SmolLM2-135M's heads, 1/8 of 2,048 tokens): the loss reaches every weight, the
    gate from the neutral z = 0 included (ELU's derivative there is 1)."""
    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, T, D = 1, 9, 3, 512, 64
    t = dict(q=torch.randn(B, Hq, T, D, generator=g), k=torch.randn(B, Hkv, T, D, generator=g),
             v=torch.randn(B, Hkv, T, D, generator=g), gate=torch.zeros(B, Hkv, T), ln_weight=torch.ones(D),
             ln_bias=torch.zeros(D), tau_state=torch.ones(Hq), tau_window=torch.ones(Hq))
    for x in t.values():
        x.requires_grad_(True)
    out = kvm_prefill(**t, chunk=16, window_chunks=1, rope_dims=0, sinks=1, max_rows=64, budget=kvmem.budget.Fixed(48))
    assert out.rows == 48
    out.y.square().mean().backward()
    for name, x in t.items():
        assert torch.isfinite(x.grad).all(), name
        assert x.grad.abs().sum() > 0, name


def test_merge_gate_is_one_plus_elu():
    z = torch.tensor([-30.0, -1.0, 0.0, 0.5, 3.0], dtype=torch.float64)
    want = torch.where(z > 0, 1 + z, torch.exp(z))
    torch.testing.assert_close(merge_gate(z), want, rtol=0, atol=1e-15)


@pytest.mark.parametrize("change, message", [
    (dict(q="not a tensor"), "q = str"),
    (dict(k=torch.zeros(2, 1, 39, 8, dtype=torch.float64)), "k.shape = (2, 1, 39, 8)"),
    (dict(v=torch.zeros(2, 1, 40, 6, dtype=torch.float32)), "v.dtype = torch.float32"),
    (dict(q=torch.zeros(2, 3, 40, 8, dtype=torch.float64), k=torch.zeros(2, 2, 40, 8, dtype=torch.float64),
          v=torch.zeros(2, 2, 40, 6, dtype=torch.float64), gate=None, tau_state=None, tau_window=None), "q heads = 3"),
    (dict(gate=torch.zeros(2, 1, 41, dtype=torch.float64)), "gate.shape = (2, 1, 41)"),
    (dict(tau_state=torch.ones(3, dtype=torch.float64)), "tau_state.shape = (3,)"),
    (dict(chunk=0), "chunk = 0"),
    (dict(sinks=-1), "sinks = -1"),
    (dict(rope_dims=9), "rope_dims = 9"),
    (dict(rule="mean"), "rule = 'mean'"),
    (dict(budget="fixed"), "budget = 'fixed'"),
    (dict(sinks=4), "sinks = 4"),
])
def test_bad_input_names_the_argument(change, message):
    c, t, args = make("first update")
    kwargs = {**t, **args, **change}
    with pytest.raises((TypeError, ValueError), match=message.replace("(", r"\(").replace(")", r"\)")):
        kvm_prefill(**kwargs)
