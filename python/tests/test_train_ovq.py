"""kvmem.train.ovq (OVQ's training form) against the float64 reference tests/reference/ovq_reference.py
(float64 inputs, ~1e-10) and the C++ memory kvmem.OvqMemory (float32 inputs, within float32 rounding): outputs,
final dictionary (keys, values, counts, rows) and the dictionary sizes of every budget; gradients (gradcheck
on a tiny float64 case, finite gradients on a training-sized float32 case); errors naming the bad argument.
Spec: shared/spec/OVQ.md; ovq-paper Sec. 3.2 and App. 8.3."""

import math
import os
import sys

import numpy as np
import pytest
import torch

import kvmem
from kvmem import budget as budgets
from kvmem.train.ovq import OvqForward, dictionary_sizes, ovq_prefill

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "reference"))
import ovq_reference as ref  # noqa: E402

# (id, shape and schedule): B sequences, Hq query heads over Hkv kv-heads, T tokens, D key and Dv value channels,
# chunk C (tokens), N max_centroids (rows), budget (None: plateau), normalize_centroids, and the input quirks
# dup (repeated keys: exact ties in the seeding, the new-centroid order and the argmax; "chunk": copies of a key
# of the same chunk other than its first, "any": of any earlier token) and zeros (beta 0 for query head 0,
# zero-norm q and k rows, the first key zero: every seeding similarity ties at 0).
CASES = [
    ("T multiple of chunk, GQA", dict(B=2, Hq=4, Hkv=2, T=32, C=8, N=16)),
    ("T not a multiple, Hq = Hkv, normalize", dict(B=2, Hq=3, Hkv=3, T=37, C=4, N=16, normalize=True)),
    ("T < chunk (no commit)", dict(B=1, Hq=4, Hkv=2, T=5, C=8, N=16)),
    ("T = chunk (seeding only)", dict(B=1, Hq=2, Hkv=1, T=8, C=8, N=32)),
    ("plateau saturating toward N", dict(B=1, Hq=1, Hkv=1, T=130, C=4, N=8)),
    ("saturating budget, GQA, normalize", dict(B=2, Hq=4, Hkv=2, T=45, C=4, N=12, normalize=True,
                                                budget=budgets.Saturating(min_rows=2, saturation_n=10.0, round_down=2))),
    ("power-law budget, Hq = Hkv", dict(B=1, Hq=2, Hkv=2, T=40, C=5, N=64,
                                        budget=budgets.PowerLaw(min_rows=-1, growth_factor=1.5, growth_exponent=0.5))),
    ("fixed budget (grows by at most C)", dict(B=2, Hq=2, Hkv=1, T=30, C=4, N=8, budget=budgets.Fixed(6))),
    ("fixed -1 budget (row 0 never live)", dict(B=1, Hq=2, Hkv=2, T=13, C=4, N=8, budget=budgets.Fixed(-1))),
    ("chunk 1 (m == 0, num_new == 0 quirk), GQA", dict(B=1, Hq=2, Hkv=1, T=14, C=1, N=16)),
    ("chunk 1, normalize", dict(B=1, Hq=2, Hkv=2, T=12, C=1, N=5, normalize=True)),
    ("max_centroids 1 (plateau never live)", dict(B=1, Hq=2, Hkv=1, T=21, C=4, N=1)),
    ("keys repeated within chunks (ties), GQA", dict(B=2, Hq=4, Hkv=2, T=60, C=8, N=24, dup="chunk")),
    ("keys repeated within chunks, normalize, chunk 3", dict(B=1, Hq=2, Hkv=2, T=40, C=3, N=16, dup="chunk",
                                                              normalize=True)),
    ("keys repeated within chunks, chunk 16, D 16", dict(B=2, Hq=2, Hkv=2, T=99, C=16, N=48, D=16, Dv=4, dup="chunk")),
    ("beta 0 and zero-norm q, k", dict(B=1, Hq=2, Hkv=2, T=40, C=4, N=16, zeros=True)),
    ("Dv != D, wider head", dict(B=1, Hq=6, Hkv=2, T=70, C=16, N=32, D=16, Dv=5)),
]
# Keys repeated across chunks (or copies of a chunk's first token, which seeds row 0): a centroid that is the
# mean of several copies of a key x and one founded by another copy, x itself, are equal in exact arithmetic
# but not after rounding: the tie goes by rounding, and the float64 reference (incremental D += (x - D) / c_new,
# fsum dot products) rounds differently from the C++ memory ((c_old D + sum x) * (1 / c_new), float32 dots),
# whose arithmetic this training form follows. The reference reports these as near-ties (its NEAR_TIE), and
# tests/tools/ovq_roundtrip.py then compares counts' totals only. These cases run against the C++ memory only.
CPP_ONLY_CASES = [
    ("keys repeated across chunks, GQA", dict(B=2, Hq=4, Hkv=2, T=40, C=4, N=16, dup="any")),
    ("keys repeated across chunks, normalize, chunk 3", dict(B=1, Hq=2, Hkv=2, T=40, C=3, N=16, dup="any",
                                                              normalize=True)),
]
IDS = [name for name, _ in CASES]
CONFIGS = [c for _, c in CASES]


