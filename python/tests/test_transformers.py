"""The transformers backend: generate() of a tiny Llama built here runs with a kvmem memory in every
layer; an eviction memory whose budget holds every token gives the full cache's tokens; a small memory
holds fewer bytes than the full cache; bfloat16 and float16 models run in their dtype; padding, a float64
model and a missing cache are clear errors; the model is left as it was found (plain forwards and
generate() before and after a KvmemCache run are bit for bit the model's own, two caches run in turn)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kvmem  # noqa: E402
import kvmem.transformers as kt  # noqa: E402

from conftest import PROMPT_TOKENS as PROMPT  # noqa: E402  (the prompt fixture's tokens)

NEW = 24


def generate(model, prompt, cache=None):
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


def test_model_is_left_as_found(model, prompt):
    """kvmem's attention runs only in forwards given a KvmemCache: a plain forward and a plain generate()
    after a KvmemCache run give the model's own logits and tokens bit for bit, and its attention
    implementation is the one it had."""
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        before, before_40 = model(prompt).logits, model(prompt[:, :40]).logits
    tokens = generate(model, prompt)
    cache = kt.KvmemCache(model, kt.eviction("h2o", sinks=2, window=8, top_k=8))
    small = generate(model, prompt, cache)
    assert model.config._attn_implementation == "sdpa"
    with torch.no_grad():
        after = model(prompt[:, :40]).logits  # another prompt, of another length than the cache holds
        assert torch.equal(model(prompt).logits, before)
    assert torch.equal(after, before_40)
    assert torch.equal(generate(model, prompt), tokens)
    assert not torch.equal(small, tokens)  # the small memory did run (it changes the tokens)
    assert model.config._attn_implementation == "sdpa"


def test_two_caches_in_turn_on_one_model(model, prompt):
    """Two KvmemCaches of different memories stepped in turn on one model give each the logits it gives run
    alone, and a plain forward in between is the model's own."""
    factories = [kt.eviction("h2o", sinks=2, window=8, top_k=8), kt.eviction("tova", sinks=1, window=4, top_k=12)]
    ids = torch.cat([prompt, torch.randint(3, 96, (2, 6), generator=torch.Generator().manual_seed(9))], dim=1)

    calls = ids.shape[1] - PROMPT + 1  # the prompt, then each of the next tokens

    def step(cache, i):
        return model(ids[:, :PROMPT] if i == 0 else ids[:, PROMPT + i - 1:PROMPT + i], past_key_values=cache).logits

    with torch.no_grad():
        plain = model(ids).logits
        alone = []
        for f in factories:
            cache = kt.KvmemCache(model, f)
            alone.append([step(cache, i) for i in range(calls)])
        caches = [kt.KvmemCache(model, f) for f in factories]
        turns = [[], []]
        for i in range(calls):
            for got, cache in zip(turns, caches):
                got.append(step(cache, i))
            assert torch.equal(model(ids).logits, plain)
    for got, want in zip(turns, alone):
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    assert not torch.equal(turns[0][-1], turns[1][-1])


def test_cache_given_positionally_is_an_error(model, prompt):
    """A KvmemCache that reaches the layers without a hooked forward having been given it as the keyword
    past_key_values (here the inner model's, positionally) is an error, not the model's attention over this
    call's tokens alone. Given positionally to the outer model, it reaches the inner one as a keyword: kvmem."""
    cache = kt.KvmemCache(model, kt.eviction())
    with torch.no_grad(), pytest.raises(ValueError, match="past_key_values: a KvmemCache must be given"):
        model.model(prompt, None, None, cache)
    with torch.no_grad():
        model(prompt, None, None, kt.KvmemCache(model, kt.eviction()))


def test_kvmem_attention_outside_a_cache_forward_is_an_error(model, prompt):
    kt.register()
    model.set_attn_implementation("kvmem")
    try:
        with torch.no_grad(), pytest.raises(ValueError, match="runs only in a forward given past_key_values"):
            model(prompt)
    finally:
        model.set_attn_implementation("sdpa")


@pytest.mark.parametrize("scorer", ["snapkv", "h2o"])
def test_compression_at_the_end_of_the_prompt(model, prompt, scorer):
    """kt.eviction(..., chunk=0): generate's prefill attends the whole prompt exactly (the model's own logits),
    and the memory evicts down to its budget when generation moves to the first new token."""
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        full = model(prompt).logits
    cache = kt.KvmemCache(model, kt.eviction(scorer, sinks=2, window=8, top_k=8, chunk=0, observation_window=8))
    with torch.no_grad():
        got = model(prompt, past_key_values=cache).logits
    torch.testing.assert_close(got, full, rtol=1e-4, atol=1e-5)
    assert all(int(layer.memory.state()["kept_rows"].max()) == PROMPT for layer in cache.layers)  # held whole
    with torch.no_grad():
        model(prompt[:, -1:], past_key_values=cache)  # the first new token: the prompt is compressed
    assert all(int(layer.memory.state()["kept_rows"].max()) == 18 for layer in cache.layers)
