"""Tests of the causal-LM fidelity tools (tools/capture/causal_lm.py, tools/fidelity/): a tiny Llama with
random weights stands in for SmolLM2 (no download), and every computation is checked against a small,
obviously correct reference. Runs with pytest in the Python environment where kvmem is installed
(CTest fidelity.tools; scripts/test).
"""
from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest
import torch

import calibrate  # noqa: E402
import causal_lm  # noqa: E402
import continuation  # noqa: E402
import end_to_end  # noqa: E402
import lm_memories  # noqa: E402
from capture import neutral_kvm_inputs, read_safetensors, write_safetensors  # noqa: E402


class WordTokenizer:
    """Enough of a tokenizer for causal_lm.main: one id per character."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 97 for c in text]}


def test_capture_is_what_the_softmax_reads(tiny):
    """SDPA over the captured q, k, v (RoPE'd, GQA) reproduces each layer's attention output."""
    ids = [[5, 17, 3, 44, 9, 12, 70, 1, 2, 33, 8], [4, 4, 90, 61, 7]]
    got = causal_lm.capture(tiny, ids, [0, 1])
    for layer in (0, 1):
        q, k, v = (torch.from_numpy(t) for t in got[layer])
        assert q.shape == (2, 4, 11, 16) and k.shape == (2, 2, 11, 16) and v.shape == (2, 2, 11, 16)
        assert torch.all(q[1, :, 5:] == 0)  # past the second text's length
        seen = []
        hook = tiny.model.layers[layer].self_attn.o_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
        try:
            for b, seq in enumerate(ids):
                seen.clear()
                with torch.no_grad():
                    tiny(torch.tensor([seq]))
                n = len(seq)
                ref = seen[0].reshape(1, n, 4, 16).transpose(1, 2)
                y = torch.nn.functional.scaled_dot_product_attention(q[b:b + 1, :, :n], k[b:b + 1, :, :n],
                                                                     v[b:b + 1, :, :n], is_causal=True, enable_gqa=True)
                torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
        finally:
            hook.remove()
    assert tiny.config._attn_implementation != "kvmem_capture"  # restored


def test_capture_cli(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(causal_lm, "load_model", lambda name: (tiny, WordTokenizer(), "tiny"))
    text = tmp_path / "t.txt"
    text.write_text("attention memory keys and values")
    assert causal_lm.main(["--text", str(text), "--output-dir", str(tmp_path), "--max-tokens", "20"]) == 0
    t, meta = read_safetensors(str(tmp_path / "layer1.safetensors"))
    assert t["q"].shape == (1, 4, 20, 16) and list(t["lengths"]) == [20] and meta["layer"] == "1"
    assert np.all(t["ln_weight"] == 1) and np.all(t["gate"] == 0)
    cases = [(["--text", str(tmp_path / "none.txt")], "none.txt"),
             (["--text", str(text), "--layers", "2"], "layer 2 is outside [0, 2)"),
             (["--text", str(text), "--max-tokens", "513"], "beyond the model's context of 512 tokens")]
    for args, message in cases:
        assert causal_lm.main(args + ["--output-dir", str(tmp_path)]) == 2
        assert message in capsys.readouterr().err
    assert causal_lm.main(["--text", str(text), "--output-dir", str(tmp_path / "no")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_capture_attention_input(tiny, tmp_path, monkeypatch):
    """--attention-input writes x [B, T, hidden], the attention module's input: its value projection is the
    captured v (v has no RoPE)."""
    monkeypatch.setattr(causal_lm, "load_model", lambda name: (tiny, WordTokenizer(), "tiny"))
    text = tmp_path / "t.txt"
    text.write_text("attention memory keys and values")
    assert causal_lm.main(["--text", str(text), "--output-dir", str(tmp_path), "--max-tokens", "20", "--layers", "1",
                           "--attention-input"]) == 0
    t, meta = read_safetensors(str(tmp_path / "layer1.safetensors"))
    assert t["x"].shape == (1, 20, 64) and "attention_input" in meta
    with torch.no_grad():
        v = tiny.model.layers[1].self_attn.v_proj(torch.from_numpy(t["x"])).reshape(1, 20, 2, 16).transpose(1, 2)
    torch.testing.assert_close(v, torch.from_numpy(t["v"]), rtol=1e-5, atol=1e-6)
    assert causal_lm.main(["--text", str(text), "--output-dir", str(tmp_path), "--max-tokens", "20", "--layers", "0"]) == 0
    assert "x" not in read_safetensors(str(tmp_path / "layer0.safetensors"))[0]


def test_capture_with_adapters(tiny, tmp_path, monkeypatch, capsys):
    """--adapters captures the model with a weights file's adapters on every layer's q and k projections: layer 0
    (whose input no adapter changes) reads q = rope(W_q x + up (down x)), as the adapted model computes it, v
    stays; the metadata names the file's tensors_sha256; a file without adapters or for another model exits 2."""
    from kvmem import adapters as ka
    from kvmem import weights as kw
    from kvmem.train.capture import capture
    from kvmem.train.distill import KvmParameters, memory_weights

    monkeypatch.setattr(causal_lm, "load_model", lambda name: (tiny, WordTokenizer(), "tiny"))
    text = tmp_path / "t.txt"
    text.write_text("attention memory keys and values")
    g = torch.Generator().manual_seed(3)
    adapters = [ka.LayerAdapters.initial(64, 64, 32, 2, seed=i) for i in range(2)]
    for a in adapters:
        with torch.no_grad():
            a.q.up.copy_(torch.randn(64, 2, generator=g))
            a.k.up.copy_(torch.randn(32, 2, generator=g))
    layers = [KvmParameters(64, 4, 2, 16).tensors() | a.tensors() for a in adapters]
    kw.save(tmp_path / "a.safetensors", memory_weights("kvm", "tiny", tiny, layers))
    assert causal_lm.main(["--text", str(text), "--output-dir", str(tmp_path), "--max-tokens", "20", "--layers", "0",
                           "--adapters", str(tmp_path / "a.safetensors")]) == 0
    t, meta = read_safetensors(str(tmp_path / "layer0.safetensors"))
    assert meta["adapters_sha256"] == kw.load(tmp_path / "a.safetensors").metadata["tensors_sha256"]
    ids = torch.tensor([[ord(c) % 97 for c in "attention memory keys and values"[:20]]])
    hooks = ka.attach(tiny, lambda i: adapters[i])
    try:
        want = capture(tiny, ids)[0]
    finally:
        hooks.remove()
    torch.testing.assert_close(torch.tensor(t["q"]), want.q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(t["v"]), want.v, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(torch.tensor(t["q"]), capture(tiny, ids)[0].q, atol=1e-3)  # hooks removed
    kw.save(tmp_path / "plain.safetensors", memory_weights("kvm", "tiny", tiny, [KvmParameters(64, 4, 2, 16).tensors() for _ in range(2)]))
    kw.save(tmp_path / "other.safetensors", kw.MemoryWeights("kvm", "other", kw.load(tmp_path / "a.safetensors").shape,
                                                             dict(enumerate(layers))))
    capsys.readouterr()
    for name, message in [("plain", "has no adapters"), ("other", "trained for model 'other'")]:
        assert causal_lm.main(["--text", str(text), "--output-dir", str(tmp_path), "--adapters",
                               str(tmp_path / f"{name}.safetensors")]) == 2
        assert message in capsys.readouterr().err


def test_model_not_found(capsys, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("x")
    assert causal_lm.main(["--model", str(tmp_path / "nomodel"), "--text", str(text), "--output-dir", str(tmp_path)]) == 2
    assert "nomodel" in capsys.readouterr().err


def test_ln_affine_is_weighted_least_squares():
    rng = np.random.default_rng(1)
    k = rng.normal(size=(3, 50, 8)) * rng.uniform(0.5, 3, size=8) + rng.normal(size=8)
    weight = rng.uniform(0, 1, size=(3, 50))
    w, b = calibrate.ln_affine(k.astype(np.float32), weight)
    x = k.reshape(-1, 8)
    xhat = (x - x.mean(1, keepdims=True)) / np.sqrt(x.var(1, keepdims=True) + 1e-5)
    sw = np.sqrt(weight.reshape(-1))
    for c in range(8):
        A = np.stack([xhat[:, c], np.ones(len(x))], 1) * sw[:, None]
        (wc, bc), *_ = np.linalg.lstsq(A, x[:, c] * sw, rcond=None)
        assert w[c] == pytest.approx(wc, rel=1e-4, abs=1e-5) and b[c] == pytest.approx(bc, rel=1e-4, abs=1e-5)


def test_attention_received_matches_dense_softmax():
    torch.manual_seed(2)
    q, k = torch.randn(1, 4, 37, 8), torch.randn(1, 2, 37, 8)
    got = calibrate.attention_received(q, k, block=10)
    s = q[0] @ k[0].repeat_interleave(2, 0).transpose(1, 2) / math.sqrt(8)
    s = s.masked_fill(torch.triu(torch.ones(37, 37, dtype=torch.bool), 1), float("-inf"))
    ref = s.softmax(-1).sum(1).reshape(2, 2, 37).sum(1).double().numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    # Every query's float32 softmax weights sum to 1 within T u (T = 37 keys, u = 2^-24): 2.2e-6 relative;
    # the sum of 2 x 37 rows in float64 keeps that bound.
    np.testing.assert_allclose(got.sum(1), 2 * 37, rtol=37 * 2.0**-24)


def test_pick_takes_the_first_lowest():
    value, err = calibrate.pick({0.5: np.array([1.0, 2.0, 3.0]), 1.0: np.array([0.5, 2.0, 4.0]), 2.0: np.array([0.5, 1.0, 5.0])})
    assert list(value) == [1.0, 2.0, 0.5] and list(err) == [0.5, 1.0, 3.0]


def synthetic_layer(path, T, layer=0, seed=3):
    """A capture-shaped file: a sink key the queries favour, then random q, k, v (Hq 4, Hkv 2, D 16)."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(1, 4, T, 16)).astype(np.float32)
    k = (rng.normal(size=(1, 2, T, 16)) * 2 + 1).astype(np.float32)
    k[:, :, 0] = 0.3 * q[:, ::2, 1:].mean(2)
    v = rng.normal(size=(1, 2, T, 16)).astype(np.float32)
    write_safetensors(path, neutral_kvm_inputs(q, k, v, [T]), {"layer": str(layer)})


def test_calibration_fit_and_apply(tmp_path):
    d = tmp_path / "cal"
    d.mkdir()
    synthetic_layer(str(d / "layer0.safetensors"), 600)
    out = tmp_path / "cal.json"
    assert calibrate.main(["fit", "--layers-dir", str(d), "--output", str(out)]) == 0
    c = calibrate.load_calibration(str(out))[0]
    e = c["errors"]
    assert np.mean(e["kvm_after"]) <= np.mean(e["kvm_before"]) + 1e-12  # never worse on the calibration text
    assert len(c["tau_state"]) == 4 and all(t in calibrate.TAU_GRID for t in c["tau_state"])
    assert len(c["ln_weight"]) == 16 and c["ln_affine"] in ("fitted", "neutral")
    assert all(b > 0 for b in c["beta"])
    assert calibrate.main(["apply", "--calibration", str(out), "--input", str(d / "layer0.safetensors"),
                           "--kvm", str(tmp_path / "k.safetensors"), "--ovq", str(tmp_path / "o.safetensors")]) == 0
    kt_, _ = read_safetensors(str(tmp_path / "k.safetensors"))
    ot, _ = read_safetensors(str(tmp_path / "o.safetensors"))
    np.testing.assert_array_equal(kt_["tau_state"], np.float32(c["tau_state"]))
    np.testing.assert_array_equal(kt_["tau_bswa"], 1)
    np.testing.assert_array_equal(ot["tau_bswa"], np.float32(c["beta"]))


def test_calibration_errors(tmp_path, capsys):
    d = tmp_path / "short"
    d.mkdir()
    synthetic_layer(str(d / "layer0.safetensors"), 100)
    assert calibrate.main(["fit", "--layers-dir", str(d), "--output", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert "100 tokens" in err and f"at least {calibrate.MIN_TOKENS}" in err
    assert calibrate.main(["fit", "--layers-dir", str(tmp_path / "none"), "--output", str(tmp_path / "x.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert calibrate.main(["fit", "--layers-dir", str(d), "--output", "x", "--fraction", "0"]) == 2
    assert "--fraction" in capsys.readouterr().err


def test_sizing():
    for f in (1 / 4, 1 / 8, 1 / 16):
        for m in lm_memories.LABELS:
            assert abs(lm_memories.held_tokens(m, 4096, f) - f * 4096) <= 1
    with pytest.raises(ValueError, match="fraction = 0.001"):
        lm_memories.budget_split(1000, 0.001)
    with pytest.raises(ValueError, match="unknown"):
        lm_memories.factory("snapkv", 1000, 0.25)
    with pytest.raises(ValueError, match="has no layer 1"):
        lm_memories.factory("kvm-fixed", 1000, 0.25, {0: {}})(1, head_dim=16, query_heads=4, kv_heads=2, value_dim=16, batch=1)


def test_every_memory_of_the_study_is_built():
    """Each id of the study builds its memory; the merging evictions and proportional merge are what they say;
    KVPOP, which needs trained scorers, is refused without them."""
    shape = dict(head_dim=16, query_heads=4, kv_heads=2, value_dim=16, batch=1)
    assert set(lm_memories.STUDY) | set(lm_memories.WEIGHTS_ONLY) | set(lm_memories.COMPRESSING) == set(lm_memories.LABELS)
    for m in lm_memories.STUDY + lm_memories.COMPRESSING:
        mem = lm_memories.factory(m, 1000, 0.25)(0, **shape)
        assert mem.allocated_bytes() > 0, m
    with pytest.raises(ValueError, match="needs trained scorers"):
        lm_memories.factory("kvpop", 1000, 0.25)
    plain = lm_memories.factory("h2o", 1000, 0.25)(0, **shape)
    merged = lm_memories.factory("h2o-merge", 1000, 0.25)(0, **shape)
    assert merged.held_bytes() == plain.held_bytes() + 2 * (250 + 1) * 4  # one float32 count per row
    assert type(lm_memories.factory("proportional", 1000, 0.25)(0, **shape)).__name__ == "ProportionalMemory"


@pytest.mark.parametrize("memory", ["h2o", "tova"])
def test_end_to_end_with_every_token_held_is_the_full_model(tiny, memory):
    """An eviction memory whose budget is the whole sequence holds every token: the logits through
    kvmem.transformers equal the model's own (the wiring of end_to_end.kvmem_run)."""
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]])
    logits, sizes = end_to_end.kvmem_run(tiny, ids, memory, 1.0, None)
    tiny.set_attn_implementation("sdpa")
    torch.testing.assert_close(logits, end_to_end.forward(tiny, ids), rtol=1e-4, atol=1e-5)
    assert sizes["held_tokens"] == 20


