"""The readout's log-sum-exp from Python (``lse=``): a memory that holds every token gives exact attention's
log-sum-exp; prefill, decode and chunked prefill write the same bits; -inf past a ragged length; an engine
merges kvmem's output with attention over other keys by it; bad lse tensors and a memory without one
(Trellis) are refused, naming lse. The C++ twins: tests/unit/test_kvm_reference.cpp, test_ovq.cpp,
test_eviction.cpp, test_proportional.cpp."""

import math

import pytest
import torch

import kvmem

B, HQ, HKV, T, D = 2, 4, 2, 40, 8
G = HQ // HKV


def exact(q, k, v):
    """Causal attention at scale 1 / sqrt(D) in float64, GQA: (y [B, Hq, T, D], lse [B, Hq, T])."""
    q, k, v = q.double(), k.double().repeat_interleave(G, dim=1), v.double().repeat_interleave(G, dim=1)
    logits = q @ k.transpose(-1, -2) / math.sqrt(D)
    n = q.shape[2]
    logits = logits.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(logits, dim=-1) @ v, torch.logsumexp(logits, dim=-1)


def proportional_all(batch=B):  # a row per token: exact attention
    return kvmem.ProportionalMemory(D, HQ, HKV, batch=batch, chunk=4, window_chunks=2, sinks=1, max_rows=1024,
                                    budget=kvmem.budget.Fixed(1024))


def streaming_all(batch=B):  # a budget above T: exact attention
    return kvmem.EvictionMemory(D, HQ, HKV, batch=batch, scorer="streaming", sinks=1, window=T, top_k=0)


def kvm(batch=B):
    return kvmem.KvmMemory(D, HQ, HKV, batch=batch, chunk=4, window_chunks=2, sinks=1, max_rows=64,
                           budget=kvmem.budget.PowerLaw(4, 2.0, 0.5))


def ovq(batch=B):
    return kvmem.OvqMemory(D, HQ, HKV, batch=batch, chunk=4, max_centroids=12)


def h2o_merge(batch=B):
    return kvmem.EvictionMemory(D, HQ, HKV, batch=batch, scorer="h2o", sinks=2, window=6, top_k=8, merge_evicted=True)


def tova(batch=B):
    return kvmem.EvictionMemory(D, HQ, HKV, batch=batch, scorer="tova", sinks=1, window=4, top_k=6)


def inputs(rand, tokens=T):
    return rand(B, HQ, tokens, D), rand(B, HKV, tokens, D), rand(B, HKV, tokens, D)


@pytest.mark.parametrize("make", [proportional_all, streaming_all], ids=["proportional", "streaming"])
def test_lse_of_a_memory_that_holds_every_token_is_exact(rand, make):
    q, k, v = inputs(rand)
    lse = torch.empty(B, HQ, T)
    y = make().prefill(q, k, v, lse=lse)
    want_y, want_lse = exact(q, k, v)
    torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=2e-5)
    torch.testing.assert_close(y.double(), want_y, rtol=0, atol=2e-5)


@pytest.mark.parametrize("make", [kvm, ovq, proportional_all, h2o_merge, tova], ids=lambda f: f.__name__)
def test_lse_prefill_decode_and_chunks_give_the_same_bits(rand, make):
    q, k, v = inputs(rand)
    whole = torch.empty(B, HQ, T)
    y_whole = make().prefill(q, k, v, lse=whole)
    decoded = torch.empty(B, HQ, T)
    m = make()
    for t in range(T):
        m.decode(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], lse=decoded[:, :, t:t + 1])
    chunked = torch.empty(B, HQ, T)
    m = make()
    for a, b in [(0, 7), (7, 8), (8, 29), (29, T)]:
        m.prefill(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], lse=chunked[:, :, a:b])
    assert torch.equal(decoded, whole)
    assert torch.equal(chunked, whole)
    assert torch.isfinite(whole).all()
    assert torch.equal(make().prefill(q, k, v), y_whole)  # asking for lse changes no bit of y


def test_lse_past_a_length_is_minus_infinity(rand):
    q, k, v = inputs(rand)
    lse = torch.zeros(B, HQ, T)
    kvm().prefill(q, k, v, lengths=[T, 13], lse=lse)
    assert torch.isfinite(lse[0]).all() and torch.isfinite(lse[1, :, :13]).all()
    assert (lse[1, :, 13:] == float("-inf")).all()


def test_lse_in_the_tokens_heads_layout(rand):
    q, k, v = rand(T, HQ, D), rand(T, HKV, D), rand(T, HKV, D)
    lse = torch.empty(T, HQ)  # [T, Hq] for one sequence, as FlashInfer lays it out
    streaming_all(batch=1).prefill(q, k, v, lse=lse)
    _, want = exact(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])
    torch.testing.assert_close(lse.double(), want[0].transpose(0, 1), rtol=0, atol=2e-5)


def test_an_engine_merges_kvmem_with_attention_over_other_keys(rand):
    """Attention over [prefix ; suffix] is the log-sum-exp merge of attention over the prefix (here plain
    attention, as a shared prefix cache gives it) and over the suffix (a kvmem memory holding it)."""
    P, S = 16, 24
    q, k, v = inputs(rand, P + S)
    lse_mem = torch.empty(B, HQ, S)
    y_mem = streaming_all().prefill(q[:, :, P:], k[:, :, P:], v[:, :, P:], lse=lse_mem)  # causal over the suffix
    kp, vp = k[:, :, :P].repeat_interleave(G, 1), v[:, :, :P].repeat_interleave(G, 1)
    logits = q[:, :, P:] @ kp.transpose(-1, -2) / math.sqrt(D)  # every suffix query sees the whole prefix
    lse_pre, y_pre = torch.logsumexp(logits, -1), torch.softmax(logits, -1) @ vp
    top = torch.maximum(lse_pre, lse_mem)
    w_pre, w_mem = torch.exp(lse_pre - top)[..., None], torch.exp(lse_mem - top)[..., None]
    merged = (w_pre * y_pre + w_mem * y_mem) / (w_pre + w_mem)
    want, _ = exact(q, k, v)
    torch.testing.assert_close(merged.double(), want[:, :, P:], rtol=0, atol=2e-5)


def test_bad_lse_is_refused_naming_it(rand):
    q, k, v = inputs(rand)
    m = kvm()
    with pytest.raises(TypeError, match="lse.dtype"):
        m.prefill(q, k, v, lse=torch.empty(B, HQ, T, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"lse.shape = \(2, 2, 40\)"):
        m.prefill(q, k, v, lse=torch.empty(B, HKV, T))
    with pytest.raises(ValueError, match="lse.dim"):
        m.prefill(q, k, v, lse=torch.empty(B, HQ, T, 1))
    assert m.tokens(0) == 0
    trellis = kvmem.TrellisMemory(4, D, HKV, batch=B, chunk=4)
    q2 = rand(B, HKV, T, D)
    extras = (rand(B, HKV, T, 4), torch.full((B, HKV, T), 0.9), torch.full((B, HKV, T), 0.1),
              torch.full((B, HKV, T), 0.9), torch.full((B, HKV, T), 0.1))
    with pytest.raises(ValueError, match="lse.*no log-sum-exp"):
        trellis.prefill(q2, k, v, *extras, lse=torch.empty(B, HKV, T))
    assert trellis.tokens(0) == 0
