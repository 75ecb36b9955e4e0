"""The "distilled + adapters" variant on a tiny Llama built here: low-rank adapters on the q and k projections
(kvmem.adapters) run in KvmemCache with the C++ memories as in the training forms, only in forwards given that
cache; the per-layer form with adapters is the layer of the adapted model; the per-layer and end-to-end fits
train them; weights files carry them with their shapes checked."""

import pytest
import torch

pytest.importorskip("transformers")

import kvmem  # noqa: E402
import kvmem.transformers as kt  # noqa: E402
from kvmem import adapters as ka  # noqa: E402
from kvmem import weights as kw  # noqa: E402
from kvmem.train.capture import LayerInputs, capture  # noqa: E402
from kvmem.train.distill import (KvmParameters, KvmSetup, OvqSetup, fit_adapted_layer, fit_end_to_end,  # noqa: E402
                                 fit_kvm_layer, memory_weights, parameters_of)
from kvmem.train.model import memories_in_every_layer, memory_in_layer  # noqa: E402

from conftest import PROMPT_TOKENS as T  # noqa: E402

SETUP = KvmSetup(chunk=8, window_chunks=1, sinks=1, max_rows=24, budget=kvmem.budget.Fixed(16))
RANK = 3


def logits(model, prompt, **kwargs):
    with torch.no_grad():
        return model(prompt, use_cache="past_key_values" in kwargs, **kwargs).logits


def random_adapters(seed, layers=3, scale=0.3):
    """Adapters with non-zero up (the initial ones change nothing), sized for the tiny Llama."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(layers):
        a = ka.LayerAdapters.initial(64, 4 * 16, 2 * 16, RANK, seed=seed)
        with torch.no_grad():
            a.q.up.copy_(scale * torch.randn(64, RANK, generator=g))
            a.k.up.copy_(scale * torch.randn(32, RANK, generator=g))
        out.append(a)
    return out


def kvm_layers(seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(3):
        p = KvmParameters(64, 4, 2, 16)
        with torch.no_grad():
            p.gate_weight.copy_(0.3 * torch.randn(64, 2, generator=g))
            p.ln_bias.copy_(0.3 * torch.randn(16, generator=g))
        out.append(p)
    return out


def save(tmp_path, model, layers, adapters, name="kvm.safetensors"):
    path = tmp_path / name
    tensors = [p.tensors() | (a.tensors() if a is not None else {}) for p, a in zip(layers, adapters)]
    kw.save(path, memory_weights("kvm", "tiny-llama", model, tensors))
    return path


def test_initial_adapters_change_nothing_and_round_trip(model, prompt):
    a = ka.LayerAdapters.initial(64, 64, 32, RANK, seed=4)
    x = torch.randn(2, 5, 64)
    assert torch.equal(a.q(x), torch.zeros(2, 5, 64)) and a.k(x).shape == (2, 5, 32)
    b = ka.of_tensors(a.tensors())
    assert all(torch.equal(b.tensors()[n], t) for n, t in a.tensors().items())
    assert set(a.tensors()) == set(kw.ADAPTER_TENSORS) and ka.of_tensors({"beta": torch.ones(4)}) is None
    with pytest.raises(ValueError, match="adapter rank = 0"):
        ka.LayerAdapters.initial(64, 64, 32, 0)


def test_adapters_run_in_kvmem_as_in_training_and_only_with_their_cache(model, prompt, tmp_path):
    """The training form in every layer with adapters and KvmemCache with the C++ KVM memories on the weights
    file (adapters included) give the same logits, in one pass and in prefill + decode; the model without that
    cache (full cache, a cache without adapters) is unchanged."""
    model.set_attn_implementation("sdpa")
    plain = logits(model, prompt)
    layers, adapters = kvm_layers(1), random_adapters(2)
    with memories_in_every_layer(model, layers, SETUP, adapters):
        trained = logits(model, prompt)
    path = save(tmp_path, model, layers, adapters)
    assert kw.load(path).shape["adapter_rank"] == RANK
    factory = kt.kvm(weights=path, **SETUP.memory_args())
    ran = logits(model, prompt, past_key_values=kt.KvmemCache(model, factory))
    torch.testing.assert_close(ran, trained, rtol=1e-4, atol=1e-4)
    cache = kt.KvmemCache(model, factory)
    steps = [logits(model, prompt[:, :20], past_key_values=cache)]
    steps += [logits(model, prompt[:, t:t + 1], past_key_values=cache) for t in range(20, T)]
    torch.testing.assert_close(torch.cat(steps, dim=1), ran, rtol=1e-4, atol=1e-4)
    without = save(tmp_path, model, layers, [None] * 3, "plain.safetensors")
    other = logits(model, prompt, past_key_values=kt.KvmemCache(model, kt.kvm(weights=without, **SETUP.memory_args())))
    with memories_in_every_layer(model, layers, SETUP):
        torch.testing.assert_close(other, logits(model, prompt), rtol=1e-4, atol=1e-4)
    assert (other - ran).abs().max() > 1e-3  # the adapters matter
    out = model.generate(prompt[:1, :20], past_key_values=kt.KvmemCache(model, factory), max_new_tokens=3,
                         do_sample=False)  # generate gives the cache as a keyword: the adapters run
    assert out.shape == (1, 23)
    with torch.no_grad():  # the inner model given the cache on its own runs the adapters too
        inner = model.lm_head(model.model(prompt, past_key_values=kt.KvmemCache(model, factory)).last_hidden_state)
    torch.testing.assert_close(inner, ran, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="past_key_values: a KvmemCache must be given"):
        with torch.no_grad():  # given positionally, the forward's hooks do not see the cache
            model.model(prompt, None, None, kt.KvmemCache(model, factory))
    assert torch.equal(logits(model, prompt), plain)  # no adapter outside its cache's forwards


def test_one_layer_run_with_adapters_is_that_layer_of_the_adapted_model(model, prompt):
    """memory_in_layer runs the module again on the captured x: with adapters it reads the q and k the adapted
    model computes (captured with kvmem.adapters.attach on that layer alone), with its x and v unchanged."""
    adapters = random_adapters(3)
    plain = capture(model, prompt)
    hooks = ka.attach(model, lambda i: adapters[i] if i == 1 else None)
    try:
        adapted = capture(model, prompt)
    finally:
        hooks.remove()
    assert not torch.allclose(adapted[1].q, plain[1].q) and not torch.allclose(adapted[1].k, plain[1].k)
    assert torch.equal(adapted[1].x, plain[1].x) and torch.equal(adapted[1].v, plain[1].v)
    p = kvm_layers(5)[1]
    want = p(adapted[1], SETUP)
    with memory_in_layer(model, 1, p, SETUP, adapters[1]) as run:
        got = run(plain[1])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with memory_in_layer(model, 1, p, SETUP) as run:
        torch.testing.assert_close(run(plain[1]), p(plain[1], SETUP), rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match="without position embeddings"):
            run(LayerInputs(*plain[1][:4]))
    with pytest.raises(ValueError, match="layer_idx = 7"):
        with memory_in_layer(model, 7, p, SETUP):
            pass


def test_adapted_fit_starts_neutral_and_goes_below_the_memory_alone(model, prompt):
    """fit_adapted_layer starts where fit_kvm_layer starts (zero adapters) and, with the adapters, ends below
    what the memory's own parameters reach in the same steps; it writes both kinds of tensors."""
    layer = capture(model, prompt)[1]
    alone = fit_kvm_layer([layer], SETUP, steps=10)
    both = fit_adapted_layer(model, 1, [layer], SETUP, rank=4, steps=10, adapter_lr=0.02)
    assert both.curve[0] == pytest.approx(alone.curve[0], rel=1e-5)
    assert both.curve[-1] < alone.curve[-1]
    assert set(both.tensors) == set(kw.TENSORS["kvm"]) | set(kw.ADAPTER_TENSORS)
    ovq = fit_adapted_layer(model, 1, [layer], OvqSetup(chunk=8, max_centroids=16), rank=2, steps=3)
    assert set(ovq.tensors) == {"beta"} | set(kw.ADAPTER_TENSORS) and ovq.curve[-1] < ovq.curve[0]
    with pytest.raises(ValueError, match="adapter rank = 0"):
        fit_adapted_layer(model, 1, [layer], SETUP, rank=0, steps=1)
    with pytest.raises(ValueError, match="KvmSetup"):
        fit_adapted_layer(model, 1, [layer], "kvpop", rank=2, steps=1)