def test_scores():
    torch.manual_seed(4)
    logits, ids = torch.randn(6, 11), torch.tensor([[1, 2, 3, 4, 5, 6]])
    s = end_to_end.score_text(logits, ids, logits[:-1].argmax(-1))
    ref = -logits[:-1].double().log_softmax(-1)[torch.arange(5), ids[0, 1:]].mean().item()
    assert s["perplexity"] == pytest.approx(math.exp(ref)) and s["agreement"] == 1.0
    case = {"haystack": 1, "fact": "car", "depth": 0.5, "answer": "maroon", "positions": [3, 4],
            "answer_ids": [int(logits[3].argmax()), 0 if logits[4].argmax() else 1]}
    n = end_to_end.score_needle(logits, case)
    ref = logits.double().log_softmax(-1)[[3, 4], case["answer_ids"]].sum().item()
    assert n["retrieved"] is False and n["logprob"] == pytest.approx(ref)
    assert (n["haystack"], n["fact"], n["depth"], n["answer"]) == (1, "car", 0.5, "maroon")
    case["answer_ids"][1] = int(logits[4].argmax())
    assert end_to_end.score_needle(logits, case)["retrieved"] is True


class CharTokenizer:
    """An invertible tokenizer for the needle cases: one id per printable ASCII character or newline (97
    ids, the tiny model's vocabulary), a chat template of plain markers."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [95 if c == "\n" else ord(c) - 32 if " " <= c <= "~" else 96 for c in text]}

    def decode(self, ids):
        return "".join("\n" if i == 95 else chr(i + 32) if i < 95 else "?" for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        return "".join(f"<{m['role']}>\n{m['content']}\n" for m in messages) + "<assistant>\n"


HAYSTACK = ("Everyone may copy and distribute verbatim copies of this licence document, but changing it is not "
            "allowed.\nThe licences for most software are designed to take away your freedom to share it. ")


def test_needle_cases():
    tok = CharTokenizer()
    hay = [tok(HAYSTACK[:120])["input_ids"], tok(HAYSTACK[60:180])["input_ids"]]
    facts = end_to_end.pick_facts(2)
    cases = end_to_end.needle_cases(tok, hay, facts, [0.0, 0.5, 1.0])
    assert len(cases) == 2 * 2 * 3
    assert [(c["haystack"], c["fact"], c["depth"]) for c in cases[:4]] == [
        (0, "city", 0.0), (0, "city", 0.5), (0, "city", 1.0), (0, "locker", 0.0)]
    for fact in facts:  # every case of a fact has its own answer
        assert len({c["answer"] for c in cases if c["fact"] == fact.id}) == 6
    for c in cases:
        fact = next(f for f in facts if f.id == c["fact"])
        ids = c["ids"][0].tolist()
        assert tok.decode(ids[p + 1] for p in c["positions"]) == " " + c["answer"]
        assert [ids[p + 1] for p in c["positions"]] == c["answer_ids"]
        text = tok.decode(ids)
        assert text.endswith(fact.question + "\n<assistant>\n" + fact.prefix + " " + c["answer"])
        sentence = fact.sentence.format(c["answer"])
        at = text.index(sentence)  # inserted whole, at a word boundary
        assert text[at - 1] in " \n" and text[at + len(sentence)] in " \n"
        context = text[len("<user>\n"):text.index("\n\n" + fact.question)]
        assert context.replace(sentence, "").split() == tok.decode(hay[c["haystack"]]).split()  # no word cut
    assert tok.decode(cases[0]["ids"][0].tolist()).startswith("<user>\n" + facts[0].sentence.format(cases[0]["answer"]))
    assert facts[0].sentence.format(cases[2]["answer"]) + "\n\n" in tok.decode(cases[2]["ids"][0].tolist())  # depth 1


def test_needle_errors():
    with pytest.raises(ValueError, match=r"--facts 0: must be in \[1, 6\]"):
        end_to_end.pick_facts(0)
    with pytest.raises(ValueError, match="--depths '0.5,x'"):
        end_to_end.parse_depths("0.5,x")
    with pytest.raises(ValueError, match=r"--depths '1.5': each depth must be in \[0, 1\]"):
        end_to_end.parse_depths("1.5")

    class Merging(CharTokenizer):
        """Merges "f " into one token, as a BPE tokenizer could merge a prefix's end with the answer."""

        def __call__(self, text, add_special_tokens=False):
            return super().__call__(text.replace("f ", "\x01"))  # "\x01": id 96

    city = end_to_end.FACTS[0]
    assert city.prefix == "Maria Keller lives in the city of"
    with pytest.raises(ValueError, match="fact 'city': the tokenizer merges the answer 'Lisbon' into its prefix"):
        end_to_end.needle_cases(Merging(), [CharTokenizer()(HAYSTACK[:80])["input_ids"]], [city], [0.5])


