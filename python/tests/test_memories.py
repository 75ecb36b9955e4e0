"""Each memory from Python: prefill then decode means the same as one prefill, GQA, ragged batches,
the engines' layouts ([B, H, T, D] with any strides, [T, H, D]), reset, sizes and state export."""

import pytest
import torch

import kvmem

B, HQ, HKV, T, D = 2, 6, 2, 50, 8


def kvm():
    return kvmem.KvmMemory(D, HQ, HKV, batch=B, chunk=8, window_chunks=2, sinks=1, max_rows=16,
                           budget=kvmem.budget.PowerLaw(4, 2.0, 0.5))


def ovq():
    return kvmem.OvqMemory(D, HQ, HKV, batch=B, chunk=8, max_centroids=16)


def h2o():
    return kvmem.EvictionMemory(D, HQ, HKV, batch=B, scorer="h2o", sinks=2, window=6, top_k=8)


def tova():
    return kvmem.EvictionMemory(D, HQ, HKV, batch=B, scorer="tova", sinks=1, window=4, top_k=6)


def proportional():
    return kvmem.ProportionalMemory(D, HQ, HKV, batch=B, chunk=8, window_chunks=2, sinks=1, max_rows=16,
                                    budget=kvmem.budget.Fixed(12))


def h2o_merge():
    return kvmem.EvictionMemory(D, HQ, HKV, batch=B, scorer="h2o", sinks=2, window=6, top_k=8, merge_evicted=True)


def streaming_merge():
    return kvmem.EvictionMemory(D, HQ, HKV, batch=B, scorer="streaming", sinks=1, window=4, top_k=6, merge_evicted=True)


MAKERS = [kvm, ovq, h2o, tova, proportional, h2o_merge, streaming_merge]


def inputs(rand, batch=B, tokens=T):
    return rand(batch, HQ, tokens, D), rand(batch, HKV, tokens, D), rand(batch, HKV, tokens, D)


@pytest.mark.parametrize("make", MAKERS)
@pytest.mark.parametrize("split", [1, 17, 49])
def test_prefill_then_decode_is_prefill(rand, make, split):
    q, k, v = inputs(rand)
    whole = make().prefill(q, k, v)
    m = make()
    head = m.prefill(q[:, :, :split], k[:, :, :split], v[:, :, :split])
    tail = [m.decode(q[:, :, s:s + 1], k[:, :, s:s + 1], v[:, :, s:s + 1]) for s in range(split, T)]
    torch.testing.assert_close(torch.cat([head] + tail, dim=2), whole, rtol=0, atol=0)
    assert m.tokens(0) == T and m.tokens(1) == T


@pytest.mark.parametrize("make", MAKERS)
def test_ragged_batch_is_each_sequence_alone(rand, make):
    q, k, v = inputs(rand)
    lengths = [T, 23]
    y = make().prefill(q, k, v, lengths=lengths)
    for b, n in enumerate(lengths):
        alone = make().prefill(q[:, :, :n].clone(), k[:, :, :n].clone(), v[:, :, :n].clone())
        torch.testing.assert_close(y[b, :, :n], alone[b], rtol=0, atol=0)
        assert torch.count_nonzero(y[b, :, n:]) == 0


def knorm(heads=HQ):
    return kvmem.EvictionMemory(D, heads, HKV, batch=B, scorer="knorm", sinks=2, window=6, top_k=8)


def kvm_heads(heads):
    return kvmem.KvmMemory(D, heads, HKV, batch=B, chunk=8, window_chunks=2, sinks=1, max_rows=16,
                           budget=kvmem.budget.PowerLaw(4, 2.0, 0.5))


@pytest.mark.parametrize("make", [kvm_heads, knorm], ids=["kvm", "knorm"])
def test_gqa_is_repeated_kv_heads(rand, make):
    """Query head i reads kv-head i // (Hq / Hkv): every group position g gives what a memory with one
    query head per kv-head gives for the queries g, g + group, ... (memories whose state ignores queries)."""
    q, k, v = inputs(rand)
    y = make(HQ).prefill(q, k, v)
    group = HQ // HKV
    for g in range(group):
        torch.testing.assert_close(make(HKV).prefill(q[:, g::group].contiguous(), k, v), y[:, g::group], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("make", MAKERS)
def test_layouts_and_strides(rand, make):
    """[B, H, T, D] views of a [B, T, H, D] tensor (Hugging Face's transpose) and a y written through a
    transposed view give the same result as contiguous tensors."""
    q, k, v = inputs(rand)
    want = make().prefill(q, k, v)
    qt, kt, vt = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    assert not qt.is_contiguous()
    out = torch.full((B, T, HQ, D), float("nan"))
    got = make().prefill(qt, kt, vt, y=out.transpose(1, 2))
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out.transpose(1, 2), want, rtol=0, atol=0)


