"""KVPOP's training form (kvmem.train.kvpop): the parallel mLSTM scores against the recurrence of spec EVICTION.md
§3 and the float64 reference (tests/reference/eviction_reference.py), their gradients, the training mask against
the reference's Fenwick mask, the C++ memory (kvmem.EvictionMemory, scorer "kvpop") against attention under the
mask of these scores, the importance target and the loss against direct loops, and the errors."""

import math
import os
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kvmem
from kvmem.train.kvpop import (WEIGHT_NAMES, boundary_pairs, effective_keys, importance_target, keep_mask, kvpop_loss,
                               log_decay, masked_attention, mlstm_scores, weight_shapes)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "reference"))
import eviction_reference as ref  # noqa: E402


def random_weights(Hkv, D, Dv, *, seed=0, dtype=torch.float64, scale=0.3, theta=None):
    """Weights in the C++ layout, N(0, scale) entries, forget gates mostly open (b_f + 2), theta N(0, 2)."""
    g = torch.Generator().manual_seed(seed)
    w = {n: scale * torch.randn(*sh, generator=g, dtype=torch.float64) for n, sh in weight_shapes(Hkv, D, Dv).items()}
    w["b_f"] = w["b_f"] + 2.0
    w["theta"] = 2.0 * torch.randn(Hkv, generator=g, dtype=torch.float64) if theta is None else torch.tensor(theta, dtype=torch.float64)
    return {n: t.to(dtype) for n, t in w.items()}