@pytest.fixture
def e2e_cli(tiny, tmp_path, monkeypatch):
    """end_to_end.main on the tiny Llama and CharTokenizer, with short texts; returns (run, calls): run(*args)
    runs main with the texts' flags, calls lists the (memory, tokens) of every kvmem_run."""
    import types

    monkeypatch.setitem(sys.modules, "smollm2", types.SimpleNamespace(load=lambda: (tiny, CharTokenizer())))
    monkeypatch.setattr(causal_lm, "load_model", lambda name: (tiny, CharTokenizer(), "tiny"))
    calls = []
    real = end_to_end.kvmem_run
    monkeypatch.setattr(end_to_end, "kvmem_run", lambda model, ids, memory, f, cal, weights=None:
                        calls.append((memory, ids.shape[1])) or real(model, ids, memory, f, cal, weights))
    (tmp_path / "ppl.txt").write_text(HAYSTACK)
    (tmp_path / "h1.txt").write_text(HAYSTACK)
    (tmp_path / "h2.txt").write_text(HAYSTACK[::-1])

    def run(*args):
        return end_to_end.main(["--ppl-text", str(tmp_path / "ppl.txt"), "--haystack", str(tmp_path / "h1.txt"),
                                "--haystack2", str(tmp_path / "h2.txt"), "--ppl-tokens", "64", "--needle-tokens", "100",
                                "--fractions", "1/2", "--facts", "2", "--depths", "0.5", *args])
    return run, calls


