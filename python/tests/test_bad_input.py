"""Bad input raises TypeError/ValueError naming the argument, its value and what was expected, before any
kernel runs (the memory is unchanged afterwards); nothing is copied or cast silently."""

import re

import pytest
import torch

import kvmem

B, HQ, HKV, T, D = 2, 4, 2, 12, 8


@pytest.fixture
def memory():
    return kvmem.KvmMemory(D, HQ, HKV, batch=B, chunk=4, window_chunks=2, max_rows=8, budget=kvmem.budget.Fixed(8))


@pytest.fixture
def qkv(rand):
    return rand(B, HQ, T, D), rand(B, HKV, T, D), rand(B, HKV, T, D)


def raises(memory, exc, pattern, *args, **kwargs):
    before = memory.tokens(0)
    with pytest.raises(exc, match=pattern):
        memory.prefill(*args, **kwargs)
    assert memory.tokens(0) == before, "a rejected call changed the memory"


def test_wrong_dtype(memory, qkv):
    q, k, v = qkv
    raises(memory, TypeError, r"q\.dtype = torch\.float64: must be the memory's dtype torch\.float32", q.double(), k, v)
    raises(memory, TypeError, r"v\.dtype = torch\.bfloat16: must be the memory's dtype torch\.float32", q, k, v.bfloat16())


def test_not_a_tensor(memory, qkv):
    q, k, v = qkv
    raises(memory, TypeError, r"k = list: must be a torch\.Tensor", q, k.tolist(), v)


def test_wrong_device(memory, qkv):
    q, k, v = qkv
    raises(memory, ValueError, r"q\.device = meta: must be the memory's device cpu", q.to("meta"), k, v)


def test_output_on_another_device(memory, qkv):
    raises(memory, ValueError, r"y\.device = meta", *qkv, y=torch.empty(B, HQ, T, D, device="meta"))


def test_non_contiguous_channels(memory, qkv):
    q, k, v = qkv
    strided = torch.empty(B, HKV, T, 2 * D)[..., ::2]
    strided.copy_(k)
    raises(memory, ValueError, r"k\.stride\(-1\) = 2: channels must be contiguous", q, strided, v)


def test_mismatched_heads_and_head_dim(memory, qkv, rand):
    q, k, v = qkv
    raises(memory, ValueError, r"q heads = 3: must equal 4", rand(B, 3, T, D), k, v)
    raises(memory, ValueError, r"k heads = 4: must equal 2", q, rand(B, 4, T, D), v)
    raises(memory, ValueError, r"q channels = 16: must equal 8", rand(B, HQ, T, 16), k, v)
    raises(memory, ValueError, r"v channels = 4: must equal 8", q, k, rand(B, HKV, T, 4))
    raises(memory, ValueError, r"k tokens = 11: must equal the token count of q \(12\)", q, k[:, :, :11], v)


def test_wrong_batch(memory, rand):
    raises(memory, ValueError, r"q\.shape\[0\] = 3: must equal the memory's batch size 2",
           rand(3, HQ, T, D), rand(3, HKV, T, D), rand(3, HKV, T, D))
    raises(memory, ValueError, r"\[tokens, heads, channels\] layout holds one sequence, but the memory's batch is 2",
           rand(T, HQ, D), rand(T, HKV, D), rand(T, HKV, D))


def test_wrong_rank_and_gate(memory, qkv, rand):
    q, k, v = qkv
    raises(memory, ValueError, r"q\.dim\(\) = 2: must be one of \(3, 4\)", q[0, 0], k, v)
    raises(memory, ValueError, r"gate\.shape = \(2, 2, 11\): must be \[B, H, T\] = \(2, 2, 12\)", q, k, v, rand(B, HKV, 11))


def test_lengths(memory, qkv):
    raises(memory, ValueError, r"len\(lengths\) = 1: must equal the batch size 2", *qkv, lengths=[3])
    raises(memory, ValueError, re.escape("lengths[1] = 13"), *qkv, lengths=[3, 13])


def test_aliased_output(memory, qkv):
    q, k, v = qkv
    raises(memory, ValueError, r"y: must not alias the input q", q, k, v, y=q)


def test_prefill_twice_continues(memory, qkv):
    """A second prefill is no error: it continues every sequence (chunked prefill; test_lifecycle.py checks
    the bits against one prefill)."""
    memory.prefill(*qkv)
    memory.prefill(*qkv)
    assert memory.tokens(0) == memory.tokens(1) == 2 * qkv[0].shape[2]


def test_bad_configuration():
    with pytest.raises(ValueError, match=r"query_heads = 4: must be a multiple of kv_heads \(3\)"):
        kvmem.KvmMemory(D, 4, 3)
    with pytest.raises(ValueError, match=r"chunk = 0"):
        kvmem.KvmMemory(D, 4, 2, chunk=0)
    with pytest.raises(TypeError, match=r"budget = 12: must be kvmem\.budget"):
        kvmem.KvmMemory(D, 4, 2, budget=12)
    with pytest.raises(ValueError, match=r"scorer = lru"):
        kvmem.EvictionMemory(D, 4, 2, scorer="lru")
    with pytest.raises(ValueError, match=r"phi = gelu"):
        kvmem.TrellisMemory(4, D, 2, phi="gelu")
    with pytest.raises(ValueError, match=r"ln_weight\.shape = \(4,\): must be \[8\]"):
        kvmem.KvmMemory(D, 4, 2, ln_weight=torch.ones(4))


def test_released_memory(memory, qkv):
    memory.close()
    with pytest.raises(ValueError, match=r"handle = 0"):
        memory.prefill(*qkv)


def test_compression_bad_input(qkv):
    """An observation window longer than the chunk, or than a prompt into an empty sequence at chunk 0, is
    refused naming observation_window, before anything changes; a later piece of the prompt may be shorter."""
    with pytest.raises(ValueError, match=r"observation_window = 5: must be at most chunk = 4"):
        kvmem.EvictionMemory(D, HQ, HKV, batch=B, sinks=1, window=2, top_k=3, chunk=4, observation_window=5)
    memory = kvmem.EvictionMemory(D, HQ, HKV, batch=B, sinks=1, window=2, top_k=3, chunk=0, observation_window=8)
    q, k, v = qkv
    raises(memory, ValueError, r"observation_window = 8: is longer than the prompt of sequence 0 \(5 tokens",
           q[:, :, :5], k[:, :, :5], v[:, :, :5])
    memory.prefill(q[:, :, :8], k[:, :, :8], v[:, :, :8])
    memory.extend(q[:, :, 8:], k[:, :, 8:], v[:, :, 8:])  # 4 tokens: a later piece, all of them observe
    assert memory.tokens(0) == memory.tokens(1) == T
