#!/usr/bin/env python3
"""Capture one attention layer's queries, keys and values from a pretrained BERT encoder.

Loads a model directory in the Hugging Face layout (config.json, model.safetensors or a
sharded model.safetensors.index.json, vocab.txt [, tokenizer_config.json]) offline, tokenizes
English text with WordPiece, runs the encoder in NumPy and writes the chosen layer's q/k/v
(after the Q/K/V projections, split into heads: exactly what the attention softmax uses; BERT
adds absolute position embeddings at the input and has no RoPE) as a `kvmem-run kvm` input:

  q, k, v    [1, H, T, head_dim] float32     H = the chosen heads, T = captured rows
  gate       [1, H, T]  zeros                neutral: the model was not trained with a memory
  ln_weight  [head_dim] ones,  ln_bias [head_dim] zeros,  tau_state/tau_bswa [H] ones

Texts longer than the window are split into consecutive windows of --window rows, each
[CLS] + (window - 2) text tokens + [SEP], run separately; their rows are concatenated.

  python3 tools/capture/capture.py --model DIR --text FILE [--text FILE ...] \
      --output OUT.safetensors [--layer L] [--heads 0,1] [--max-tokens N] [--window 512]

--window defaults to the model's max_position_embeddings (512 for BERT).

Errors (missing or malformed model directory, not a BERT encoder, missing or empty text,
layer or head out of range) print one line naming the problem and exit with status 2.
"""
import argparse
import hashlib
import json
import math
import os
import struct
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bert import Bert, find_prefix  # noqa: E402
from wordpiece import BertTokenizer  # noqa: E402


class CaptureError(Exception):
    """A problem with the inputs of a capture; the CLI prints it and exits with status 2."""


# ---------------------------------------------------------------- safetensors

_ST_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4",
              "I16": "<i2", "I8": "i1", "U8": "u1", "BOOL": "?"}
_ST_NAMES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}