def test_end_to_end_cli_and_reuse(e2e_cli, tmp_path, capsys):
    import json

    run, calls = e2e_cli
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    assert run("--output", str(first), "--memories", "h2o") == 0
    old = json.loads(first.read_text())
    assert len(calls) == 1 + 4 and old["needle_cases"] == 4 and len(old["full"]["needle"]) == 4
    assert {(n["haystack"], n["fact"]) for n in old["results"][0]["needle"]} == {(0, "city"), (0, "locker"),
                                                                                 (1, "city"), (1, "locker")}
    assert "needle found in" in capsys.readouterr().out
    calls.clear()
    assert run("--output", str(second), "--memories", "streaming,h2o", "--reuse", str(first)) == 0
    new = json.loads(second.read_text())
    assert [m for m, _ in calls] == ["streaming"] * 5  # h2o is kept, not recomputed
    assert [r["memory"] for r in new["results"]] == ["streaming", "h2o"] and new["results"][1] == old["results"][0]
    assert new["reused_rows"] == 1 and "(1 reused)" in capsys.readouterr().out
    cases = [(["--depths", "0.3"], "different --depths"), (["--needle-tokens", "90"], "different --needle-tokens"),
             (["--facts", "1"], "different --facts"), (["--ppl-tokens", "60"], "different --ppl-tokens")]
    for args, message in cases:
        assert run("--output", str(second), "--memories", "h2o", "--reuse", str(first), *args) == 2
        assert message in capsys.readouterr().err
    del old["settings"]
    first.write_text(json.dumps(old))
    assert run("--output", str(second), "--reuse", str(first)) == 2
    assert "has no settings" in capsys.readouterr().err
    assert run("--output", str(second), "--reuse", str(tmp_path / "none.json")) == 2
    assert "--reuse" in capsys.readouterr().err