def tokens(B, Hq, Hkv, T, D, Dv, *, seed=1, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    return r(B, Hq, T, D), r(B, Hkv, T, D), r(B, Hkv, T, Dv)


def recurrent_scores(k, v, W, window, normalizer, cap, eps=1e-6):
    """Spec §3 as written: the stabilised recurrence one token at a time, delayed readout of u = t - w + 1."""
    B, H, T, D = k.shape
    out = torch.full((B, H, T), float("-inf"), dtype=k.dtype)
    capf = (lambda z: cap * torch.tanh(z / cap)) if cap > 0 else (lambda z: z)
    hh = lambda y: torch.cat([torch.softmax(y, -1), torch.softmax(-y, -1)])  # noqa: E731
    for b in range(B):
        for h in range(H):
            C, n, m = torch.zeros(D, D // 2, dtype=k.dtype), torch.zeros(D, dtype=k.dtype), torch.tensor(0.0, dtype=k.dtype)
            for t in range(T):
                x = torch.cat([k[b, h, t], v[b, h, t]])
                kf, vf = hh(x @ W["w_k"][h]), x @ W["w_v"][h]
                ig = capf(x @ W["w_i"][h] + W["b_i"][h])
                lf = F.logsigmoid(capf(x @ W["w_f"][h] + W["b_f"][h]))
                m_new = torch.maximum(lf + m, ig)
                C = torch.exp(lf + m - m_new) * C + torch.exp(ig - m_new) * torch.outer(kf, vf)
                n = torch.exp(lf + m - m_new) * n + torch.exp(ig - m_new) * kf
                m = m_new
                u = t - window + 1
                if u < 0:
                    continue
                qf = hh(torch.cat([k[b, h, u], v[b, h, u]]) @ W["w_q"][h])
                if normalizer == "xlstm":
                    qq = qf / math.sqrt(D)
                    hv = (qq @ C) / (torch.maximum((qq @ n).abs(), torch.exp(-m)) + eps)
                else:
                    hv = (qf @ C) / (qf @ n)
                out[b, h, u] = W["w_s"][h] @ F.silu(hv) + W["b_s"][h]
    return out


# ------------------------------------------------------------------------------------------------ scores
@pytest.mark.parametrize("cap", [15.0, 0.0], ids=["soft-cap", "no-cap"])
@pytest.mark.parametrize("normalizer", ["xlstm", "plain"])
def test_parallel_form_equals_the_recurrence(normalizer, cap):
    D, Dv, w = 6, 4, 3
    _, k, v = tokens(2, 2, 2, 23, D, Dv)
    W = random_weights(2, D, Dv, seed=2)
    W["b_i"] = W["b_i"] + torch.tensor([4.0, -3.0], dtype=torch.float64)  # input gates large and small: m != 0 matters
    got = mlstm_scores(k, v, W, window=w, normalizer=normalizer, soft_cap=cap)
    want = recurrent_scores(k, v, W, w, normalizer, cap)
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and torch.isinf(got[..., -(w - 1):]).all()
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("window,T", [(1, 9), (9, 9), (12, 9)], ids=["window 1", "window == T", "window > T"])
def test_window_edges(window, T):
    _, k, v = tokens(1, 1, 1, T, 4, 4, seed=5)
    W = random_weights(1, 4, 4, seed=6)
    got = mlstm_scores(k, v, W, window=window)
    torch.testing.assert_close(got, recurrent_scores(k, v, W, window, "xlstm", 15.0), rtol=1e-10, atol=1e-10)
    assert int(torch.isfinite(got).sum()) == max(0, T - window + 1)


@pytest.mark.parametrize("normalizer", ["xlstm", "plain"])
def test_scores_equal_the_float64_reference(normalizer):
    D, Dv, w = 8, 6, 4
    _, k, v = tokens(1, 2, 2, 30, D, Dv, seed=3)
    W = random_weights(2, D, Dv, seed=4)
    got = mlstm_scores(k, v, W, window=w, normalizer=normalizer)
    npw = {n: t.numpy() for n, t in W.items()}
    for h in range(2):
        want = ref.kvpop_scores(k[0, h].numpy(), v[0, h].numpy(), ref.kvpop_head(npw, h), w, normalizer)
        want = np.where(np.isnan(want), -np.inf, want)
        np.testing.assert_allclose(got[0, h].numpy(), want, rtol=1e-11, atol=1e-11)
        lg = float(ref.log_gamma(npw["theta"][h]))
        np.testing.assert_allclose(effective_keys(got, W["theta"])[0, h].numpy(), ref.static_key(want, lg), rtol=1e-12, atol=1e-12)
        assert log_decay(W["theta"])[h].item() == pytest.approx(lg, rel=1e-14)


def test_gradients_match_finite_differences():
    D, Dv = 4, 2
    _, k, v = tokens(1, 1, 1, 7, D, Dv, seed=8)
    W = random_weights(1, D, Dv, seed=9)
    names = [n for n in WEIGHT_NAMES if n != "theta"]
    for normalizer in ("xlstm", "plain"):
        def f(*ws):
            s = mlstm_scores(k, v, dict(zip(names, ws), theta=W["theta"]), window=2, normalizer=normalizer)
            return s[..., :6]
        assert torch.autograd.gradcheck(f, [W[n].clone().requires_grad_(True) for n in names], eps=1e-6, atol=1e-7)
    # through the effective keys and the loss: every weight, theta included (margins off: they depend on theta,
    # detached)
    tq, tk, _ = tokens(1, 2, 1, 7, D, Dv, seed=10)
    target = effective_keys(importance_target(tq, tk, sinks=1, window=2, log=True), W["theta"])

    def loss(*ws):
        wd = dict(zip(WEIGHT_NAMES, ws))
        kappa = effective_keys(mlstm_scores(k, v, wd, window=2), wd["theta"])
        return kvpop_loss(kappa, target, sinks=1, window=2, top_k=2, margin_weighting=False)
    assert torch.autograd.gradcheck(loss, [W[n].clone().requires_grad_(True) for n in WEIGHT_NAMES], eps=1e-6, atol=1e-7)


# -------------------------------------------------------------------------------------------------- masks
def test_keep_mask_equals_the_reference_fenwick_mask():
    g = torch.Generator().manual_seed(11)
    T = 37
    kappa = torch.randn(2, 3, T, generator=g, dtype=torch.float64)
    kappa[0, 0, 10:20] = 0.5  # ties: the newer token wins
    kappa[1, 2, -3:] = float("-inf")
    for s, w, k in ((2, 3, 5), (0, 1, 4), (4, 5, 0), (1, 2, 40), (40, 2, 3)):
        got = keep_mask(kappa, sinks=s, window=w, top_k=k)
        for b in range(2):
            for h in range(3):
                want, _ = ref.fenwick_mask(kappa[b, h].numpy(), s, w, k)
                assert np.array_equal(got[b, h].numpy(), want), (s, w, k, b, h)
                assert got[b, h].sum(-1).max() <= s + w + k


@pytest.mark.parametrize("normalizer", ["xlstm", "plain"])
def test_cpp_memory_equals_attention_under_the_mask_of_these_scores(normalizer):
    """kvmem.EvictionMemory's prefill (the C++ decode state machine, float32 mLSTM) against masked attention with
    keep_mask(effective_keys(mlstm_scores(...))). The seed is one where no two eligible keys lie within 1e-5 (float32
    scores are within ~1e-7 of float64 ones here), so float32 rounding cannot change the mask (checked: the float32
    and float64 masks agree)."""
    B, Hq, Hkv, T, D, Dv, s, w, k = 2, 4, 2, 48, 8, 6, 2, 5, 7
    q, kk, v = tokens(B, Hq, Hkv, T, D, Dv, seed=20, dtype=torch.float32)
    W = random_weights(Hkv, D, Dv, seed=21, dtype=torch.float32, theta=[-3.0, 1.5])
    kappa64 = effective_keys(mlstm_scores(kk.double(), v.double(), {n: t.double() for n, t in W.items()}, window=w,
                                          normalizer=normalizer), W["theta"].double())
    eligible = kappa64[..., s:T - w].sort(dim=-1).values
    assert (eligible.diff(dim=-1) > 1e-5).all(), "near-tie: pick another seed"
    kappa32 = effective_keys(mlstm_scores(kk, v, W, window=w, normalizer=normalizer), W["theta"])
    mask = keep_mask(kappa32, sinks=s, window=w, top_k=k)
    assert torch.equal(mask, keep_mask(kappa64, sinks=s, window=w, top_k=k))
    assert not torch.equal(mask, keep_mask(torch.zeros_like(kappa64), sinks=s, window=w, top_k=k))  # scores matter
    want, _ = masked_attention(q, kk, v, mask)

    mem = kvmem.EvictionMemory(D, Hq, Hkv, value_dim=Dv, batch=B, scorer="kvpop", sinks=s, window=w, top_k=k,
                               weights=W, normalizer=normalizer)
    y = mem.prefill(q, kk, v)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
    state = mem.state()
    for b in range(B):
        for h in range(Hkv):
            kept = mask[b, h, T - 1].nonzero().squeeze(1)
            assert state["kept_rows"][b, h].item() == kept.numel() == s + w + k
            assert torch.equal(state["kept_positions"][b, h, :kept.numel()], kept)


# --------------------------------------------------------------------------------------- target and loss
def test_importance_target_equals_the_sum_of_future_probabilities():
    B, Hq, Hkv, T, D, s, w = 2, 6, 2, 19, 4, 2, 3
    q, k, v = tokens(B, Hq, Hkv, T, D, D, seed=31)
    G = Hq // Hkv
    logits = (q.reshape(B, Hkv, G, T, D) @ k[:, :, None].transpose(-1, -2)) / math.sqrt(D)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    future = torch.ones(T, T, dtype=torch.bool).tril(-w)  # d >= t + w

    def direct(lse):
        p = torch.exp(logits - lse[..., None]).masked_fill(~future, 0.0)
        m = p.sum(dim=-2).amax(dim=2)  # sum over queries d, max over the group
        m[..., :s] = 0.0
        return m

    dense = direct(torch.logsumexp(logits.masked_fill(~causal, float("-inf")), dim=-1))
    got = importance_target(q, k, sinks=s, window=w)
    torch.testing.assert_close(got, dense, rtol=1e-12, atol=1e-14)
    assert (got[..., T - w:] == 0).all() and (got[..., :s] == 0).all() and (got[..., s:T - w] > 0).all()
    torch.testing.assert_close(importance_target(q, k, sinks=s, window=w, log=True).exp(), dense, rtol=1e-12, atol=1e-14)
    # the sparse first pass (App. D's LSE~) from a keep mask
    mask = keep_mask(torch.randn(B, Hkv, T, generator=torch.Generator().manual_seed(3), dtype=torch.float64),
                     sinks=s, window=w, top_k=4)
    _, lse = masked_attention(q, k, v, mask)
    torch.testing.assert_close(importance_target(q, k, sinks=s, window=w, lse=lse),
                               direct(lse.reshape(B, Hkv, G, T)), rtol=1e-12, atol=1e-14)
    # half precision in, float32 out
    low = importance_target(q.to(torch.bfloat16), k.to(torch.bfloat16), sinks=s, window=w)
    assert low.dtype == torch.float32 and not low.requires_grad
    torch.testing.assert_close(low.double(), dense, rtol=0.1, atol=0.02)


def brute_loss(kappa, target, s, w, k, tau, weighting):
    """Eq. 2 by loops: every q with t_new = q - w eligible and more than k eligible tokens."""
    B, H, T = kappa.shape
    losses, weights = [], []
    for b in range(B):
        for h in range(H):
            for u in range(s, T - w):
                E = list(range(s, u + 1))
                if len(E) <= k or k == 0:
                    continue
                ranked = sorted(E, key=lambda t: (-target[b, h, t].item(), -t))
                keep = u in ranked[:k]
                bnd = ranked[k] if keep else ranked[k - 1]
                y = 1.0 if keep else -1.0
                losses.append(F.softplus(-y * (kappa[b, h, u] - kappa[b, h, bnd]) / tau))
                weights.append(abs(target[b, h, u].item() - target[b, h, bnd].item()))
    if not losses:
        return torch.tensor(0.0, dtype=kappa.dtype)
    L = torch.stack(losses)
    if weighting:
        wt = torch.tensor(weights, dtype=kappa.dtype)
        return (wt * L).sum() / wt.sum()
    return L.mean()


@pytest.mark.parametrize("s,w,k", [(2, 3, 4), (0, 1, 1), (1, 2, 6), (3, 2, 0), (2, 30, 3)])
def test_loss_equals_the_direct_loop(s, w, k):
    g = torch.Generator().manual_seed(41)
    leaf = torch.randn(2, 2, 25, generator=g, dtype=torch.float64, requires_grad=True)
    # the last w - 1 tokens are never scored (-inf), as mlstm_scores leaves them
    scored = max(0, 26 - w)
    kappa = torch.cat([leaf[..., :scored], torch.full((2, 2, 25 - scored), float("-inf"), dtype=torch.float64)], dim=-1)
    target = torch.randn(2, 2, 25, generator=g, dtype=torch.float64)
    target[1, 0, 8:14] = 0.25  # teacher ties: the newer token ranks first
    for tau, weighting in ((1.0, True), (0.5, False)):
        got = kvpop_loss(kappa, target, sinks=s, window=w, top_k=k, temperature=tau, margin_weighting=weighting)
        want = brute_loss(kappa, target, s, w, k, tau, weighting)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
        (grad,) = torch.autograd.grad(got, leaf)
        assert torch.isfinite(grad).all() and (grad[..., scored:] == 0).all()
    pairs = boundary_pairs(target, sinks=s, window=w, top_k=k)
    assert pairs.new.numel() == max(0, 25 - s - w - k) if k else pairs.new.numel() == 0
    assert not (pairs.boundary == pairs.new).any()


def test_training_step_on_the_target_lowers_the_loss():
    """End to end: the scorer's weights and theta fit the future-attention target of random attention a little."""
    B, Hq, Hkv, T, D, s, w, k = 1, 4, 2, 40, 8, 2, 4, 6
    q, kk, v = tokens(B, Hq, Hkv, T, D, D, seed=51, dtype=torch.float32)
    W = {n: t.requires_grad_(True) for n, t in random_weights(Hkv, D, D, seed=52, dtype=torch.float32).items()}
    log_m = importance_target(q, kk, sinks=s, window=w, log=True)
    opt = torch.optim.Adam(W.values(), lr=0.05)
    losses = []
    for _ in range(15):
        kappa = effective_keys(mlstm_scores(kk.detach(), v.detach(), W, window=w), W["theta"])
        loss = kvpop_loss(kappa, effective_keys(log_m, W["theta"].detach()), sinks=s, window=w, top_k=k)
        opt.zero_grad()
        loss.backward()
        assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in W.values())
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


# ------------------------------------------------------------------------------------------------- errors
def _bad_cases():
    _, k, v = tokens(1, 2, 2, 6, 4, 4, dtype=torch.float32)
    W = random_weights(2, 4, 4, dtype=torch.float32)
    kappa = torch.zeros(1, 2, 6)
    q = torch.zeros(1, 4, 6, 4)
    odd = torch.zeros(1, 2, 6, 5)
    less = {n: t for n, t in W.items() if n != "w_f"}
    bent = dict(W, w_q=torch.zeros(2, 8, 3))
    nan = kappa.clone()
    nan[0, 1, 3] = float("nan")
    return [
        ("odd D", lambda: mlstm_scores(odd, torch.zeros(1, 2, 6, 4), W, window=2), ValueError, "k.shape[3] = head_dim = 5"),
        ("window 0", lambda: mlstm_scores(k, v, W, window=0), ValueError, "window = 0"),
        ("window float", lambda: mlstm_scores(k, v, W, window=2.0), TypeError, "window = 2.0"),
        ("v tokens", lambda: mlstm_scores(k, v[:, :, :5], W, window=2), ValueError, "v.shape = (1, 2, 5, 4)"),
        ("v dtype", lambda: mlstm_scores(k, v.double(), W, window=2), TypeError, "v.dtype"),
        ("k rank", lambda: mlstm_scores(k[0], v, W, window=2), ValueError, "k.shape = (2, 6, 4)"),
        ("k int", lambda: mlstm_scores(k.int(), v, W, window=2), TypeError, "k.dtype = torch.int32"),
        ("missing weight", lambda: mlstm_scores(k, v, less, window=2), ValueError, "no 'w_f'"),
        ("misshapen weight", lambda: mlstm_scores(k, v, bent, window=2), ValueError, "weights['w_q'].shape = (2, 8, 3): must be [2, 8, 2]"),
        ("surplus weight", lambda: mlstm_scores(k, v, dict(W, W_q=W["w_q"]), window=2), ValueError, "weights['W_q']"),
        ("weight dtype", lambda: mlstm_scores(k, v, dict(W, b_s=W["b_s"].double()), window=2), TypeError, "weights['b_s'].dtype"),
        ("weights list", lambda: mlstm_scores(k, v, [1, 2], window=2), TypeError, "weights = list"),
        ("normalizer", lambda: mlstm_scores(k, v, W, window=2, normalizer="xLSTM"), ValueError, "normalizer = 'xLSTM'"),
        ("soft_cap", lambda: mlstm_scores(k, v, W, window=2, soft_cap=float("inf")), ValueError, "soft_cap = inf"),
        ("theta shape", lambda: effective_keys(kappa, torch.zeros(3)), ValueError, "theta.shape = (3,)"),
        ("mask top_k", lambda: keep_mask(kappa, sinks=0, window=1, top_k=-1), ValueError, "top_k = -1"),
        ("mask sinks", lambda: keep_mask(kappa, sinks=-2, window=1, top_k=1), ValueError, "sinks = -2"),
        ("mask NaN", lambda: keep_mask(nan, sinks=0, window=1, top_k=1), ValueError, "kappa[0, 1, 3] = nan"),
        ("target heads", lambda: importance_target(q[:, :3], k, sinks=0, window=2), ValueError, "q.shape[1] = 3"),
        ("target window", lambda: importance_target(q, k, sinks=0, window=0), ValueError, "window = 0"),
        ("target lse", lambda: importance_target(q, k, sinks=0, window=2, lse=torch.zeros(1, 4, 5)), ValueError, "lse.shape = (1, 4, 5)"),
        ("loss shapes", lambda: kvpop_loss(kappa, kappa[..., :5], sinks=0, window=1, top_k=1), ValueError, "target_kappa.shape"),
        ("loss temperature", lambda: kvpop_loss(kappa, kappa, sinks=0, window=1, top_k=1, temperature=0.0), ValueError, "temperature = 0.0"),
        ("loss eligible -inf", lambda: kvpop_loss(kappa, torch.where(torch.arange(6) == 2, float("-inf"), 0.0).expand(1, 2, 6),
                                                  sinks=0, window=1, top_k=1), ValueError, "target_kappa[0, 0, 2] = -inf"),
        ("attention mask", lambda: masked_attention(q, k, v, torch.ones(1, 2, 6, 6)), TypeError, "mask"),
        ("odd head_dim", lambda: weight_shapes(2, 7), ValueError, "head_dim = 7"),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_input_raises_naming_the_argument(case):
    _, call, error, text = case
    with pytest.raises(error) as info:
        call()
    assert text in str(info.value)


def test_blocked_passes_equal_one_block(monkeypatch):
    """The no-gradient passes (mask, target, teacher decisions) cut their [B, Hkv, T, T] work into blocks of rows
    or columns; small blocks give the same results as one."""
    import kvmem.train.kvpop as kvpop

    B, Hq, Hkv, T, D, s, w, k = 2, 4, 2, 21, 4, 1, 3, 4
    q, kk, v = tokens(B, Hq, Hkv, T, D, D, seed=61)
    g = torch.Generator().manual_seed(62)
    kappa = torch.randn(B, Hkv, T, generator=g, dtype=torch.float64)
    target = torch.randn(B, Hkv, T, generator=g, dtype=torch.float64)
    _, lse = masked_attention(q, kk, v, keep_mask(kappa, sinks=s, window=w, top_k=k))

    def run():
        return (keep_mask(kappa, sinks=s, window=w, top_k=k), importance_target(q, kk, sinks=s, window=w, log=True),
                importance_target(q, kk, sinks=s, window=w, lse=lse), boundary_pairs(target, sinks=s, window=w, top_k=k),
                kvpop_loss(kappa, target, sinks=s, window=w, top_k=k))
    whole = run()
    monkeypatch.setattr(kvpop, "_CHUNK_ELEMENTS", B * Hkv * T * 4)  # blocks of 4 rows or columns
    for a, b in zip(whole, run()):
        for x, y in zip(a, b) if isinstance(a, tuple) else ((a, b),):
            torch.testing.assert_close(x, y, rtol=1e-14, atol=0)