def test_tokens_heads_dim_layout(rand):
    """[T, H, D] (one sequence, vLLM's layout) is the batch-1 [1, H, T, D] memory."""
    q, k, v = inputs(rand, batch=1)
    make = lambda: kvmem.EvictionMemory(D, HQ, HKV, batch=1, scorer="knorm", sinks=1, window=4, top_k=5)
    want = make().prefill(q, k, v)
    got = make().prefill(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1))
    assert got.shape == (T, HQ, D)
    torch.testing.assert_close(got.transpose(0, 1), want[0], rtol=0, atol=0)


@pytest.mark.parametrize("make", MAKERS)
def test_reset_and_sizes(rand, make):
    q, k, v = inputs(rand)
    m = make()
    first = m.prefill(q, k, v)
    held = m.held_bytes()
    assert 0 < held <= m.allocated_bytes()
    m.reset()
    assert m.tokens(0) == 0
    torch.testing.assert_close(m.prefill(q, k, v), first, rtol=0, atol=0)
    assert m.held_bytes() == held


def test_state_export(rand):
    q, k, v = inputs(rand)
    m = kvm()
    m.prefill(q, k, v)
    s = m.state()
    assert s["keys"].shape[:2] == (B, HKV) and s["keys"].shape[3] == D
    assert s["values"].shape[:2] == (B, HKV) and s["radius"].shape[:2] == (B, HKV)
    assert s["keys"].dtype == torch.float32
    e = h2o()
    e.prefill(q, k, v)
    s = e.state()
    assert s["kept_positions"].shape[:2] == (B, HKV) and s["kept_rows"].shape == (B, HKV)
    assert torch.all(s["kept_rows"] == 2 + 6 + 8)  # sinks + window + top_k once more tokens were seen


def test_trellis_decode_is_the_recurrence(rand):
    """Trellis decode continues a prefill; the chunk-1 prefill is the exact recurrence (trellis-paper eq. 14)."""
    H, m_slots = 2, 4
    q, k, v = (torch.nn.functional.normalize(rand(B, H, T, D), dim=-1) for _ in range(3))
    extras = [rand(B, H, T, m_slots)] + [torch.rand(B, H, T) * 0.5 + 0.5 if i % 2 == 0 else torch.rand(B, H, T) * 0.5
                                         for i in range(4)]
    make = lambda: kvmem.TrellisMemory(m_slots, D, H, batch=B, chunk=1)
    want = make().prefill(q, k, v, *extras)
    m = make()
    got = torch.cat([m.decode(q[:, :, s:s + 1], k[:, :, s:s + 1], v[:, :, s:s + 1], *[x[:, :, s:s + 1] for x in extras])
                     for s in range(T)], dim=2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert m.state()["m1"].shape == (B, H, m_slots, D)


def test_proportional_holding_every_token_is_attention(rand):
    """A proportional memory with room for every token (each its own row, count 1) is exact attention."""
    q, k, v = inputs(rand)
    mem = kvmem.ProportionalMemory(D, HQ, HKV, batch=B, chunk=8, window_chunks=1, sinks=1, max_rows=T + 8,
                                   budget=kvmem.budget.Fixed(T + 8))
    y = mem.prefill(q, k, v)
    g = HQ // HKV
    want = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1),
                                                             is_causal=True)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    st = mem.state()
    for b in range(B):
        rows = st["rows"][b]
        assert rows >= T - 8  # every token but the window's is a row of its own
        assert torch.equal(torch.as_tensor(st["counts"])[b, :, :rows], torch.ones(HKV, rows))


def test_merging_eviction_counts_and_output(rand):
    """merge_evicted keeps the budget, counts every token once across its rows, and changes the output."""
    q, k, v = inputs(rand)
    plain = kvmem.EvictionMemory(D, HQ, HKV, batch=B, scorer="streaming", sinks=1, window=4, top_k=6)
    merged = streaming_merge()
    y_plain, y_merged = plain.prefill(q, k, v), merged.prefill(q, k, v)
    assert not torch.equal(y_plain, y_merged)
    torch.testing.assert_close(y_plain[:, :, :11], y_merged[:, :, :11])  # nothing evicted before 11 tokens
    st = merged.state()
    counts = torch.as_tensor(st["counts"])
    live = torch.as_tensor(st["slot_positions"]) >= 0
    assert torch.equal(counts[live].reshape(B, HKV, -1).sum(-1), torch.full((B, HKV), float(T)))
    assert merged.held_bytes() == plain.held_bytes() + B * HKV * 12 * 4