def make_inputs(cfg, dtype, seed=0):
    """q [B, Hq, T, D], k [B, Hkv, T, D], v [B, Hkv, T, Dv], beta [Hq] of `dtype` on kvmem's device; q, k and v
    are views of [B, T, H, C] tensors (channels contiguous, heads and tokens strided) as engines hold them."""
    B, Hq, Hkv, T = cfg["B"], cfg["Hq"], cfg["Hkv"], cfg["T"]
    D, Dv = cfg.get("D", 8), cfg.get("Dv", 6)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, T, Hkv, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, T, Hkv, Dv, generator=g, dtype=torch.float64)
    beta = 0.5 + 1.5 * torch.rand(Hq, generator=g, dtype=torch.float64)
    if cfg.get("dup"):  # token s copies one of the (up to 3) tokens before it ("chunk": of its chunk, not the first)
        pick = torch.rand(T, generator=g)
        for s in range(1, T):
            back = min(s, 3) if cfg["dup"] == "any" else max(0, min(s % cfg["C"] - 1, 3))
            if back and pick[s] < 0.5:
                k[:, s] = k[:, s - 1 - int(torch.randint(0, back, (1,), generator=g))]
    if cfg.get("zeros"):
        beta[0] = 0.0
        q[:, torch.randint(0, T, (T // 5,), generator=g)] = 0.0
        k[:, torch.randint(0, T, (T // 5,), generator=g)] = 0.0
        k[:, 0] = 0.0
    dev = kvmem.device()
    as_bhtc = lambda t: t.to(dtype=dtype, device=dev).transpose(1, 2)
    return as_bhtc(q), as_bhtc(k), as_bhtc(v), beta.to(dtype=dtype, device=dev)


def run(cfg, q, k, v, beta) -> OvqForward:
    return ovq_prefill(q, k, v, beta, chunk=cfg["C"], max_centroids=cfg["N"], budget=cfg.get("budget"),
                       normalize_centroids=cfg.get("normalize", False))


def reference(cfg, q, k, v, beta, b, h):
    """The float64 reference for query head h of sequence b (its kv-head h // G): y [T, Dv], keys [M, D],
    values [M, Dv], counts [M], M."""
    G = cfg["Hq"] // cfg["Hkv"]
    schedule = cfg.get("budget")
    p = ref.make_params(chunk=cfg["C"], max_centroids=cfg["N"], normalize_centroids=cfg.get("normalize", False),
                        count_bias=True, budget=None if schedule is None else schedule.rows)
    np64 = lambda t: t.detach().cpu().numpy().astype(np.float64)
    y, keys, values, counts, rows = ref.ovq_prefill(np64(q[b, h:h + 1]), np64(k[b, h // G:h // G + 1]),
                                                    np64(v[b, h // G:h // G + 1]), np64(beta[h:h + 1]), p)
    return y[0], keys[0], values[0], counts[0], rows


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_float64_matches_reference(cfg):
    q, k, v, beta = make_inputs(cfg, torch.float64)
    out = run(cfg, q, k, v, beta)
    B, Hq, Hkv, T = cfg["B"], cfg["Hq"], cfg["Hkv"], cfg["T"]
    assert out.y.shape == (B, Hq, T, v.shape[3]) and out.y.dtype == torch.float64
    assert out.keys.shape == (B, Hkv, out.rows, q.shape[3]) and out.counts.shape == (B, Hkv, out.rows)
    G = Hq // Hkv
    for b in range(B):
        for h in range(Hq):  # every query head of a kv-head sees the same dictionary (built without beta)
            y, keys, values, counts, rows = reference(cfg, q, k, v, beta, b, h)
            assert out.rows == rows
            np.testing.assert_allclose(out.y[b, h].cpu().numpy(), y, rtol=0, atol=1e-10)
            np.testing.assert_allclose(out.keys[b, h // G].cpu().numpy(), keys, rtol=0, atol=1e-10)
            np.testing.assert_allclose(out.values[b, h // G].cpu().numpy(), values, rtol=0, atol=1e-10)
            np.testing.assert_array_equal(out.counts[b, h // G].cpu().numpy(), counts)


@pytest.mark.parametrize("cfg", CONFIGS + [c for _, c in CPP_ONLY_CASES], ids=IDS + [n for n, _ in CPP_ONLY_CASES])
def test_float32_matches_cpp_memory(cfg):
    q, k, v, beta = make_inputs(cfg, torch.float32, seed=1)
    out = run(cfg, q, k, v, beta)
    assert out.y.dtype == torch.float32
    mem = kvmem.OvqMemory(q.shape[3], cfg["Hq"], cfg["Hkv"], value_dim=v.shape[3], batch=cfg["B"], chunk=cfg["C"],
                          max_centroids=cfg["N"], budget=cfg.get("budget"), beta=beta,
                          normalize_centroids=cfg.get("normalize", False))
    y = mem.prefill(q, k, v)
    state = mem.state()
    assert state["rows"] == [out.rows] * cfg["B"]
    M = out.rows
    torch.testing.assert_close(out.y, y, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out.keys.cpu(), state["keys"][:, :, :M], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out.values.cpu(), state["values"][:, :, :M], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out.counts.cpu(), state["counts"][:, :, :M], rtol=0, atol=0)


BUDGETS = [None, budgets.Plateau(40.0), budgets.Fixed(-1), budgets.Fixed(3), budgets.Fixed(100),
           budgets.Saturating(min_rows=5, saturation_n=30.0, round_down=4), budgets.PowerLaw(-1, 4.0, 0.5, 2),
           budgets.PowerLaw(2, 1.0, 1.0, 1)]


@pytest.mark.parametrize("schedule", BUDGETS, ids=repr)
@pytest.mark.parametrize("chunk, max_centroids", [(1, 2), (4, 6), (8, 40), (16, 7)])
def test_dictionary_sizes(schedule, chunk, max_centroids):
    """The C++ plan (kvmem::state::plan_update) and the reference's cap give the same sizes; the C++ memory ends
    with the last one (spec OVQ.md §3; 6 = the spec's example C = 4, N = 6, T = 14 -> 0, 2, 3, 4)."""
    T = 12 * chunk + 3
    sizes = dictionary_sizes(T, chunk=chunk, max_centroids=max_centroids, budget=schedule)
    p = ref.make_params(chunk=chunk, max_centroids=max_centroids, budget=None if schedule is None else schedule.rows)
    assert sizes == ref.ovq_sizes(p, T)[:T // chunk + 1]
    assert all(0 <= b - a <= chunk for a, b in zip(sizes, sizes[1:]))
    if (chunk, max_centroids, schedule) == (4, 6, None):
        assert dictionary_sizes(14, chunk=4, max_centroids=6) == [0, 2, 3, 4]
    dev = kvmem.device()
    mem = kvmem.OvqMemory(2, 1, 1, batch=1, chunk=chunk, max_centroids=max_centroids, budget=schedule)
    mem.prefill(*(torch.randn(1, 1, T, 2, device=dev) for _ in range(3)))
    assert mem.state()["rows"] == [sizes[-1]]


def test_empty_sequence():
    q, k, v = torch.zeros(2, 4, 0, 8), torch.zeros(2, 2, 0, 8), torch.zeros(2, 2, 0, 3)
    out = ovq_prefill(q, k, v, torch.ones(4), chunk=4, max_centroids=8)
    assert out.y.shape == (2, 4, 0, 3) and out.keys.shape == (2, 2, 0, 8) and out.values.shape == (2, 2, 0, 3)
    assert out.counts.shape == (2, 2, 0) and out.rows == 0


@pytest.mark.parametrize("normalize", [False, True], ids=["running-mean", "normalize"])
def test_gradcheck(normalize):
    """Analytic gradients of y, keys and values w.r.t. q, k, v and beta match finite differences (away from
    ties a perturbation of 1e-6 changes no decision). Three chunks: seeding, a commit with live rows, a tail."""
    g = torch.Generator().manual_seed(7)
    B, Hq, Hkv, T, D, Dv = 1, 2, 1, 11, 4, 3
    q = torch.randn(B, Hq, T, D, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, Hkv, T, D, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, Hkv, T, Dv, generator=g, dtype=torch.float64, requires_grad=True)
    beta = (0.5 + torch.rand(Hq, generator=g, dtype=torch.float64)).requires_grad_()

    def forward(q, k, v, beta):
        out = ovq_prefill(q, k, v, beta, chunk=4, max_centroids=8, normalize_centroids=normalize)
        assert out.rows == 4  # plateau N = 8 after 4 and 8 tokens: 2, then 4 rows: both commits create rows
        return out.y, out.keys, out.values

    assert torch.autograd.gradcheck(forward, (q, k, v, beta), eps=1e-6, atol=1e-6, rtol=1e-5)


def test_training_size_backward():
    """A training-sized float32 case (9 query heads over 3 kv-heads, D = 64, chunk 64, N = 128): every input
    gets a finite, nonzero gradient from y and the final dictionary."""
    g = torch.Generator().manual_seed(3)
    B, Hq, Hkv, T, D = 1, 9, 3, 512, 64
    q = torch.randn(B, Hq, T, D, generator=g, requires_grad=True)
    k = torch.randn(B, Hkv, T, D, generator=g, requires_grad=True)
    v = torch.randn(B, Hkv, T, D, generator=g, requires_grad=True)
    beta = torch.ones(Hq, requires_grad=True)
    out = ovq_prefill(q, k, v, beta, chunk=64, max_centroids=128)
    assert out.rows == dictionary_sizes(T, chunk=64, max_centroids=128)[-1] > 0
    loss = out.y.square().mean() + out.keys.sum() * 1e-3 + out.values.square().mean()
    loss.backward()
    for name, t in (("q", q), ("k", k), ("v", v), ("beta", beta)):
        assert t.grad is not None and torch.isfinite(t.grad).all(), name
        assert t.grad.abs().sum() > 0, name
    assert not out.counts.requires_grad


def _bad_calls():
    q, k, v, beta = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 3), torch.ones(4)
    ok = dict(chunk=2, max_centroids=4)
    return [
        ("q not a tensor", lambda: ovq_prefill(q.numpy(), k, v, beta, **ok), TypeError, "q = ndarray"),
        ("q int dtype", lambda: ovq_prefill(q.int(), k, v, beta, **ok), TypeError, "q.dtype = torch.int32"),
        ("q bfloat16", lambda: ovq_prefill(q.bfloat16(), k, v, beta, **ok), TypeError, "q.dtype = torch.bfloat16"),
        ("q rank 3", lambda: ovq_prefill(q[0], k, v, beta, **ok), ValueError, r"q.shape = \(4, 6, 8\)"),
        ("k of another dtype", lambda: ovq_prefill(q, k.double(), v, beta, **ok), TypeError, "k.dtype = torch.float64"),
        ("v of another dtype", lambda: ovq_prefill(q, k, v.double(), beta, **ok), TypeError, "v.dtype = torch.float64"),
        ("beta of another dtype", lambda: ovq_prefill(q, k, v, beta.double(), **ok), TypeError, "beta.dtype"),
        ("k with another T", lambda: ovq_prefill(q, k[:, :, :5], v, beta, **ok), ValueError, r"k.shape = \(1, 2, 5, 8\)"),
        ("k with another D", lambda: ovq_prefill(q, k[..., :7], v, beta, **ok), ValueError, r"k.shape = \(1, 2, 6, 7\)"),
        ("k with another B", lambda: ovq_prefill(q, torch.cat([k, k]), v, beta, **ok), ValueError, r"k.shape = \(2, 2"),
        ("v with another Hkv", lambda: ovq_prefill(q, k, v[:, :1], beta, **ok), ValueError, r"v.shape = \(1, 1, 6, 3\)"),
        ("Hq not a multiple of Hkv", lambda: ovq_prefill(q[:, :3], k, v, beta[:3], **ok), ValueError, "q heads = 3"),
        ("beta of another length", lambda: ovq_prefill(q, k, v, torch.ones(2), **ok), ValueError, r"beta.shape = \(2,\)"),
        ("beta rank 2", lambda: ovq_prefill(q, k, v, beta[None], **ok), ValueError, r"beta.shape = \(1, 4\)"),
        ("chunk 0", lambda: ovq_prefill(q, k, v, beta, chunk=0, max_centroids=4), ValueError, "chunk = 0"),
        ("chunk not an int", lambda: ovq_prefill(q, k, v, beta, chunk=2.5, max_centroids=4), TypeError, "chunk = 2.5"),
        ("max_centroids 0", lambda: ovq_prefill(q, k, v, beta, chunk=2, max_centroids=0), ValueError, "max_centroids = 0"),
        ("budget not a schedule", lambda: ovq_prefill(q, k, v, beta, budget="plateau", **ok), TypeError, "budget = 'plateau'"),
        ("budget round_down 0", lambda: ovq_prefill(q, k, v, beta, budget=budgets.Saturating(round_down=0), **ok),
         ValueError, "budget.round_down = 0"),
        ("budget plateau n 0", lambda: ovq_prefill(q, k, v, beta, budget=budgets.Plateau(0.0), **ok), ValueError,
         "budget.n = 0.0"),
    ]


@pytest.mark.parametrize("call, error, message", [c[1:] for c in _bad_calls()], ids=[c[0] for c in _bad_calls()])
def test_bad_input_names_the_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_gqa_heads_read_their_kv_head():
    """Query head h reads kv-head h // (Hq / Hkv) with its own beta: a GQA call equals the Hq = Hkv call on k and
    v repeated per query head, and the dictionary is the per-kv-head one (spec OVQ.md §1: heads independent)."""
    cfg = dict(B=2, Hq=6, Hkv=2, T=29, C=4, N=16)
    q, k, v, beta = make_inputs(cfg, torch.float64, seed=5)
    out = run(cfg, q, k, v, beta)
    rep = run(dict(cfg, Hkv=6), q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1), beta)
    torch.testing.assert_close(out.y, rep.y, rtol=0, atol=1e-12)
    torch.testing.assert_close(out.keys, rep.keys[:, ::3], rtol=0, atol=1e-12)
    assert math.isfinite(out.y.abs().max().item())