def test_end_to_end_fit_trains_the_adapters(model, prompt):
    layers = [parameters_of("kvm", p.tensors()) for p in kvm_layers(6)]
    adapters = [ka.LayerAdapters.initial(64, 64, 32, RANK, seed=i) for i in range(3)]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    curve = fit_end_to_end(model, layers, SETUP, [prompt[:1]], steps=5, lr=0.02, adapters=adapters, adapter_lr=0.02)
    assert curve[-1] < curve[0] and all(a.q.up.abs().max() > 0 for a in adapters)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    with pytest.raises(ValueError, match="adapters: 2 given"):
        fit_end_to_end(model, layers, SETUP, [prompt[:1]], steps=1, adapters=adapters[:2])


def test_adapter_tensors_are_checked(model, tmp_path):
    layers, adapters = kvm_layers(7), random_adapters(8)
    path = save(tmp_path, model, layers, adapters)
    w = kw.load(path)
    w.layers[1].pop("k_adapter_up")
    with pytest.raises(ValueError, match=r"tensor layers.1.k_adapter_up is missing \(expected shape \[32, 3\]\)"):
        w.check()
    w = kw.load(path)
    w.layers[0]["q_adapter_down"] = torch.zeros(2, 64)
    with pytest.raises(ValueError, match=r"layers.0.q_adapter_down has shape \[2, 64\]"):
        w.check()
    w = kw.load(path)
    w.shape["adapter_rank"] = 0
    with pytest.raises(ValueError, match=r"layers.0.k_adapter_down is not a kvm tensor"):
        w.check()


def test_tensors_digest_names_the_weights_and_catches_a_change(model, tmp_path):
    """save records tensors_sha256 (what causal_lm.py --adapters writes into a capture); load refuses a file
    whose tensors were changed after it was written."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = save(tmp_path, model, kvm_layers(9), random_adapters(10))
    w = kw.load(path)
    assert w.metadata["tensors_sha256"] == kw.tensors_digest(w.layers)
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = f.metadata(), {n: f.get_tensor(n) for n in f.keys()}
    tensors["layers.2.k_adapter_up"][0, 0] += 1.0
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(ValueError, match="do not match its metadata tensors_sha256"):
        kw.load(path)
