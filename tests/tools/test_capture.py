#!/usr/bin/env python3
"""Tests of tools/capture: a tiny BERT with random weights, saved in the Hugging Face layout,
is captured, and the captured q/k/v must reproduce that model's own attention output.

Runs with python3 + numpy only, offline:  python3 tests/tools/test_capture.py
Prints one line per failure and a final line "N passed, M failed"; exits 1 on failure.
"""
import contextlib
import io
import json
import math
import os
import sys
import tempfile
import traceback

import numpy as np

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools", "capture"))
import capture  # noqa: E402
from wordpiece import BertTokenizer  # noqa: E402

WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "and", "memory", "keys", "values", "attention"]
TEXT = "The cat sat on the mat, and the dog ran! Attention keys & values: memory."


def tiny_vocab():
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS + ["##s", "##ing"]
    vocab += list(".,!:&-")
    vocab += [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["##" + chr(c) for c in range(ord("a"), ord("z") + 1)]
    return vocab


TINY = dict(hidden_size=16, num_attention_heads=4, num_hidden_layers=3, intermediate_size=32,
            max_position_embeddings=24, type_vocab_size=2, hidden_act="gelu", layer_norm_eps=1e-12)


def make_model_dir(path, seed=0, prefix="", config_overrides=None, drop=()):
    """Writes a random tiny BERT in the Hugging Face layout to `path`; returns (config, weights)."""
    rng = np.random.default_rng(seed)
    os.makedirs(path, exist_ok=True)
    vocab = tiny_vocab()
    cfg = dict(TINY, model_type="bert", architectures=["BertModel"], vocab_size=len(vocab),
               position_embedding_type="absolute", pad_token_id=0)
    cfg.update(config_overrides or {})
    H, I, P = cfg["hidden_size"], cfg["intermediate_size"], cfg["max_position_embeddings"]

    def mat(*shape, scale=0.4):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    w = {
        "embeddings.word_embeddings.weight": mat(len(vocab), H, scale=1.0),
        "embeddings.position_embeddings.weight": mat(P, H, scale=0.5),
        "embeddings.token_type_embeddings.weight": mat(2, H, scale=0.5),
        "embeddings.LayerNorm.weight": 1 + mat(H, scale=0.1), "embeddings.LayerNorm.bias": mat(H, scale=0.1),
        "embeddings.position_ids": np.arange(P, dtype=np.int64)[None],
        "pooler.dense.weight": mat(H, H), "pooler.dense.bias": mat(H),
    }
    for i in range(TINY["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        for n in ("query", "key", "value"):
            w[p + f"attention.self.{n}.weight"], w[p + f"attention.self.{n}.bias"] = mat(H, H), mat(H, scale=0.2)
        w[p + "attention.output.dense.weight"], w[p + "attention.output.dense.bias"] = mat(H, H), mat(H, scale=0.1)
        w[p + "attention.output.LayerNorm.weight"] = 1 + mat(H, scale=0.1)
        w[p + "attention.output.LayerNorm.bias"] = mat(H, scale=0.1)
        w[p + "intermediate.dense.weight"], w[p + "intermediate.dense.bias"] = mat(I, H), mat(I, scale=0.1)
        w[p + "output.dense.weight"], w[p + "output.dense.bias"] = mat(H, I), mat(H, scale=0.1)
        w[p + "output.LayerNorm.weight"] = 1 + mat(H, scale=0.1)
        w[p + "output.LayerNorm.bias"] = mat(H, scale=0.1)
    w = {prefix + k: v for k, v in w.items() if k not in drop}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with open(os.path.join(path, "vocab.txt"), "w") as f:
        f.write("\n".join(vocab) + "\n")
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"do_lower_case": True, "tokenizer_class": "BertTokenizer"}, f)
    capture.write_safetensors(os.path.join(path, "model.safetensors"), w, {"format": "pt"})
    return cfg, w


def reference_layer(cfg, w, ids, layer):
    """Independent float64 reference (plain loops): q, k, v, ctx [heads, T, d] of `layer`."""
    W = {k: np.asarray(v, np.float64) for k, v in w.items()}
    H, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    d, eps, T = H // nh, cfg["layer_norm_eps"], len(ids)

    def ln(x, g, b):
        return np.array([(r - r.mean()) / math.sqrt(((r - r.mean()) ** 2).mean() + eps) * g + b for r in x])

    def lin(x, name):
        return np.array([W[name + ".weight"] @ r + W[name + ".bias"] for r in x])

    x = np.array([W["embeddings.word_embeddings.weight"][t] + W["embeddings.position_embeddings.weight"][i]
                  + W["embeddings.token_type_embeddings.weight"][0] for i, t in enumerate(ids)])
    x = ln(x, W["embeddings.LayerNorm.weight"], W["embeddings.LayerNorm.bias"])
    for li in range(layer + 1):
        p = f"encoder.layer.{li}."
        q, k, v = (lin(x, p + f"attention.self.{n}") for n in ("query", "key", "value"))
        heads = lambda a: np.stack([a[:, h * d:(h + 1) * d] for h in range(nh)])  # noqa: E731
        q, k, v = heads(q), heads(k), heads(v)
        ctx = np.zeros((nh, T, d))
        for h in range(nh):
            for t in range(T):
                s = np.array([q[h, t] @ k[h, u] for u in range(T)]) / math.sqrt(d)
                pr = np.exp(s - s.max())
                ctx[h, t] = (pr / pr.sum()) @ v[h]
        if li == layer:
            return q, k, v, ctx
        merged = np.concatenate([ctx[h] for h in range(nh)], axis=1)
        x = ln(x + lin(merged, p + "attention.output.dense"),
               W[p + "attention.output.LayerNorm.weight"], W[p + "attention.output.LayerNorm.bias"])
        hmid = lin(x, p + "intermediate.dense")
        hmid = np.vectorize(lambda z: 0.5 * z * (1 + math.erf(z / math.sqrt(2))))(hmid)
        x = ln(x + lin(hmid, p + "output.dense"),
               W[p + "output.LayerNorm.weight"], W[p + "output.LayerNorm.bias"])


def attend(q, k, v):
    """Non-causal softmax(q k^T / sqrt d) v per head, float64, from captured float32 rows."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    s = q @ k.transpose(0, 2, 1) / math.sqrt(q.shape[-1])
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True)) @ v


def run_cli(args):
    """capture.main(args) -> (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = capture.main(args)
        except SystemExit as e:  # argparse
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


def write(path, text):
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


# ------------------------------------------------------------------ tests

def test_tokenizer(tmp):
    mdir = os.path.join(tmp, "m")
    make_model_dir(mdir)
    tok = BertTokenizer.from_dir(mdir)
    assert tok.do_lower_case and tok.lowercase_source == "tokenizer_config.json"
    got = tok.tokenize("The Cats sat, CAFÉ-dog!! [SEP] ☃ " + "x" * 101)
    want = ["the", "cat", "##s", "sat", ",", "c", "##a", "##f", "##e", "-", "dog", "!", "!", "[SEP]",
            "[UNK]", "[UNK]"]
    assert got == want, got
    assert tok.tokenize("  \t\n ") == []
    assert tok.encode("the") == [tok.vocab["the"]]


def test_attention_reproduced(tmp):
    """Captured q/k/v give back the model's own attention context (and an independent reference)."""
    mdir = os.path.join(tmp, "m")
    cfg, w = make_model_dir(mdir, seed=1)
    _, model, tok = capture.load_model(mdir)
    ids = tok.encode(TEXT)
    assert 4 < len(ids) <= 22, len(ids)
    for layer in range(cfg["num_hidden_layers"]):
        heads = [0, 2] if layer != 1 else [3, 1, 0]
        cap = capture.capture_layer(model, tok, ids, layer, heads, window=24, with_context=True)
        H, T, D = cap["q"].shape
        assert (H, T, D) == (len(heads), len(ids) + 2, 4) and cap["q"].dtype == np.float32
        mine = attend(cap["q"], cap["k"], cap["v"])
        err = np.abs(mine - cap["ctx"]).max()
        assert err < 1e-5, f"layer {layer}: captured q/k/v reproduce the model's context only to {err:.2e}"
        rq, rk, rv, rctx = reference_layer(cfg, w, [tok.cls_id] + ids + [tok.sep_id], layer)
        for name, got, ref in (("q", cap["q"], rq), ("k", cap["k"], rk), ("v", cap["v"], rv),
                               ("ctx", mine, rctx)):
            e = np.abs(got - ref[heads]).max() / max(1.0, np.abs(ref).max())
            assert e < 2e-5, f"layer {layer} {name}: differs from the float64 reference by {e:.2e}"
        # the attention is not trivially uniform, so the check has teeth
        s = np.asarray(cap["q"][0], np.float64) @ np.asarray(cap["k"][0], np.float64).T / math.sqrt(D)
        assert s.std() > 0.1


def test_cli_output_file(tmp):
    mdir = os.path.join(tmp, "m")
    make_model_dir(mdir, seed=2)
    text = write(os.path.join(tmp, "t.txt"), TEXT)
    out = os.path.join(tmp, "out.safetensors")
    rc, so, se = run_cli(["--model", mdir, "--text", text, "--output", out, "--layer", "2", "--heads", "1,3",
                          "--model-name", "tiny-test-bert"])  # --window defaults to max_position_embeddings
    assert rc == 0, se
    assert "T = " in so
    t, meta = capture.read_safetensors(out)
    _, model, tok = capture.load_model(mdir)
    ids = tok.encode(TEXT)
    T = len(ids) + 2
    shapes = {"q": (1, 2, T, 4), "k": (1, 2, T, 4), "v": (1, 2, T, 4), "gate": (1, 2, T),
              "ln_weight": (4,), "ln_bias": (4,), "tau_state": (2,), "tau_bswa": (2,)}
    assert sorted(t) == sorted(shapes), sorted(t)
    for n, s in shapes.items():
        assert t[n].shape == s and t[n].dtype == np.float32, (n, t[n].shape, t[n].dtype)
    assert not t["gate"].any() and not t["ln_bias"].any()
    assert (t["ln_weight"] == 1).all() and (t["tau_state"] == 1).all() and (t["tau_bswa"] == 1).all()
    cap = capture.capture_layer(model, tok, ids, 2, [1, 3], 24, with_context=True)
    assert np.array_equal(t["q"][0], cap["q"]) and np.array_equal(t["v"][0], cap["v"])
    assert np.abs(attend(t["q"][0], t["k"][0], t["v"][0]) - cap["ctx"]).max() < 1e-5
    assert all(isinstance(v, str) for v in meta.values())
    assert meta["source_model"] == "tiny-test-bert" and meta["source_model_dir"] == mdir
    assert meta["layer"] == "2" and meta["heads"] == "1,3" and meta["tokens"] == str(T)
    assert meta["window"] == "24" and meta["windows"] == "1"
    assert json.loads(meta["texts"])[0]["path"] == text
    assert "not trained with a memory" in meta["neutral_parameters"]


def test_windowing(tmp):
    mdir = os.path.join(tmp, "m")
    make_model_dir(mdir, seed=3)
    _, model, tok = capture.load_model(mdir)
    ids = tok.encode(" ".join([TEXT] * 3))  # ~75 tokens, several windows of 10 rows
    n, W = len(ids), 10
    cap = capture.capture_layer(model, tok, ids, 1, [0, 1, 2, 3], W, with_context=True)
    spans = cap["spans"]
    assert spans[0][0] == 0 and spans[-1][1] == n and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert all(e - s == W - 2 for s, e in spans[:-1]) and 1 <= spans[-1][1] - spans[-1][0] <= W - 2
    assert len(spans) == math.ceil(n / (W - 2))
    assert cap["q"].shape[1] == sum(cap["window_rows"]) == n + 2 * len(spans)
    row = 0
    for (s, e), rows in zip(spans, cap["window_rows"]):
        _, direct = model.forward([tok.cls_id] + ids[s:e] + [tok.sep_id], capture={1}, stop_after=1)
        blk = slice(row, row + rows)
        for name in ("q", "k", "v"):
            assert np.abs(cap[name][:, blk] - direct[1][name]).max() < 1e-6, (name, s)
        got = attend(cap["q"][:, blk], cap["k"][:, blk], cap["v"][:, blk])
        assert np.abs(got - cap["ctx"][:, blk]).max() < 1e-5
        row += rows
    # every window restarts at position 0 with [CLS]: in layer 0 (no context yet) those rows are equal
    c0 = capture.capture_layer(model, tok, ids, 0, [0, 1, 2, 3], W)
    starts = np.cumsum([0] + c0["window_rows"][:-1])
    for (s, _), r in zip(c0["spans"], starts):
        assert np.abs(c0["k"][:, r] - c0["k"][:, 0]).max() < 1e-5, r
        if ids[s] != ids[0]:  # a different first text token gives a different row
            assert np.abs(c0["k"][:, r + 1] - c0["k"][:, 1]).max() > 1e-3, r
    # --max-tokens caps the rows exactly, and a remainder under 3 rows is dropped
    for mt, want in ((2 * W + 5, 2 * W + 5), (2 * W, 2 * W), (2 * W + 2, 2 * W), (W - 1, W - 1)):
        c = capture.capture_layer(model, tok, ids, 0, [0], W, max_tokens=mt)
        assert c["q"].shape[1] == want, (mt, c["q"].shape)
    # the CLI records the windowing in the metadata
    text = write(os.path.join(tmp, "long.txt"), " ".join([TEXT] * 3))
    out = os.path.join(tmp, "w.safetensors")
    rc, _, se = run_cli(["--model", mdir, "--text", text, "--text", text, "--output", out,
                         "--layer", "1", "--window", str(W), "--max-tokens", "45"])
    assert rc == 0, se
    t, meta = capture.read_safetensors(out)
    assert t["q"].shape == (1, 4, 45, 4)
    assert meta["windows"] == "5" and json.loads(meta["window_rows"]) == [10, 10, 10, 10, 5]
    assert meta["text_tokens"] == str(45 - 10) and meta["text_tokens_available"] == str(2 * n)
    assert "windows of at most 10 rows" in meta["windowing"]


def test_weight_prefix(tmp):
    """A BertFor... checkpoint (tensor names prefixed 'bert.') captures the same q/k/v."""
    a, b = os.path.join(tmp, "plain"), os.path.join(tmp, "prefixed")
    make_model_dir(a, seed=4)
    make_model_dir(b, seed=4, prefix="bert.")
    caps = []
    for d in (a, b):
        _, model, tok = capture.load_model(d)
        caps.append(capture.capture_layer(model, tok, tok.encode(TEXT), 2, [0], 24))
    ca, cb = caps
    assert np.array_equal(ca["q"], cb["q"]) and np.array_equal(ca["v"], cb["v"])


def expect_error(args, *fragments):
    rc, _, err = run_cli(args)
    assert rc == 2, f"exit code {rc}, stderr {err!r}"
    for frag in fragments:
        assert frag in err, f"{frag!r} not in {err!r}"


def test_errors(tmp):
    good = os.path.join(tmp, "good")
    make_model_dir(good, seed=5)
    text = write(os.path.join(tmp, "t.txt"), TEXT)
    out = os.path.join(tmp, "o.safetensors")
    base = lambda m, t=text: ["--model", m, "--text", t, "--output", out]  # noqa: E731

    expect_error(base(os.path.join(tmp, "nowhere")), "nowhere", "does not exist")
    for missing, frag in (("config.json", "no config.json"), ("model.safetensors", "no model.safetensors"),
                          ("vocab.txt", "no vocab.txt")):
        d = os.path.join(tmp, "no-" + missing)
        make_model_dir(d)
        os.remove(os.path.join(d, missing))
        expect_error(base(d), frag)
    d = os.path.join(tmp, "gpt")
    make_model_dir(d, config_overrides={"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    expect_error(base(d), "gpt2", "not a BERT-style encoder")
    d = os.path.join(tmp, "rel")
    make_model_dir(d, config_overrides={"position_embedding_type": "relative_key"})
    expect_error(base(d), "relative_key")
    d = os.path.join(tmp, "nokey")
    make_model_dir(d, drop=("encoder.layer.1.attention.self.key.weight",))
    expect_error(base(d), "encoder.layer.1.attention.self.key.weight")
    d = os.path.join(tmp, "badjson")
    make_model_dir(d)
    write(os.path.join(d, "config.json"), "{not json")
    expect_error(base(d), "config.json")
    d = os.path.join(tmp, "badweights")
    make_model_dir(d)
    write(os.path.join(d, "model.safetensors"), "garbage")
    expect_error(base(d), "model.safetensors")

    expect_error(base(good, os.path.join(tmp, "missing.txt")), "missing.txt", "does not exist")
    expect_error(base(good, write(os.path.join(tmp, "empty.txt"), "")), "empty.txt", "is empty")
    expect_error(base(good, write(os.path.join(tmp, "blank.txt"), " \n\t\n")), "blank.txt", "is empty")
    expect_error(base(good) + ["--layer", "3"], "--layer 3", "out of range", "3 layers")
    expect_error(base(good) + ["--layer", "-1"], "out of range")
    expect_error(base(good) + ["--heads", "0,4"], "head 4", "out of range", "4 heads")
    expect_error(base(good) + ["--heads", "x"], "--heads")
    expect_error(base(good) + ["--window", "25"], "max_position_embeddings")
    expect_error(base(good) + ["--window", "2"], "--window 2")
    expect_error(["--model", good, "--text", text, "--output", os.path.join(tmp, "no", "dir", "o.st")],
                 "output directory")
    assert not os.path.exists(out)


def main():
    tests = [(n, f) for n, f in sorted(globals().items()) if n.startswith("test_") and callable(f)]
    passed = failed = 0
    for name, fn in tests:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                fn(tmp)
                passed += 1
                print(f"ok      {name}")
            except Exception:
                failed += 1
                print(f"FAILED  {name}\n{traceback.format_exc()}")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