def test_end_to_end_cli_errors(e2e_cli, tmp_path, capsys):
    run, calls = e2e_cli
    out = str(tmp_path / "x.json")
    for args, message in [(["--facts", "9"], "--facts 9"), (["--depths", "2"], "--depths '2'"),
                          (["--needle-tokens", "1000"], "--haystack "), (["--needle-tokens", "0"], "--needle-tokens 0"),
                          (["--memories", "snapkv"], "'snapkv' unknown")]:
        assert run("--output", out, *args) == 2
        assert message in capsys.readouterr().err
    assert calls == [] and not os.path.exists(out)


def check_held_out(tiny, tmp_path, plain_path, adapted_path, capsys):
    """held_out.py on two weights files of KVM fixed at 1/2 (without and with adapters): the rows it names, and
    each distilled row's per-layer error (kvmem's C++ memories) equal to that of the training form on the same
    capture (the adapted one through kvmem.train.model.memory_in_layer)."""
    import json

    import held_out
    from kvmem import adapters as ka
    from kvmem import weights as kw
    from kvmem.train.capture import capture, exact_attention
    from kvmem.train.distill import parameters_of
    from kvmem.train.model import memory_in_layer

    out = tmp_path / "held-out.json"
    assert held_out.main(["--text", str(tmp_path / "ppl.txt"), "--tokens", "64", "--weights", str(plain_path),
                          "--weights", str(adapted_path), "--output", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["label"], bool(r["distilled"])) for r in rows] == [
        ("KVM fixed", False), ("H2O", False), ("TOVA", False), ("KVM fixed", True), ("KVM fixed + adapters (rank 2)", True)]
    setup = lm_memories.setup("kvm-fixed", 64, 0.5)
    ids, _ = causal_lm.read_text(str(tmp_path / "ppl.txt"), CharTokenizer(), 64)
    plain, adapted = kw.load(plain_path), kw.load(adapted_path)
    for layer, inputs in enumerate(capture(tiny, torch.tensor([ids]))):
        target = exact_attention(inputs.q, inputs.k, inputs.v)
        rel = lambda y: ((y - target).square().sum() / target.square().sum()).sqrt().item()  # noqa: E731
        assert rows[3]["errors"][layer] == pytest.approx(rel(parameters_of("kvm", plain.layer(layer))(inputs, setup)),
                                                         rel=1e-4)
        with memory_in_layer(tiny, layer, parameters_of("kvm", adapted.layer(layer)), setup,
                             ka.of_tensors(adapted.layer(layer))) as run:
            assert rows[4]["errors"][layer] == pytest.approx(rel(run(inputs)), rel=1e-4)
        assert rows[4]["errors"][layer] != pytest.approx(rows[3]["errors"][layer], rel=1e-3)
    import report_lm
    table = report_lm.held_out_table([json.loads(out.read_text())]).splitlines()
    assert table[0] == "| memory | budget | parameters | layer 0 | **mean of 2** |"
    assert rows[3]["stages"] == "1 + 2" and rows[4]["stages"] == "1 + 2" and rows[0]["stages"] is None
    assert table[6].startswith(f"| KVM fixed + adapters (rank 2) | 1/2 | distilled, stage 1 + 2 ({rows[4]['distilled'][:8]}) | "
                               f"{rows[4]['errors'][0]:.3f} |")
    later = json.loads(out.read_text())  # a second run's report: its rows join the first's, a repeated row replaces it
    later["rows"] = [dict(rows[4], distilled="f" * 16), dict(rows[1], errors=[9.0, 9.0], mean=9.0)]
    merged = report_lm.held_out_table([json.loads(out.read_text()), later]).splitlines()
    assert len(merged) == 2 + 6 and sum("| H2O |" in line for line in merged) == 1 and "**9.000**" in merged[3]
    with pytest.raises(ValueError, match="different tokens"):
        report_lm.held_out_table([json.loads(out.read_text()), dict(later, tokens=1)])
    capsys.readouterr()
    assert held_out.main(["--text", str(tmp_path / "ppl.txt"), "--output", str(out), "--compare", "snapkv"]) == 2
    assert "--compare: 'snapkv' unknown" in capsys.readouterr().err


