"""Greedy generation of a real causal LM (SmolLM2-135M-Instruct, loaded by tools/capture/smollm2.py) with transformers' full KV
cache and with kvmem memories in every layer at 1/4 and 1/8 of it, printed side by side with the peak
bytes of each cache.

    python examples/python/generate.py [--new-tokens 48] [--fractions 4 8] [--dtype bfloat16]

The prompt is a long context (a text written for this example, about 600 tokens) and a question about a
fact near its start. A memory at 1/F of the cache holds (prompt + new tokens) / F rows per kv-head and
layer: H2O and TOVA keep sinks + a recent window + their top-scored tokens; KVM keeps a block sliding
window and merged state rows (fixed budget, merge gate z = 0 and neutral LayerNorm: KVM's learned scalars
are not trained for this model, see docs/fidelity.md); OVQ a window of one chunk and centroids. --dtype
runs the model in bfloat16 or float16 (default float32): the full cache and every kvmem memory then hold
keys and values in that dtype. Peak bytes: the full cache's keys and values at the end; for kvmem, the keys
and values the memories hold (held_bytes) and everything they allocated, scratch for the prefill included
(allocated_bytes).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from transformers import DynamicCache

import kvmem
import kvmem.transformers as kt

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "capture"))
import smollm2  # noqa: E402

CONTEXT = """The harbour town of Velmora sits at the mouth of the river Aske. Its lighthouse keeper in the year
of the great flood was a woman named Ottilie Brandt, and the lighthouse itself was painted green, not white,
because the paint ship that came that spring carried nothing else. The town has three bridges. The oldest,
the Salt Bridge, was built of grey stone by the fishermen's guild; the second, the Iron Bridge, was paid for
by the railway company; the third, a narrow footbridge, was built by schoolchildren as a summer project and is
still called the Children's Bridge. Velmora's main export is dried cod, followed by rope and, in good years,
apples from the orchards on the northern hills. The orchards belong to four families who meet every autumn
in the old customs house to set the price of apples for the coming year. Trains reach Velmora twice a day, at
seven in the morning and at six in the evening, and the station clock has been five minutes fast for as long
as anyone remembers. The town council meets on the first Tuesday of each month. Its longest debate, which
lasted nine hours, was about whether the market should move from the square to the quay; the market stayed in
the square. In winter the river freezes near the banks but never in the middle, and the ferry to the island
of Hesk runs all year. On Hesk there is a small observatory, built by an astronomer who left the town his
telescope and his collection of seashells. The school teaches navigation to anyone over twelve, and every
child in Velmora learns to tie the bowline before learning to ride a bicycle. The bakery on the quay sells a
rye bread with caraway that sailors take on long voyages, because it keeps for three weeks. Once a year, on
the longest night, the whole town walks across the Salt Bridge carrying lanterns to remember the flood, and
the lighthouse, still green, is lit an hour early."""

QUESTION = "In the text above, who was the lighthouse keeper of Velmora in the year of the great flood, and what colour was the lighthouse?"


def memories(rows: int):
    """The kvmem memories that hold about ``rows`` rows per kv-head (rows >= 32)."""
    window = max(8, rows // 4)
    chunk = 16
    return {
        "H2O": kt.eviction("h2o", sinks=4, window=window, top_k=rows - 4 - window),
        "TOVA": kt.eviction("tova", sinks=4, window=window, top_k=rows - 4 - window),
        # compressed once, when the prompt ends (kvpress's and SnapKV's setting): the question scores the prompt
        "SnapKV (end)": kt.eviction("snapkv", sinks=4, window=window, top_k=rows - 4 - window, chunk=0,
                                    observation_window=32),
        "KVM": kt.kvm(chunk=chunk, window_chunks=2, sinks=1, max_rows=rows - 2 * chunk,
                      budget=kvmem.budget.Fixed(rows - 2 * chunk)),
        "OVQ": kt.ovq(chunk=chunk, max_centroids=rows - chunk),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new-tokens", type=int, default=48, help="tokens to generate (default 48)")
    ap.add_argument("--fractions", type=int, nargs="+", default=[4, 8], help="cache fractions 1/F (default 4 8)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="the model's dtype, and the dtype the caches hold keys and values in (default float32)")
    args = ap.parse_args()

    t0 = time.time()
    model, tok = smollm2.load()
    model = model.to(getattr(torch, args.dtype))
    print(f"model: SmolLM2-135M-Instruct (GGUF Q4_1 weights, {args.dtype}), loaded in {time.time() - t0:.0f} s; "
          f"kvmem backend: {kvmem.backend()}")
    messages = [{"role": "user", "content": CONTEXT + "\n\n" + QUESTION}]
    enc = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = enc["input_ids"]
    total = ids.shape[1] + args.new_tokens
    print(f"prompt: {ids.shape[1]} tokens; {args.new_tokens} new tokens (greedy); full cache: {total} tokens per layer")

    def run(label, cache):
        start = time.time()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=enc["attention_mask"], past_key_values=cache,
                                 max_new_tokens=args.new_tokens, do_sample=False)
        seconds = time.time() - start
        text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip().replace("\n", " ")
        if isinstance(cache, kt.KvmemCache):
            held, peak = cache.held_bytes(), cache.allocated_bytes()
        else:
            held = peak = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
        print(f"{label:<16} {held / 2**20:7.2f} {peak / 2**20:9.2f} {(out.shape[1] - ids.shape[1]) / seconds:6.1f}  {text}",
              flush=True)

    print(f"{'cache':<16} {'held':>7} {'allocated':>9} {'tok/s':>6}  greedy answer (held: MiB of keys/values kept at the end; "
          "allocated: MiB of the cache's peak allocation, scratch included)")
    model.set_attn_implementation("sdpa")
    run("full (sdpa)", DynamicCache(config=model.config))
    for f in args.fractions:
        rows = total // f
        for name, factory in memories(rows).items():
            run(f"{name} 1/{f} ({rows})", kt.KvmemCache(model, factory))


if __name__ == "__main__":
    main()