def read_safetensors(path):
    """Reads a safetensors file -> ({name: ndarray}, {metadata}). BF16 is widened to float32."""
    with open(path, "rb") as f:
        buf = f.read()
    if len(buf) < 8:
        raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
    (n,) = struct.unpack("<Q", buf[:8])
    if 8 + n > len(buf):
        raise ValueError(f"{path}: not a safetensors file (header length {n} beyond end of file)")
    try:
        header = json.loads(buf[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: bad safetensors header ({e})")
    meta = header.pop("__metadata__", None) or {}
    data = memoryview(buf)[8 + n:]
    out = {}
    for name, info in header.items():
        b, e = info["data_offsets"]
        shape = tuple(int(s) for s in info["shape"])
        if not 0 <= b <= e <= len(data):
            raise ValueError(f"{path}: tensor {name} data_offsets {[b, e]} outside the data section")
        if info["dtype"] == "BF16":
            raw = np.frombuffer(data[b:e], dtype="<u2").astype(np.uint32) << 16
            arr = raw.view(np.float32)
        elif info["dtype"] in _ST_DTYPES:
            arr = np.frombuffer(data[b:e], dtype=_ST_DTYPES[info["dtype"]])
        else:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        if arr.size != math.prod(shape):
            raise ValueError(f"{path}: tensor {name} has {arr.size} values for shape {list(shape)}")
        out[name] = arr.reshape(shape)
    return out, meta


def write_safetensors(path, tensors, metadata=None):
    """Writes {name: ndarray} (tensors sorted by name) and string metadata to `path`."""
    header, blobs, off = {}, [], 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        dt = a.dtype.newbyteorder("<") if a.dtype.byteorder not in "|" else a.dtype
        if dt not in _ST_NAMES:
            raise ValueError(f"{name}: unsupported dtype {a.dtype}")
        raw = a.astype(dt).tobytes()
        header[name] = {"dtype": _ST_NAMES[dt], "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    hb = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for raw in blobs:
            f.write(raw)


# ---------------------------------------------------------------- model directory

REQUIRED_CONFIG = ["hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size",
                   "max_position_embeddings", "vocab_size"]


def load_config(model_dir):
    """config.json of a BERT encoder, checked; raises CaptureError naming the problem."""
    if not os.path.isdir(model_dir):
        raise CaptureError(f"model directory {model_dir!r} does not exist or is not a directory")
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise CaptureError(f"model directory {model_dir!r} has no config.json")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CaptureError(f"{path}: cannot read it as JSON ({e})")
    if not isinstance(cfg, dict):
        raise CaptureError(f"{path}: not a JSON object")
    mtype = cfg.get("model_type")
    archs = cfg.get("architectures") or []
    if mtype != "bert" and not (mtype is None and any(str(a).startswith("Bert") for a in archs)):
        raise CaptureError(f"{path}: model_type {mtype!r} (architectures {archs}) is not a BERT-style encoder; "
                           "capture supports model_type 'bert' (absolute positions, WordPiece vocab.txt)")
    if cfg.get("is_decoder"):
        raise CaptureError(f"{path}: is_decoder is true; capture supports BERT encoders only")
    pet = cfg.get("position_embedding_type", "absolute")
    if pet != "absolute":
        raise CaptureError(f"{path}: position_embedding_type {pet!r} is not supported (only 'absolute')")
    for key in REQUIRED_CONFIG:
        if not isinstance(cfg.get(key), int) or cfg[key] <= 0:
            raise CaptureError(f"{path}: {key} is missing or not a positive integer ({cfg.get(key)!r})")
    if cfg["hidden_size"] % cfg["num_attention_heads"]:
        raise CaptureError(f"{path}: hidden_size {cfg['hidden_size']} is not a multiple of "
                           f"num_attention_heads {cfg['num_attention_heads']}")
    return cfg


def weight_files(model_dir):
    """The safetensors files holding the weights (one file, or the shards of an index)."""
    single = os.path.join(model_dir, "model.safetensors")
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(single):
        return [single]
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise CaptureError(f"{index}: cannot read its weight_map ({e})")
        files = [os.path.join(model_dir, s) for s in shards]
        for p in files:
            if not os.path.isfile(p):
                raise CaptureError(f"{index} names shard {p!r}, which does not exist")
        return files
    other = [n for n in ("pytorch_model.bin", "tf_model.h5", "flax_model.msgpack")
             if os.path.isfile(os.path.join(model_dir, n))]
    hint = f" (found {', '.join(other)}; only safetensors weights are read, convert them first)" if other else ""
    raise CaptureError(f"model directory {model_dir!r} has no model.safetensors "
                       f"or model.safetensors.index.json{hint}")


def load_weights(model_dir):
    weights = {}
    for p in weight_files(model_dir):
        try:
            tensors, _ = read_safetensors(p)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CaptureError(f"cannot read weights {p}: {e}")
        weights.update(tensors)
    return weights


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def load_model(model_dir):
    """(config, Bert, BertTokenizer) of a model directory; raises CaptureError naming the problem."""
    cfg = load_config(model_dir)
    vocab_path = os.path.join(model_dir, "vocab.txt")
    if not os.path.isfile(vocab_path):
        raise CaptureError(f"model directory {model_dir!r} has no vocab.txt (the WordPiece vocabulary)")
    weights = load_weights(model_dir)
    if find_prefix(weights) is None:
        raise CaptureError(f"weights in {model_dir!r} have no embeddings.word_embeddings.weight; "
                           "not a BERT checkpoint in the Hugging Face layout")
    try:
        model = Bert(cfg, weights)
    except KeyError as e:
        raise CaptureError(f"weights in {model_dir!r} lack tensor {e.args[0]!r} that config.json implies")
    except ValueError as e:
        raise CaptureError(f"model in {model_dir!r}: {e}")
    try:
        tok = BertTokenizer.from_dir(model_dir)
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise CaptureError(f"tokenizer of {model_dir!r}: {e}")
    if len(tok.vocab) > model.w["embeddings.word_embeddings.weight"].shape[0]:
        raise CaptureError(f"vocab.txt has {len(tok.vocab)} tokens but the embedding matrix only "
                           f"{model.w['embeddings.word_embeddings.weight'].shape[0]} rows")
    return cfg, model, tok


# ---------------------------------------------------------------- texts and windows

def read_text_tokens(paths, tokenizer):
    """[(path, ids)] for each text file; raises CaptureError for a missing or empty file."""
    out = []
    for p in paths:
        if not os.path.isfile(p):
            raise CaptureError(f"text file {p!r} does not exist")
        try:
            with open(p, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise CaptureError(f"text file {p!r} cannot be read as UTF-8 ({e})")
        ids = tokenizer.encode(text)
        if not ids:
            raise CaptureError(f"text file {p!r} is empty (no tokens after tokenization)")
        out.append((p, ids))
    return out


def plan_windows(n_text, window, max_tokens=None):
    """Splits n_text text tokens into windows of at most `window` rows ([CLS] + text + [SEP]).

    Returns [(start, end)] ranges of text tokens. With max_tokens, the rows of all windows add
    up to at most max_tokens (exactly max_tokens when the text is long enough, unless that would
    leave a last window of fewer than 3 rows, which is dropped)."""
    if window < 3:
        raise CaptureError(f"--window {window} is too small (at least 3: [CLS], one token, [SEP])")
    per = window - 2
    spans, start, rows = [], 0, 0
    while start < n_text:
        take = min(per, n_text - start)
        if max_tokens is not None:
            take = min(take, max_tokens - rows - 2)
            if take < 1:
                break
        spans.append((start, start + take))
        start += take
        rows += take + 2
    return spans


def check_selection(model, layer, heads, window, max_tokens=None):
    """Raises CaptureError when the layer, a head, the window or max_tokens does not fit the model."""
    if not 0 <= layer < model.layers:
        raise CaptureError(f"--layer {layer} is out of range: "
                           f"the model has {model.layers} layers (0..{model.layers - 1})")
    if not heads:
        raise CaptureError("no heads chosen")
    for h in heads:
        if not 0 <= h < model.heads:
            raise CaptureError(f"head {h} is out of range: the model has {model.heads} heads (0..{model.heads - 1})")
    if len(set(heads)) != len(heads):
        raise CaptureError(f"heads {heads} repeat a head")
    if window > model.max_positions:
        raise CaptureError(f"--window {window} exceeds the model's max_position_embeddings {model.max_positions}")
    if max_tokens is not None and max_tokens < 3:
        raise CaptureError(f"--max-tokens {max_tokens} is too small (at least 3)")
    if window < 3:
        raise CaptureError(f"--window {window} is too small (at least 3: [CLS], one token, [SEP])")


def capture_layer(model, tokenizer, ids, layer, heads, window, max_tokens=None, with_context=False):
    """Runs each window of the token stream `ids` through `model` and concatenates the chosen
    layer's q/k/v rows of the chosen heads. Returns a dict with "q", "k", "v" ([H, T, head_dim]
    float32), "spans" (text-token ranges), "window_rows" and, with `with_context`, "ctx" (the
    model's own attention context of those heads, [H, T, head_dim])."""
    check_selection(model, layer, heads, window, max_tokens)
    spans = plan_windows(len(ids), window, max_tokens)
    if not spans:
        raise CaptureError("no tokens to capture")
    parts = {n: [] for n in ("q", "k", "v", "ctx")}
    sel = list(heads)
    for s, e in spans:
        seq = [tokenizer.cls_id] + list(ids[s:e]) + [tokenizer.sep_id]
        _, cap = model.forward(seq, capture={layer}, stop_after=layer)
        for n in parts:
            parts[n].append(cap[layer][n][sel])
    out = {n: np.concatenate(parts[n], axis=1).astype(np.float32) for n in ("q", "k", "v")}
    if with_context:
        out["ctx"] = np.concatenate(parts["ctx"], axis=1)
    out["spans"] = spans
    out["window_rows"] = [e - s + 2 for s, e in spans]
    return out


NEUTRAL_NOTE = ("gate = 0, ln_weight = 1, ln_bias = 0, tau_state = 1 and tau_bswa = 1 are neutral "
                "placeholder values, not learned parameters: the source model was not trained with a memory")


def neutral_kvm_inputs(q, k, v, lengths=None):
    """A `kvmem-run kvm` input from q [B, Hq, T, D], k [B, Hkv, T, D], v [B, Hkv, T, Dv] (float32) and optional
    lengths [B] (tokens), with the neutral stand-ins of NEUTRAL_NOTE for KVM's learned parameters:
    gate [B, Hkv, T] zeros, ln_weight [D] ones, ln_bias [D] zeros, tau_state and tau_bswa [Hq] ones."""
    B, Hq, T, D = q.shape
    out = {"q": q, "k": k, "v": v,
           "gate": np.zeros((B, k.shape[1], T), np.float32),
           "ln_weight": np.ones(D, np.float32), "ln_bias": np.zeros(D, np.float32),
           "tau_state": np.ones(Hq, np.float32), "tau_bswa": np.ones(Hq, np.float32)}
    if lengths is not None:
        out["lengths"] = np.asarray(lengths, np.int64)
    return out


def kvm_tensors(cap):
    """The `kvmem-run kvm` input tensors from capture_layer's result (one sequence)."""
    return neutral_kvm_inputs(cap["q"][None], cap["k"][None], cap["v"][None])


def capture_metadata(cfg, model, tok, model_dir, model_name, texts, layer, heads, window, max_tokens, cap):
    spans = cap["spans"]
    n_text = spans[-1][1]
    avail = sum(len(ids) for _, ids in texts)
    text_info, pos = [], 0
    for p, ids in texts:
        used = max(0, min(len(ids), n_text - pos))
        text_info.append({"path": p, "sha256": sha256_file(p), "text_tokens": len(ids), "text_tokens_used": used})
        pos += len(ids)
    try:
        wsha = ",".join(sha256_file(p) for p in weight_files(model_dir))
    except CaptureError:
        wsha = "?"
    T = int(cap["q"].shape[1])
    return {
        "kvmem_input": "kvm",
        "source_model": model_name,
        "source_model_dir": model_dir,
        "source_model_type": "bert",
        "source_weights_sha256": wsha,
        "source_layers": str(model.layers), "source_heads": str(model.heads),
        "head_dim": str(model.head_dim), "max_position_embeddings": str(model.max_positions),
        "layer": str(layer),
        "heads": ",".join(str(h) for h in heads),
        "texts": json.dumps(text_info),
        "text_join": "token streams of the text files concatenated in the order given",
        "tokens": str(T),
        "text_tokens": str(n_text),
        "text_tokens_available": str(avail),
        "max_tokens": "none" if max_tokens is None else str(max_tokens),
        "window": str(window),
        "windows": str(len(spans)),
        "window_rows": json.dumps(cap["window_rows"]),
        "windowing": (f"the token stream is split into consecutive windows of at most {window} rows, each "
                      f"[CLS] + up to {window - 2} text tokens + [SEP] at positions 0.., run through the model "
                      f"separately; their rows are concatenated in order (T = {T} rows in {len(spans)} windows; "
                      "attention in the source model never crosses a window)"),
        "tokenizer": (f"WordPiece from vocab.txt, BERT basic tokenizer, lowercase={tok.do_lower_case} "
                      f"({tok.lowercase_source}), strip_accents={tok.basic.strip_accents}"),
        "capture_point": (f"layer {layer} self-attention inputs: query/key/value projections (with bias) of the "
                          f"layer input, split into heads of {model.head_dim}; BERT adds absolute position "
                          "embeddings at the input and has no RoPE, so these are exactly the q/k/v of "
                          f"softmax(q k^T / sqrt({model.head_dim})) v"),
        "attention": "the source model attends bidirectionally (non-causal) within each window",
        "neutral_parameters": NEUTRAL_NOTE,
        "tool": "tools/capture/capture.py (NumPy float32 forward pass)",
    }


def parse_heads(text, n_heads):
    """'0,1' -> [0, 1]; None -> all n_heads heads."""
    if text is None:
        return list(range(n_heads))
    try:
        heads = [int(x) for x in text.split(",") if x.strip() != ""]
    except ValueError:
        raise CaptureError(f"--heads {text!r} is not a comma-separated list of head indices")
    return heads


def main(argv=None):
    ap = argparse.ArgumentParser(description="Capture one BERT attention layer's q/k/v as a kvmem-run kvm input.")
    ap.add_argument("--model", required=True, help="model directory (config.json, model.safetensors, vocab.txt)")
    ap.add_argument("--text", action="append", required=True, help="UTF-8 text file (repeatable; concatenated)")
    ap.add_argument("--output", required=True, help="output .safetensors file")
    ap.add_argument("--layer", type=int, default=0, help="attention layer to capture (default 0)")
    ap.add_argument("--heads", default=None, help="comma-separated heads, e.g. 0,1 (default: all)")
    ap.add_argument("--max-tokens", type=int, default=None, help="cap on captured rows T, [CLS]/[SEP] included")
    ap.add_argument("--window", type=int, default=None,
                    help="rows per window, [CLS] and [SEP] included (default: the model's "
                         "max_position_embeddings, 512 for BERT)")
    ap.add_argument("--model-name", default=None,
                    help="model name for the metadata (default: config _name_or_path, else the directory name)")
    args = ap.parse_args(argv)
    try:
        out_dir = os.path.dirname(os.path.abspath(args.output))
        if not os.path.isdir(out_dir):
            raise CaptureError(f"output directory {out_dir!r} does not exist")
        cfg, model, tok = load_model(args.model)
        heads = parse_heads(args.heads, model.heads)
        if args.window is None:
            args.window = model.max_positions
        check_selection(model, args.layer, heads, args.window, args.max_tokens)
        texts = read_text_tokens(args.text, tok)
        ids = [i for _, t in texts for i in t]
        cap = capture_layer(model, tok, ids, args.layer, heads, args.window, args.max_tokens)
        name = args.model_name or cfg.get("_name_or_path") or os.path.basename(os.path.normpath(args.model))
        meta = capture_metadata(cfg, model, tok, args.model, name, texts, args.layer, heads,
                                args.window, args.max_tokens, cap)
        write_safetensors(args.output, kvm_tensors(cap), meta)
    except CaptureError as e:
        print(f"capture: error: {e}", file=sys.stderr)
        return 2
    H, T, D = cap["q"].shape
    print(f"capture: {name} layer {args.layer} heads {','.join(map(str, heads))}: T = {T} rows "
          f"({meta['text_tokens']} text tokens of {meta['text_tokens_available']}, {len(cap['spans'])} windows of "
          f"<= {args.window}), head_dim {D} -> {args.output} ({os.path.getsize(args.output)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
