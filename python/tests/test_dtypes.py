"""bfloat16 and float16 through the Python door: a memory made with ``dtype=`` takes and writes tensors of
that dtype as they are (no cast, no copy), holds its keys and values in it, and refuses any other dtype
with an error naming the tensor, both in the memory classes and in the C++ module behind the custom ops.
The bits against kvmem-run are in test_kvmem_run_equality.py; the numerics against float64 in the C++
tests (docs/numerics.md)."""

import pytest
import torch

import kvmem
from kvmem import _kvmem, ops

B, HQ, HKV, T, D = 2, 4, 2, 40, 16
HALF = [torch.bfloat16, torch.float16]


def kvm(dtype):
    return kvmem.KvmMemory(D, HQ, HKV, batch=B, chunk=4, window_chunks=2, max_rows=8, budget=kvmem.budget.Fixed(8), dtype=dtype)


def qkv(rand, dtype, tokens=T):
    return rand(B, HQ, tokens, D).to(dtype), rand(B, HKV, tokens, D).to(dtype), rand(B, HKV, tokens, D).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int16, torch.float8_e4m3fn], ids=str)
def test_unsupported_dtype_is_refused_at_construction(dtype):
    with pytest.raises(TypeError, match=rf"dtype = {dtype}: must be torch\.float32, torch\.bfloat16 or torch\.float16"):
        kvm(dtype)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_other_dtypes_are_refused_naming_the_tensor(rand, dtype):
    m = kvm(dtype)
    q, k, v = qkv(rand, dtype)
    other = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
    with pytest.raises(TypeError, match=rf"q\.dtype = torch\.float32: must be the memory's dtype {dtype}"):
        m.prefill(q.float(), k, v)
    with pytest.raises(TypeError, match=rf"k\.dtype = {other}: must be the memory's dtype {dtype}"):
        m.prefill(q, k.to(other), v)
    with pytest.raises(TypeError, match=rf"y\.dtype = torch\.float32: must be the memory's dtype {dtype}"):
        m.prefill(q, k, v, y=torch.empty(B, HQ, T, D))
    with pytest.raises(TypeError, match=rf"gate\.dtype = torch\.float32: must be {dtype}"):
        m.prefill(q, k, v, torch.zeros(B, HKV, T))
    assert m.tokens(0) == 0, "a rejected call changed the memory"


def test_custom_op_path_checks_the_dtype_in_cpp(rand):
    """The descriptor carries the dtype: float32 tensors handed to a bfloat16 memory's handle (as a traced
    graph would, past the Python class) are refused by the C++ module, not read as 16-bit data."""
    m = kvm(torch.bfloat16)
    q, k, v = qkv(rand, torch.float32)
    y = torch.empty(B, HQ, T, D)
    with pytest.raises(ValueError, match=r"q\.dtype = float32: must be the memory's dtype bfloat16"):
        ops.call(_kvmem.prefill, m.handle, q, k, v, [], y, [])
    with pytest.raises(TypeError, match=r"k\.dtype = torch\.bfloat16: must be q's dtype torch\.float32"):
        ops.describe(q, k.bfloat16(), v, y)
    assert m.tokens(0) == 0


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_outputs_and_state_in_the_memory_dtype(rand, dtype):
    """y comes in the memory's dtype, prefill and decode give the same bits, and the state export widens
    an eviction cache's stored 16-bit keys exactly (every value is one of the dtype's, and the kept keys are
    the input's)."""
    q, k, v = qkv(rand, dtype)
    a, b = kvm(dtype), kvm(dtype)
    y = a.prefill(q, k, v)
    assert y.dtype == dtype
    steps = torch.cat([b.decode(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1]) for t in range(T)], dim=2)
    assert torch.equal(y.view(torch.int16), steps.view(torch.int16))
    assert a.state()["rows"] == [8, 8]
    e = kvmem.EvictionMemory(D, HQ, HKV, batch=B, scorer="knorm", sinks=2, window=8, top_k=6, dtype=dtype)
    e.prefill(q, k, v)
    s = e.state()
    assert s["keys"].dtype == torch.float32 and torch.equal(s["keys"], s["keys"].to(dtype).float())
    compared = 0
    for b_ in range(B):
        for h in range(HKV):
            for slot, pos in enumerate(s["slot_positions"][b_, h].tolist()):
                if pos >= 0:
                    assert torch.equal(s["keys"][b_, h, slot], k[b_, h, pos].float())
                    compared += 1
    assert compared >= B * HKV * (2 + 8 + 6)  # every kept token


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_16_bit_storage_holds_half_the_bytes(rand, dtype):
    """An eviction memory's keys and values take 2 bytes per element instead of 4 (held_bytes), and its
    output stays within a few 16-bit roundings of the float32 memory's on the same (rounded) inputs."""
    make = lambda dt: kvmem.EvictionMemory(D, HQ, HKV, batch=B, scorer="h2o", sinks=2, window=8, top_k=16, dtype=dt)
    q, k, v = qkv(rand, dtype)
    half, full = make(dtype), make(torch.float32)
    y16, y32 = half.prefill(q, k, v), full.prefill(q.float(), k.float(), v.float())
    assert 2 * half.held_bytes() == full.held_bytes()
    # same inputs: only y's final rounding and the stored values' order of operations differ; the kept
    # set can differ where two H2O scores are within float32 rounding, which these inputs do not hit
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(y16.float(), y32, rtol=2 * eps, atol=2 * eps)