def test_distill_then_end_to_end_with_the_weights(tiny, e2e_cli, tmp_path, capsys):
    """tools/distill/distill.py on the tiny Llama writes weights that end_to_end.py --weights runs as a distilled
    row of the memory and fraction the file names; bad arguments exit 2 with the problem named."""
    import json

    import distill
    from kvmem import weights as kw

    run, calls = e2e_cli
    texts = []
    for i, text in enumerate((HAYSTACK * 3, HAYSTACK[::-1] * 3)):
        texts += ["--text", str(tmp_path / f"train{i}.txt")]
        (tmp_path / f"train{i}.txt").write_text(text)
    w, report = tmp_path / "kvm.safetensors", tmp_path / "curves.json"
    assert distill.main(["--memory", "kvm-fixed", "--fraction", "1/2", "--tokens", "64", "--steps", "3", "--e2e-steps", "2",
                         "--output", str(w), "--report", str(report), *texts]) == 0
    weights = kw.load(w, memory="kvm", model="tiny")
    assert weights.metadata["memory_id"] == "kvm-fixed" and weights.metadata["fraction"] == "1/2"
    assert len(json.loads(weights.metadata["training_texts"])) == 2
    curves, e2e = json.loads(report.read_text())["curves"], json.loads(report.read_text())["e2e_curve"]
    assert len(e2e) == 3 and all(map(math.isfinite, e2e))
    assert len(curves) == 2 and all(len(c) == 4 and all(map(math.isfinite, c)) for c in curves)
    out = tmp_path / "e2e.json"
    assert run("--output", str(out), "--memories", "h2o", "--weights", str(w)) == 0
    rows = json.loads(out.read_text())["results"]
    assert [(r["memory"], bool(r["distilled"])) for r in rows] == [("h2o", False), ("kvm-fixed", True)]
    assert calls.count(("kvm-fixed", 64)) == 1
    import report_lm
    table = report_lm.distilled_table(json.loads(out.read_text()), [json.loads(report.read_text())]).splitlines()
    ppl = json.loads(out.read_text())["results"][1]["perplexity"]
    assert len(table) == 3 and table[2].startswith(f"| KVM fixed | 1/2 | — | — | **{ppl:.2f}** | ")
    assert f"{math.sqrt(curves[0][0]) / 2 + math.sqrt(curves[1][0]) / 2:.3f} -> " in table[2]
    w2, report2 = tmp_path / "kvm-e2e.safetensors", tmp_path / "curves-e2e.json"
    assert distill.main(["--memory", "kvm-fixed", "--fraction", "1/2", "--tokens", "64", "--e2e-steps", "1",
                         "--init", str(w), "--output", str(w2), "--report", str(report2), *texts]) == 0
    again = kw.load(w2, memory="kvm", model="tiny")
    assert json.loads(again.metadata["init"])["sha256"] and json.loads(report2.read_text())["curves"] == []
    import plot_curves
    assert plot_curves.main(["--output", str(tmp_path / "curves.png"), str(report), str(report2)]) == 0
    assert (tmp_path / "curves.png").stat().st_size > 1000
    second = json.loads(report2.read_text())
    assert "its --init weights'" in report_lm.distilled_table(json.loads(out.read_text()) | {"results": [
        dict(rows[1], distilled=second["weights_sha256"][:16])]}, [second])
    w3, report3 = tmp_path / "kvm-adapters.safetensors", tmp_path / "curves-adapters.json"
    assert distill.main(["--memory", "kvm-fixed", "--fraction", "1/2", "--tokens", "64", "--steps", "2", "--e2e-steps",
                         "1", "--adapter-rank", "2", "--output", str(w3), "--report", str(report3), *texts]) == 0
    adapted = kw.load(w3, memory="kvm", model="tiny")
    assert adapted.shape["adapter_rank"] == 2 and adapted.layers[1]["k_adapter_up"].abs().max() > 0
    assert json.loads(adapted.metadata["recipe"])["adapter_rank"] == 2
    assert run("--output", str(out), "--memories", "h2o", "--weights", str(w), "--weights", str(w3)) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["label"] for r in rows] == ["H2O", "KVM fixed", "KVM fixed + adapters (rank 2)"]
    assert rows[1]["perplexity"] != rows[2]["perplexity"]
    table = report_lm.distilled_table(json.loads(out.read_text()), [json.loads(report3.read_text())]).splitlines()
    assert table[2].startswith("| KVM fixed + adapters (rank 2) | 1/2 | ")
    check_held_out(tiny, tmp_path, w, w3, capsys)
    capsys.readouterr()
    for args, message in [(["--memory", "h2o"], "--memory 'h2o': not trainable"),
                          (["--memory", "kvpop", "--adapter-rank", "2"], "0 for --memory kvpop"),
                          (["--memory", "kvm-fixed", "--adapter-rank", "3", "--init", str(w3)],
                           "has adapters of rank 2"),
                          (["--memory", "ovq", "--init", str(w)], "holds 'kvm' weights, expected 'ovq'"),
                          (["--memory", "ovq", "--fraction", "1/512"], "fraction = 0.001953125"),
                          (["--memory", "ovq", "--text", str(tmp_path / "none.txt")], "none.txt"),
                          (["--memory", "ovq", "--fraction", "1/2", "--text", str(tmp_path / "short.txt")],
                           "has 3 tokens, fewer than the memory's chunk of 8")]:
        (tmp_path / "short.txt").write_text("abc")
        assert distill.main(["--output", str(tmp_path / "bad.safetensors"), "--tokens", "64", *args]) == 2
        assert message in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "bad.safetensors")
    kw.save(tmp_path / "other.safetensors", kw.MemoryWeights("kvm", "another-model", weights.shape, weights.layers,
                                                             weights.metadata))
    assert run("--output", str(out), "--weights", str(tmp_path / "other.safetensors")) == 2
    assert "trained for model 'another-model', expected 'tiny'" in capsys.readouterr().err


