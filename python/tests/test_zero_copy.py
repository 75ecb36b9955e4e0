"""Zero copy: the C++ side sees the caller's tensors at their own addresses, writes y in place, and a
steady decode step allocates nothing and copies no token tensor."""

import pytest
import torch

import kvmem
from kvmem import _kvmem, ops

B, HQ, HKV, D = 2, 8, 2, 64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_tensors_cross_at_their_addresses(rand, dtype):
    """The Kokkos views a call makes point at the caller's tensors (strided views and slices included), in
    every dtype a memory stores."""
    q = rand(B, 16, HQ, D).to(dtype).transpose(1, 2)  # a strided view, as Hugging Face holds it
    k, v = rand(B, HKV, 16, D).to(dtype), rand(B, HKV, 16, D).to(dtype)[:, :, 3:4]
    y = torch.empty(B, 16, HQ, D, dtype=dtype).transpose(1, 2)[:, :, 5:6]
    m = kvmem.EvictionMemory(D, HQ, HKV, batch=B, scorer="streaming", sinks=0, window=8, top_k=0, dtype=dtype)
    tensors = ops.describe(q, k, v, y)
    for i, t in enumerate((q, k, v, y)):
        assert _kvmem.view_data(m.handle, tensors, i) == t.data_ptr()


@pytest.mark.parametrize("make", [
    lambda: kvmem.KvmMemory(D, HQ, HKV, batch=B, chunk=64, window_chunks=2, max_rows=64, budget=kvmem.budget.Fixed(64)),
    lambda: kvmem.EvictionMemory(D, HQ, HKV, batch=B, scorer="h2o", sinks=4, window=32, top_k=64),
], ids=["kvm", "h2o"])
def test_no_copy_of_tokens_and_no_allocation_when_steady(rand, make):
    T = 512
    q, k, v = rand(B, HQ, T, D), rand(B, HKV, T, D), rand(B, HKV, T, D)
    smallest_token_tensor = k[:, :, :1].numel() * 4  # one decode step's k: B * Hkv * D floats
    m = make()
    y = torch.zeros(B, HQ, T, D)
    _kvmem.count_events(True)
    try:
        m.prefill(q, k, v, y=y)
        prefill = _kvmem.event_counts()
        _kvmem.count_events(True)  # restart the counts
        for s in range(8):  # warm-up steps may grow scratch space
            m.decode(q[:, :, s:s + 1], k[:, :, s:s + 1], v[:, :, s:s + 1], y=y[:, :, s:s + 1])
        _kvmem.count_events(True)
        for s in range(8, 40):
            m.decode(q[:, :, s:s + 1], k[:, :, s:s + 1], v[:, :, s:s + 1], y=y[:, :, s:s + 1])
        steady = _kvmem.event_counts()
    finally:
        _kvmem.count_events(False)
    # prefill: no deep copy as large as the inputs (q is B * Hq * T * D floats)
    assert prefill["largest_deep_copy_bytes"] < q.numel() * 4, prefill
    # decode: nothing allocated, and no deep copy the size of a token tensor (only the small plan arrays)
    assert steady["allocations"] == 0, steady
    assert steady["largest_deep_copy_bytes"] < smallest_token_tensor, steady
    assert torch.count_nonzero(y[:, :, :40]) > 0


def test_output_written_in_place(rand):
    T = 20
    m = kvmem.EvictionMemory(D, HQ, HKV, batch=B, scorer="knorm", sinks=1, window=4, top_k=4)
    y = torch.full((B, HQ, T, D), float("nan"))
    out = m.prefill(rand(B, HQ, T, D), rand(B, HKV, T, D), rand(B, HKV, T, D), y=y)
    assert out is y and not torch.isnan(y).any()
