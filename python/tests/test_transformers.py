"""The transformers backend: generate() of a tiny Llama built here runs with a kvmem memory in every
layer; an eviction memory whose budget holds every token gives the full cache's tokens; a small memory
holds fewer bytes than the full cache; bfloat16 and float16 models run in their dtype; padding, a float64
model and a missing cache are clear errors."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kvmem  # noqa: E402
import kvmem.transformers as kt  # noqa: E402

from conftest import PROMPT_TOKENS as PROMPT  # noqa: E402  (the prompt fixture's tokens)

NEW = 24


def generate(model, prompt, cache=None):
    if cache is None:
        model.set_attn_implementation("sdpa")  # KvmemCache switched it to "kvmem"
    with torch.no_grad():
        kwargs = {} if cache is None else {"past_key_values": cache}
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW, do_sample=False,
                              min_new_tokens=NEW, **kwargs)


@pytest.mark.parametrize("factory", [
    kt.eviction("h2o", sinks=4, window=32, top_k=64),
    kt.eviction("tova", sinks=1, window=8, top_k=80),
    kt.eviction("streaming", sinks=4, window=32, top_k=64, merge_evicted=True),
    kt.proportional(chunk=8, window_chunks=2, sinks=1, max_rows=128, budget=kvmem.budget.Fixed(128)),
], ids=["h2o", "tova", "streaming-merge", "proportional"])
def test_memory_holding_every_token_is_the_full_cache(model, prompt, factory):
    """Prefill then decode token by token through the kvmem backend gives the logits of one full forward
    pass with transformers' own attention, when the memory's budget holds every token."""
    ids = torch.cat([prompt, torch.randint(3, 96, (2, NEW), generator=torch.Generator().manual_seed(8))], dim=1)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        full = model(ids).logits
        cache = kt.KvmemCache(model, factory)
        steps = [model(ids[:, :PROMPT], past_key_values=cache).logits]
        steps += [model(ids[:, t:t + 1], past_key_values=cache).logits for t in range(PROMPT, PROMPT + NEW)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-5)
    assert cache.get_seq_length() == PROMPT + NEW
    assert all(layer.memory is not None for layer in cache.layers)


def test_generate_runs_every_layer_through_kvmem(model, prompt):
    cache = kt.KvmemCache(model, kt.eviction("h2o", sinks=4, window=32, top_k=64))
    got = generate(model, prompt, cache)
    assert got.shape == (2, PROMPT + NEW) and torch.equal(got[:, :PROMPT], prompt)
    assert cache.get_seq_length() == PROMPT + NEW - 1  # the last token is sampled, not attended
    assert [layer.memory.tokens(1) for layer in cache.layers] == [PROMPT + NEW - 1] * 3


@pytest.mark.parametrize("factory", [
    kt.kvm(chunk=8, window_chunks=1, max_rows=8, budget=kvmem.budget.Fixed(8)),
    kt.ovq(chunk=8, max_centroids=8),
    kt.eviction("tova", sinks=2, window=8, top_k=8),
    kt.eviction("h2o", sinks=2, window=8, top_k=8, merge_evicted=True),
    kt.proportional(chunk=8, window_chunks=1, sinks=1, max_rows=8, budget=kvmem.budget.Fixed(8)),
], ids=["kvm", "ovq", "tova", "h2o-merge", "proportional"])
def test_small_memories_generate(model, prompt, factory):
    dynamic = transformers.DynamicCache(config=model.config)
    full = None
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        full = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW, min_new_tokens=NEW,
                              do_sample=False, past_key_values=dynamic)
    full_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in dynamic.layers)
    cache = kt.KvmemCache(model, factory)
    got = generate(model, prompt, cache)
    assert got.shape == full.shape and torch.equal(got[:, :PROMPT], prompt)
    assert 0 < cache.held_bytes() < full_bytes
    assert cache.get_seq_length() == PROMPT + NEW - 1


def test_padding_is_refused(model, prompt):
    mask = torch.ones_like(prompt)
    mask[0, :5] = 0
    cache = kt.KvmemCache(model, kt.eviction())
    with torch.no_grad(), pytest.raises(ValueError, match="attention_mask: has padded tokens"):
        model.generate(prompt, attention_mask=mask, past_key_values=cache, max_new_tokens=2)


def test_float64_model_is_refused(prompt):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1)
    m = transformers.LlamaForCausalLM(cfg).double().eval()
    cache = kt.KvmemCache(m, kt.eviction())
    with torch.no_grad(), pytest.raises(TypeError, match=r"q\.dtype = torch\.float64: the kvmem backend runs float32, bfloat16"):
        m(prompt[:1], past_key_values=cache)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_16_bit_model_runs_in_its_dtype(model, prompt, dtype):
    """A bfloat16 or float16 model runs through the backend in its own dtype: every layer's memory stores
    keys and values in it (half the bytes of the float32 model's memories), and with a budget that holds
    every token the logits of prefill + decode stay within the dtype's rounding of the model's own attention
    in that dtype."""
    import copy

    ids = torch.cat([prompt, torch.randint(3, 96, (2, NEW), generator=torch.Generator().manual_seed(8))], dim=1)
    factory = kt.eviction("h2o", sinks=4, window=32, top_k=64)
    m16 = copy.deepcopy(model).to(dtype)
    m16.set_attn_implementation("sdpa")
    with torch.no_grad():
        full = m16(ids).logits.float()
        cache = kt.KvmemCache(m16, factory)
        steps = [m16(ids[:, :PROMPT], past_key_values=cache).logits]
        steps += [m16(ids[:, t:t + 1], past_key_values=cache).logits for t in range(PROMPT, PROMPT + NEW)]
        cache32 = kt.KvmemCache(model, factory)
        model(ids, past_key_values=cache32)
    got = torch.cat(steps, dim=1)
    assert got.dtype == dtype and all(layer.memory.dtype == dtype for layer in cache.layers)
    assert 2 * cache.held_bytes() == cache32.held_bytes()
    # each layer's attention output differs from SDPA's by about one rounding of the dtype; three layers
    # and the head carry it into the logits (scale: the logits' largest magnitude). Measured: 0.5 eps
    # (bfloat16) and 0.6 eps (float16) of the largest logit; the bound is 4 eps.
    eps = torch.finfo(dtype).eps
    assert (got.float() - full).abs().max().item() <= 4 * eps * full.abs().max().item()