def test_report_counts_needle_cases():
    """report_lm.py's table and headline give the cases found of all and the mean log-probability; a report
    whose needle entries have only depth, retrieved and logprob (before facts and haystacks) still reads."""
    import report_lm

    def needles(found, logprobs):
        return [{"depth": 0.5, "retrieved": f, "logprob": lp} for f, lp in zip(found, logprobs)]

    e2e = {"ppl_tokens": 64,
           "full": {"needle": needles([True, True, False], [-1.0, -2.0, -6.0]), "kv_bytes": 1048576,
                    "perplexity": 10.0},
           "results": [{"needle": needles([False, True, False], [-4.0, -1.0, -7.0]), "memory": "h2o", "label": "H2O",
                        "fraction_label": "1/4", "fraction": 0.25, "calibrated": False, "held_tokens": 16,
                        "held_bytes": 524288, "perplexity": 12.0, "agreement": 0.9}]}
    table = report_lm.e2e_table(e2e)
    assert "| needle found (of 3) | needle mean log-prob |" in table
    assert table.endswith("| 0.900 | 1 | -4.0 |") and "| 1.000 | 2 | -3.0 |" in table
    head = report_lm.headline(e2e, [], [])
    assert "needle found in 2 of 3 cases (mean log-probability of the answer -3.0)" in head
    assert "needle 1 of 3, log-prob -4.0" in head


