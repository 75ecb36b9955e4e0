"""Distillation's pieces on a tiny Llama built here: the capture sees what the model computes, a model with
the training form in every layer computes what KvmemCache computes with the C++ memories on the same
trained weights (file written and read back), a per-layer fit lowers its error, and a weights file that
does not fit is a clear error."""

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kvmem  # noqa: E402
import kvmem.transformers as kt  # noqa: E402
from kvmem import weights as kw  # noqa: E402
from kvmem.train.capture import LayerInputs, capture, exact_attention  # noqa: E402
from kvmem.train.distill import (KvmParameters, KvmSetup, KvpopParameters, KvpopSetup, OvqParameters,  # noqa: E402
                                 OvqSetup, fit_end_to_end, fit_kvm_layer, fit_kvpop_layer, fit_ovq_layer,
                                 memory_weights, parameters_of)
from kvmem.train.model import memories_in_every_layer  # noqa: E402

from conftest import PROMPT_TOKENS as T  # noqa: E402  (the prompt fixture's tokens)

SETUP = KvmSetup(chunk=8, window_chunks=1, sinks=1, max_rows=24, budget=kvmem.budget.Fixed(16))


def logits(model, prompt, **kwargs):
    with torch.no_grad():
        return model(prompt, use_cache="past_key_values" in kwargs, **kwargs).logits


class Exact(torch.nn.Module):
    def forward(self, inputs, setup):
        return exact_attention(inputs.q, inputs.k, inputs.v)


def trained_layers(seed=1, layers=3, hidden=64, hq=4, hkv=2, d=16):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(layers):
        p = KvmParameters(hidden, hq, hkv, d)
        with torch.no_grad():
            p.gate_weight.copy_(0.3 * torch.randn(hidden, hkv, generator=g))
            p.ln_weight.copy_(1 + 0.3 * torch.randn(d, generator=g))
            p.ln_bias.copy_(0.3 * torch.randn(d, generator=g))
            p.log_tau_state.copy_(0.3 * torch.randn(hq, generator=g))
            p.log_tau_window.copy_(0.3 * torch.randn(hq, generator=g))
        out.append(p)
    return out


def test_capture_and_exact_attention_reproduce_the_model(model, prompt):
    model.set_attn_implementation("sdpa")
    want = logits(model, prompt)
    layers = capture(model, prompt)
    assert len(layers) == 3 and model.config._attn_implementation == "sdpa"
    assert layers[0].x.shape == (2, T, 64) and layers[0].q.shape == (2, 4, T, 16) and layers[0].k.shape == (2, 2, T, 16)
    with memories_in_every_layer(model, [Exact()] * 3, SETUP):
        got = logits(model, prompt)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_trained_weights_run_in_kvmem_as_in_training(model, prompt, tmp_path):
    """The training form in every layer (differentiable, PyTorch) and KvmemCache with the C++ KVM memories on
    the weights file give the same logits: what is trained is what kvmem runs, merge gate from x included."""
    layers = trained_layers()
    with memories_in_every_layer(model, layers, SETUP):
        trained = logits(model, prompt)
    path = tmp_path / "kvm.safetensors"
    kw.save(path, memory_weights("kvm", "tiny-llama", model, [p.tensors() for p in layers], {"recipe": "test"}))
    assert os.listdir(tmp_path) == ["kvm.safetensors"]
    cache = kt.KvmemCache(model, kt.kvm(weights=path, **SETUP.memory_args()))
    ran = logits(model, prompt, past_key_values=cache)
    torch.testing.assert_close(ran, trained, rtol=1e-4, atol=1e-4)
    model.set_attn_implementation("sdpa")
    neutral = logits(model, prompt, past_key_values=kt.KvmemCache(model, kt.kvm(**SETUP.memory_args())))
    assert (neutral - ran).abs().max() > 1e-3  # the weights matter