def test_continuation_through_a_memory_that_holds_everything_is_the_full_model(tiny):
    """continuation.py's protocol (the prompt in one forward, then one forward per token) through an
    eviction memory at the end of the prompt whose budget holds every token gives the model's own logits."""
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(5))
    tiny.set_attn_implementation("sdpa")
    with torch.no_grad():
        full = tiny(ids).logits[0, 29:]
    for memory in ("h2o-end", "snapkv-end", "h2o-chunk"):
        cache = kvmem_transformers().KvmemCache(tiny, lm_memories.factory(memory, 40, 1.0))
        got = continuation.continuation_logits(tiny, ids, 30, cache)
        torch.testing.assert_close(got, full, rtol=1e-4, atol=1e-5)


def test_continuation_after_a_compressed_prompt(tiny):
    """At a small fraction the prompt's last position is still exact at the end of the prompt (the prefill
    attends every token) and the continuation is not: the memory compressed at the first decode step."""
    ids = torch.randint(0, 97, (1, 60), generator=torch.Generator().manual_seed(6))
    tiny.set_attn_implementation("sdpa")
    with torch.no_grad():
        full = tiny(ids).logits[0, 39:]
    cache = kvmem_transformers().KvmemCache(tiny, lm_memories.factory("snapkv-end", 40, 0.25))
    got = continuation.continuation_logits(tiny, ids, 40, cache)
    torch.testing.assert_close(got[0], full[0], rtol=1e-4, atol=1e-5)
    assert (got[1:] - full[1:]).abs().max() > 1e-3
    assert cache.held_bytes() > 0
    s = continuation.score(got[:-1], ids[0, 40:], full[:-1].argmax(-1))
    assert s["perplexity"] > 1 and 0 <= s["agreement"] <= 1
    report = {"full": {"perplexity": 9.0}, "results": [{"memory": "snapkv-end", "label": "SnapKV at prompt end",
                                                        "fraction_label": "1/4", "perplexity": 10.5, "agreement": 0.5}]}
    table = continuation.markdown(report)
    assert "| SnapKV at prompt end | prompt end (chunk 0) | 10.50 (50 %) |" in table


def test_continuation_errors(tmp_path, capsys):
    assert continuation.main(["--output", str(tmp_path / "c.json"), "--text", "x", "--memories", "nope"]) == 2
    assert "--memories: 'nope' unknown" in capsys.readouterr().err
    assert continuation.main(["--output", str(tmp_path / "c.json"), "--text", "x", "--prompt-tokens", "1"]) == 2
    assert "need at least 2" in capsys.readouterr().err


def kvmem_transformers():
    import kvmem.transformers as kt
    return kt