def test_decode_with_trained_weights_continues_the_prefill(model, prompt, tmp_path):
    """Prefill then token-by-token decode through KvmemCache with trained weights (the gate computed from the
    hooked x at every step) gives the logits of one pass."""
    path = tmp_path / "kvm.safetensors"
    kw.save(path, memory_weights("kvm", "tiny-llama", model, [p.tensors() for p in trained_layers(2)]))
    factory = kt.kvm(weights=path, **SETUP.memory_args())
    whole = logits(model, prompt, past_key_values=kt.KvmemCache(model, factory))
    cache = kt.KvmemCache(model, factory)
    steps = [logits(model, prompt[:, :20], past_key_values=cache)]
    for t in range(20, T):
        steps.append(logits(model, prompt[:, t:t + 1], past_key_values=cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=1e-4, atol=1e-4)


def test_fit_lowers_the_layer_error(model, prompt):
    layers = capture(model, prompt)
    fit = fit_kvm_layer([layers[1]], SETUP, steps=8, lr=0.05)
    assert len(fit.curve) == 9 and fit.curve[-1] < 0.9 * fit.curve[0]
    assert set(fit.tensors) == set(kw.TENSORS["kvm"])


def test_trained_ovq_weights_run_in_kvmem_as_in_training(model, prompt, tmp_path):
    setup = OvqSetup(chunk=8, max_centroids=16)
    g = torch.Generator().manual_seed(5)
    layers = [OvqParameters(0.5 + torch.rand(4, generator=g)) for _ in range(3)]
    with memories_in_every_layer(model, layers, setup):
        trained = logits(model, prompt)
    path = tmp_path / "ovq.safetensors"
    kw.save(path, memory_weights("ovq", "tiny-llama", model, [p.tensors() for p in layers]))
    ran = logits(model, prompt, past_key_values=kt.KvmemCache(model, kt.ovq(weights=path, **setup.memory_args())))
    torch.testing.assert_close(ran, trained, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="holds 'ovq' weights, expected 'kvm'"):
        kt.kvm(weights=path)


def test_ovq_fit_starts_at_the_closed_form_and_lowers_the_error(model, prompt):
    layer = capture(model, prompt)[1]
    setup = OvqSetup(chunk=8, max_centroids=16)
    fit = fit_ovq_layer([layer], setup, steps=8, lr=0.1)
    start = OvqParameters(OvqParameters.closed_form(layer))
    with torch.no_grad():
        first = kvmem.train.distill.relative_error(start(layer, setup), exact_attention(layer.q, layer.k, layer.v))
    assert fit.curve[0] == pytest.approx(first.item(), rel=1e-6)
    assert fit.curve[-1] < fit.curve[0] and set(fit.tensors) == {"beta"}


def test_end_to_end_fit_lowers_the_kl_and_leaves_the_model(model, prompt):
    """Stage 2 from stage-1-like parameters: the KL divergence to the full-cache model falls, the model's own
    weights do not change, and its attention implementation is restored."""
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    layers = [parameters_of("kvm", p.tensors()) for p in trained_layers(4)]
    curve = fit_end_to_end(model, layers, SETUP, [prompt[:1], prompt[1:]], steps=6, lr=0.05)
    assert len(curve) == 7 and curve[-1] < curve[0]
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert model.config._attn_implementation != "kvmem_train"
    with pytest.raises(ValueError, match="steps = -1"):
        fit_end_to_end(model, layers, SETUP, [prompt[:1]], steps=-1)


def test_parameters_round_trip_through_their_tensors():
    p = trained_layers(6, layers=1)[0]
    q = parameters_of("kvm", p.tensors())
    for name, t in p.tensors().items():
        torch.testing.assert_close(q.tensors()[name], t, rtol=1e-6, atol=0)
    beta = torch.tensor([0.5, 1.0, 2.0, 4.0])
    torch.testing.assert_close(parameters_of("ovq", {"beta": beta}).tensors()["beta"], beta)


def test_fit_refuses_bad_arguments(model, prompt):
    layers = capture(model, prompt)
    with pytest.raises(ValueError, match="steps = -1"):
        fit_kvm_layer([layers[0]], SETUP, steps=-1)
    with pytest.raises(ValueError, match="batches"):
        fit_kvm_layer([], SETUP, steps=1)
    with pytest.raises(ValueError, match="layers: 2 given"):
        with memories_in_every_layer(model, [Exact()] * 2, SETUP):
            pass


def weights_file(tmp_path, model, change=None, memory="kvm", name="tiny-llama"):
    layers = [p.tensors() for p in trained_layers()]
    w = kw.MemoryWeights(memory, name, dict(kvmem.train.distill.model_shape(model)), dict(enumerate(layers)))
    if change:
        change(w)
    path = tmp_path / "w.safetensors"
    from safetensors.torch import save_file
    save_file({f"layers.{i}.{n}": t for i, ts in w.layers.items() for n, t in ts.items()}, str(path),
              metadata={"format": kw.FORMAT, "memory": w.memory, "model": w.model, "shape": __import__("json").dumps(w.shape)})
    return path


@pytest.mark.parametrize("change, load_args, message", [
    (lambda w: w.layers[1].pop("tau_state"), {}, r"tensor layers.1.tau_state is missing \(expected shape \[4\]\)"),
    (lambda w: w.layers[2].update(ln_bias=torch.zeros(15)), {}, r"tensor layers.2.ln_bias has shape \[15\]"),
    (lambda w: w.layers[0].update(beta=torch.ones(4)), {}, r"layers.0.beta is not a kvm tensor"),
    (None, {"model": "SmolLM2"}, r"trained for model 'tiny-llama', expected 'SmolLM2'"),
    (None, {"memory": "ovq"}, r"holds 'kvm' weights, expected 'ovq'"),
    (None, {"shape": {"hidden": 576}}, r"hidden = 64, expected 576"),
])
def test_bad_weights_file_names_file_tensor_and_shape(model, tmp_path, change, load_args, message):
    path = weights_file(tmp_path, model, change)
    with pytest.raises(ValueError, match=message) as e:
        kw.load(path, **load_args)
    assert str(path) in str(e.value)


def test_weights_for_another_model_size_are_refused_by_the_cache(model, tmp_path):
    path = weights_file(tmp_path, model, lambda w: w.shape.update(layers=2) or w.layers.pop(2))
    with pytest.raises(ValueError, match="layers = 2, but the model has 3"):
        kt.KvmemCache(model, kt.kvm(weights=path, **SETUP.memory_args()))
    with pytest.raises(FileNotFoundError, match="not found"):
        kt.kvm(weights=tmp_path / "missing.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a safetensors file"):
        kt.kvm(weights=tmp_path / "junk.safetensors")


def test_save_refuses_bad_weights_and_leaves_no_file(model, tmp_path):
    layers = [p.tensors() for p in trained_layers()]
    layers[0]["gate_weight"] = torch.zeros(64, 3)
    with pytest.raises(ValueError, match=r"layers.0.gate_weight has shape \[64, 3\]"):
        memory_weights("kvm", "tiny-llama", model, layers)
    w = kw.MemoryWeights("kvm", "tiny-llama", kvmem.train.distill.model_shape(model), dict(enumerate(layers)))
    with pytest.raises(ValueError, match="gate_weight"):
        kw.save(tmp_path / "w.safetensors", w)
    assert os.listdir(tmp_path) == []


KVPOP = KvpopSetup(sinks=2, window=6, top_k=10)


def test_kvpop_fit_lowers_the_ranking_loss(model, prompt):
    """fit_kvpop_layer trains one layer's scorers on KVPOP's ranking loss against the layer's importance teacher."""
    layer = capture(model, prompt)[1]
    fit = fit_kvpop_layer([layer], KVPOP, steps=6, lr=0.02)
    assert len(fit.curve) == 7 and fit.curve[-1] < fit.curve[0]
    assert set(fit.tensors) == set(kw.TENSORS["kvpop"])


def test_trained_kvpop_weights_load_into_the_cpp_scorers(model, prompt, tmp_path):
    """A KVPOP weights file (written, read back) gives each layer's C++ EvictionMemory the trained scorers: its
    prefill on the layer's captured inputs is that of a memory built from the tensors directly, KvmemCache runs
    the model with them, and other scorers give other logits."""
    layers = [KvpopParameters(2, 16, seed=s) for s in range(3)]
    path = tmp_path / "kvpop.safetensors"
    kw.save(path, memory_weights("kvpop", "tiny-llama", model, [p.tensors() for p in layers]))
    factory = kt.eviction("kvpop", weights=path, **KVPOP.memory_args())
    captured = capture(model, prompt)[2]
    shape = dict(head_dim=16, query_heads=4, kv_heads=2, value_dim=16, batch=prompt.shape[0])
    from_file = factory(2, **shape).prefill(captured.q, captured.k, captured.v)
    direct = kvmem.EvictionMemory(16, 4, 2, batch=prompt.shape[0], scorer="kvpop", weights=layers[2].tensors(),
                                  **KVPOP.memory_args())
    assert torch.equal(from_file, direct.prefill(captured.q, captured.k, captured.v))
    ran = logits(model, prompt, past_key_values=kt.KvmemCache(model, factory))
    other = [KvpopParameters(2, 16, seed=s + 10) for s in range(3)]
    kw.save(path, memory_weights("kvpop", "tiny-llama", model, [p.tensors() for p in other]))
    assert (logits(model, prompt, past_key_values=kt.KvmemCache(model, kt.eviction("kvpop", weights=path, **KVPOP.memory_args())))
            - ran).abs().max() > 1e-4
    with pytest.raises(ValueError, match="scorer 'kvpop'"):
        kt.eviction("h2o", weights=path)
    params = parameters_of("kvpop", layers[0].tensors())
    for name, t in layers[0].tensors().items():
        assert torch.equal(params.tensors()[name], t)
