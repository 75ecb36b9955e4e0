"""Continuous batching on a real causal LM (SmolLM2-135M-Instruct): requests of random prompt and output
lengths arrive (Poisson) and leave, up to --slots at a time, served by one kvmem memory per layer and, in
the same process, by a full KV cache; prints throughput, memory held and latency percentiles and writes a
plot. (examples/serving.cpp is the same loop in C++ without a model; --replot draws its runs.)

    python examples/python/serving.py [--memory h2o] [--budget 128] [--requests 48] [--slots 32]
                                      [--rate 4] [--prefill-chunk 0] [--plot serving.png] [--json serving.json]

The engine loop is the one of vLLM or SGLang, reduced to its bones: every step admits the requests that
have arrived into free slots and prefills their prompts (one batched call; with --prefill-chunk N, prompts
longer than N come in chunks of N, one per step, interleaved with the other slots' decode steps), then runs
one decode step of every slot past its prompt, and frees the slot of a request that has its tokens
(reset_sequence). Each layer's memory is a batch of --slots sequences; the model's own modules compute
queries, keys and values (RoPE at each request's own positions) and everything after attention, so the
only difference between the two runs is the cache.

Memories: h2o, tova, streaming, knorm (eviction at a budget of --budget rows per kv-head: 4 sinks, a
window of budget/4, the rest top-scored), kvm and proportional (a fixed budget of --budget state rows after a
window of two chunks of 16). The full cache keeps every key and value of every live request
([slots, kv-heads, tokens, head_dim] per layer, grown by doubling) and attends with PyTorch's SDPA.

Latency is measured on the wall clock from each request's arrival: time to first token (TTFT), time per
output token after the first (TPOT) and end to end. The arrival times are drawn once (seeded), so both runs
serve the same requests; an engine with nothing to do skips ahead to the next arrival. Memory held: what the
caches hold for the live requests at each step (kvmem: held_bytes of every layer; full: the live tokens'
keys and values). With --check, the run fails unless every request's greedy tokens in the shared batch are
its tokens served alone (a batch of one through fresh memories of the same kind, the same prefill chunks:
what a slot holds must not leak into another request, whatever the memory evicts or merges), and, where
--budget holds every token of every request, the full cache's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time

import torch
import torch.nn.functional as F

import kvmem
import kvmem.transformers as kt

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "..", "tools", "capture"))
sys.path.insert(0, here)
import smollm2  # noqa: E402
from generate import CONTEXT  # noqa: E402  (the prompts are slices of this text)


class FullCache:
    """The full KV cache of one layer for ``slots`` sequences, with the memories' calls: keys and values
    [slots, Hkv, capacity, D] (capacity in tokens, doubled when a sequence outgrows it), tokens per slot."""

    def __init__(self, slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
        self.keys = torch.zeros(slots, kv_heads, 64, head_dim, dtype=dtype)
        self.values = torch.zeros_like(self.keys)
        self.lengths = [0] * slots

    def _append(self, b: int, k: torch.Tensor, v: torch.Tensor) -> None:
        n, t = self.lengths[b], k.shape[1]
        if n + t > self.keys.shape[2]:
            grow = max(n + t, 2 * self.keys.shape[2])
            pad = lambda x: F.pad(x, (0, 0, 0, grow - x.shape[2]))
            self.keys, self.values = pad(self.keys), pad(self.values)
        self.keys[b, :, n:n + t], self.values[b, :, n:n + t] = k, v
        self.lengths[b] = n + t

    def prefill(self, q, k, v, lengths):
        """q [S, Hq, T, D], k, v [S, Hkv, T, D]: slot b takes lengths[b] tokens after those it holds."""
        y = torch.zeros_like(q)
        for b, t in enumerate(lengths):
            if t == 0:
                continue
            held = self.lengths[b]
            self._append(b, k[b, :, :t], v[b, :, :t])
            n = held + t
            causal = torch.ones(t, n, dtype=torch.bool).tril(diagonal=held)
            y[b:b + 1, :, :t] = F.scaled_dot_product_attention(q[b:b + 1, :, :t], self.keys[b:b + 1, :, :n],
                                                               self.values[b:b + 1, :, :n], attn_mask=causal,
                                                               enable_gqa=True)
        return y

    def decode(self, q, k, v, active):
        """One token per active slot (q [S, Hq, 1, D]); the others' rows of y are zeros."""
        y = torch.zeros_like(q)
        rows = [b for b, a in enumerate(active) if a]
        for b in rows:
            self._append(b, k[b, :, :1], v[b, :, :1])
        n = max(self.lengths[b] for b in rows)
        idx = torch.tensor(rows)
        mask = torch.arange(n)[None, :] < torch.tensor([self.lengths[b] for b in rows])[:, None]
        y[idx] = F.scaled_dot_product_attention(q[idx], self.keys[idx, :, :n], self.values[idx, :, :n],
                                                attn_mask=mask[:, None, None, :], enable_gqa=True)
        return y

    def reset_sequence(self, b: int) -> None:
        self.lengths[b] = 0

    def held_bytes(self) -> int:
        per_token = 2 * self.keys.shape[1] * self.keys.shape[3] * self.keys.element_size()
        return sum(self.lengths) * per_token


def memory_factory(name: str, budget: int):
    """A kvmem memory of about ``budget`` rows per kv-head (kvmem.transformers' factories)."""
    if name in ("h2o", "tova", "streaming", "knorm"):
        window = max(4, budget // 4)
        return kt.eviction(name, sinks=4, window=window, top_k=budget - 4 - window)
    chunk = 16
    if name == "kvm":
        return kt.kvm(chunk=chunk, window_chunks=2, sinks=1, max_rows=budget, budget=kvmem.budget.Fixed(budget))
    if name == "proportional":
        return kt.proportional(chunk=chunk, window_chunks=2, sinks=1, max_rows=budget, budget=kvmem.budget.Fixed(budget))
    raise ValueError(f"--memory = {name}: expected h2o, tova, streaming, knorm, kvm or proportional")


def forward(model, caches, slots, rows, ids, positions, kind, control):
    """One engine step through every layer for the slots ``rows`` (the others take no token): ids,
    positions [len(rows), T]; kind "prefill" (control: tokens per slot) or "decode" (control: active
    slots). The caches take the whole batch of ``slots`` (zeros for the other slots). Returns the final
    hidden states [len(rows), T, hidden] (model.lm_head gives the logits of the positions that need them)."""
    m = model.model
    h = m.embed_tokens(ids)
    cos, sin = m.rotary_emb(h, positions)
    R, T, _ = h.shape
    idx = torch.tensor(rows)

    def batch(x):  # [R, H, T, D] -> [slots, H, T, D]
        out = x.new_zeros((slots,) + x.shape[1:])
        out[idx] = x
        return out

    for layer, cache in zip(m.layers, caches):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        shape = (R, T, -1, attn.head_dim)
        q = attn.q_proj(x).view(shape).transpose(1, 2)
        k = attn.k_proj(x).view(shape).transpose(1, 2)
        v = attn.v_proj(x).view(shape).transpose(1, 2)
        q, k = _rope(q, k, cos, sin)
        q, k, v = batch(q), batch(k), batch(v)
        y = cache.prefill(q, k, v, lengths=control) if kind == "prefill" else cache.decode(q, k, v, active=control)
        h = h + attn.o_proj(y[idx].transpose(1, 2).reshape(R, T, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return m.norm(h)


def _rope(q, k, cos, sin):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    return apply_rotary_pos_emb(q, k, cos, sin)


def draw_requests(args, corpus):
    """Requests with Poisson arrival times (seconds), prompts (slices of the corpus) and output lengths."""
    rng = random.Random(args.seed)
    clock, reqs = 0.0, []
    for i in range(args.requests):
        clock += rng.expovariate(args.rate)
        n = rng.randint(*args.prompt_tokens)
        start = rng.randint(0, len(corpus) - n)
        reqs.append({"id": i, "arrival": clock, "prompt": corpus[start:start + n],
                     "output": rng.randint(*args.output_tokens)})
    return reqs


def serve(model, caches, requests, slots, prefill_chunk, label, progress=True):
    """Runs the engine loop over ``requests``; returns per-request results and the per-step memory trace."""
    from tqdm import tqdm

    waiting = sorted(requests, key=lambda r: r["arrival"])
    holds = [None] * slots  # per slot: {"req", "seen" (prompt tokens prefilled), "tokens" (generated)}
    done, trace, generated = [], [], 0
    start, skipped = time.perf_counter(), 0.0
    now = lambda: time.perf_counter() - start + skipped
    bar = tqdm(total=sum(r["output"] for r in requests), desc=f"{label:<22}", unit="tok", disable=not progress,
               leave=True, dynamic_ncols=True)
    with torch.no_grad():
        while waiting or any(holds):
            if not any(holds) and waiting and waiting[0]["arrival"] > now():
                skipped += waiting[0]["arrival"] - now()  # idle: skip ahead to the next arrival
            for s in range(slots):
                if holds[s] is None and waiting and waiting[0]["arrival"] <= now():
                    holds[s] = {"req": waiting.pop(0), "seen": 0, "tokens": [], "times": []}
            # Prefill: the slots whose prompt is not in yet take it (or its next chunk).
            piece = [0] * slots
            for s, st in enumerate(holds):
                if st is not None and st["seen"] < len(st["req"]["prompt"]):
                    left = len(st["req"]["prompt"]) - st["seen"]
                    piece[s] = min(left, prefill_chunk) if prefill_chunk > 0 else left
            if any(piece):
                T, rows = max(piece), [s for s, n in enumerate(piece) if n]
                ids = torch.zeros(len(rows), T, dtype=torch.long)
                pos = torch.zeros(len(rows), T, dtype=torch.long)
                for i, s in enumerate(rows):
                    st, n = holds[s], piece[s]
                    ids[i, :n] = torch.tensor(st["req"]["prompt"][st["seen"]:st["seen"] + n])
                    pos[i, :n] = torch.arange(st["seen"], st["seen"] + n)
                hidden = forward(model, caches, slots, rows, ids, pos, "prefill", piece)
                for i, s in enumerate(rows):
                    st, n = holds[s], piece[s]
                    st["seen"] += n
                    if st["seen"] == len(st["req"]["prompt"]):  # the prompt is in: its first token
                        st["tokens"].append(int(model.lm_head(hidden[i, n - 1]).argmax()))
                        st["times"].append(now())
                        generated += 1
                        bar.update(1)
            # Decode: every slot past its prompt that still owes tokens.
            active = [st is not None and st["seen"] == len(st["req"]["prompt"]) and 0 < len(st["tokens"]) < st["req"]["output"]
                      for st in holds]
            if any(active):
                rows = [s for s, a in enumerate(active) if a]
                ids = torch.tensor([[holds[s]["tokens"][-1]] for s in rows])
                pos = torch.tensor([[len(holds[s]["req"]["prompt"]) + len(holds[s]["tokens"]) - 1] for s in rows])
                logits = model.lm_head(forward(model, caches, slots, rows, ids, pos, "decode", active)[:, 0])
                for i, s in enumerate(rows):
                    st = holds[s]
                    st["tokens"].append(int(logits[i].argmax()))
                    st["times"].append(now())
                    generated += 1
                    bar.update(1)
            trace.append({"time": now(), "held_bytes": sum(c.held_bytes() for c in caches),
                          "live": sum(st is not None for st in holds)})
            for s, st in enumerate(holds):  # requests with all their tokens leave
                if st is not None and len(st["tokens"]) == st["req"]["output"]:
                    r, t = st["req"], st["times"]
                    done.append({"id": r["id"], "tokens": st["tokens"], "ttft": t[0] - r["arrival"],
                                 "tpot": (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else 0.0,
                                 "latency": t[-1] - r["arrival"], "prompt": len(r["prompt"]), "output": r["output"]})
                    for c in caches:
                        c.reset_sequence(s)
                    holds[s] = None
    bar.close()
    wall = time.perf_counter() - start
    return {"label": label, "requests": sorted(done, key=lambda d: d["id"]), "trace": trace, "wall_s": wall,
            "generated": generated, "tokens_per_s": generated / wall,
            "peak_held_bytes": max(p["held_bytes"] for p in trace)}


def served_alone(model, requests, factory, shape, prefill_chunk):
    """Each request served on its own: a batch of one through fresh memories of ``factory`` (``shape``: the
    factory's keywords; its batch is replaced by 1), with the same prefill chunks. Returns {request id:
    greedy tokens}."""
    layers = model.config.num_hidden_layers
    tokens = {}
    for r in requests:
        mems = [factory(i, **{**shape, "batch": 1}) for i in range(layers)]
        run = serve(model, mems, [dict(r, arrival=0.0)], 1, prefill_chunk, "alone", progress=False)
        tokens[r["id"]] = run["requests"][0]["tokens"]
    return tokens


def diverging(run, tokens) -> list[int]:
    """The ids of the requests of ``run`` (serve()'s result) whose tokens are not ``tokens[id]``, and of those
    ``tokens`` has that ``run`` did not serve."""
    served = {r["id"]: r["tokens"] for r in run["requests"]}
    return sorted(i for i in served.keys() | tokens.keys() if served.get(i) != tokens.get(i))


def percentiles(xs):
    xs = sorted(xs)
    at = lambda p: xs[min(len(xs) - 1, max(0, math.ceil(p / 100 * len(xs)) - 1))]
    return {"p50": at(50), "p90": at(90), "p99": at(99)}


def summary(run):
    out = {k: run[k] for k in ("label", "wall_s", "generated", "tokens_per_s", "peak_held_bytes")}
    for key in ("ttft", "tpot", "latency"):
        out[key] = percentiles([r[key] for r in run["requests"]])
    return out


def plot(runs, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        a.plot([p["time"] for p in run["trace"]], [p["held_bytes"] / 2**20 for p in run["trace"]], label=run["label"])
        ttft = sorted(r["ttft"] for r in run["requests"])
        b.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=run["label"])
    a.set_xlabel("time (s)")
    a.set_ylabel("memory held, all layers (MiB)")
    a.set_title("Cache memory of the live requests")
    b.set_xlabel("time to first token (s)")
    b.set_ylabel("fraction of requests")
    b.set_title("TTFT, cumulative")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--memory", default="h2o", help="h2o, tova, streaming, knorm, kvm or proportional (default h2o)")
    ap.add_argument("--budget", type=int, default=128, help="rows per kv-head and layer (default 128)")
    ap.add_argument("--requests", type=int, default=48, help="requests to serve (default 48)")
    ap.add_argument("--slots", type=int, default=32, help="requests served at once, the memories' batch (default 32)")
    ap.add_argument("--rate", type=float, default=4.0, help="arrivals per second, Poisson (default 4)")
    ap.add_argument("--prompt-tokens", type=int, nargs=2, default=[64, 320], metavar=("MIN", "MAX"),
                    help="prompt length range in tokens (default 64 320)")
    ap.add_argument("--output-tokens", type=int, nargs=2, default=[16, 64], metavar=("MIN", "MAX"),
                    help="output length range in tokens (default 16 64)")
    ap.add_argument("--prefill-chunk", type=int, default=0,
                    help="prefill prompts in chunks of this many tokens, one per step (0: whole prompts)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--plot", default="serving.png", help="the plot (PNG; default serving.png)")
    ap.add_argument("--json", default=None, help="write the summaries and per-request results here")
    ap.add_argument("--check", action="store_true", help="fail unless every request's tokens are its tokens served "
                    "alone through the same memory (and the full cache's where --budget holds every token)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--replot", metavar="JSON", help="only plot the runs of a JSON file (this script's --json, or "
                    "the C++ example's: kvmem_example_serving) into --plot, and exit")
    args = ap.parse_args()
    if args.replot:
        with open(args.replot) as f:
            plot(json.load(f)["runs"], args.plot)
        print(f"plot: {args.plot}")
        return
    if args.slots < 1 or args.requests < 1 or args.budget < 16:
        ap.error("--slots and --requests must be >= 1, --budget >= 16")

    torch.manual_seed(args.seed)
    t0 = time.time()
    model, tok = smollm2.load()
    corpus = tok(CONTEXT)["input_ids"]
    args.prompt_tokens[1] = min(args.prompt_tokens[1], len(corpus))
    args.prompt_tokens[0] = min(args.prompt_tokens)
    requests = draw_requests(args, corpus)
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    print(f"model: SmolLM2-135M-Instruct ({cfg.num_hidden_layers} layers, {cfg.num_attention_heads} query heads, "
          f"{cfg.num_key_value_heads} kv-heads, head_dim {head_dim}; loaded in {time.time() - t0:.0f} s); "
          f"kvmem backend: {kvmem.backend()}; torch threads: {torch.get_num_threads()}")
    print(f"workload: {args.requests} requests, Poisson arrivals at {args.rate}/s, prompts {args.prompt_tokens[0]}-"
          f"{args.prompt_tokens[1]} tokens, outputs {args.output_tokens[0]}-{args.output_tokens[1]} tokens (greedy), "
          f"up to {args.slots} at a time" + (f", prefill chunks of {args.prefill_chunk}" if args.prefill_chunk else ""))

    full = [FullCache(args.slots, cfg.num_key_value_heads, head_dim, torch.float32) for _ in range(cfg.num_hidden_layers)]
    factory = memory_factory(args.memory, args.budget)
    shape = dict(head_dim=head_dim, query_heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
                 value_dim=head_dim, batch=args.slots, dtype=torch.float32)
    mems = [factory(i, **shape) for i in range(cfg.num_hidden_layers)]
    runs = [serve(model, full, requests, args.slots, args.prefill_chunk, "full KV cache (sdpa)", not args.no_progress),
            serve(model, mems, requests, args.slots, args.prefill_chunk, f"kvmem {args.memory} {args.budget}",
                  not args.no_progress)]
    same = sum(a["tokens"] == b["tokens"] for a, b in zip(runs[0]["requests"], runs[1]["requests"]))
    print(f"\n{'cache':<24} {'tok/s':>7} {'peak held':>10} {'TTFT p50/p90/p99 (s)':>22} {'TPOT p50/p90/p99 (ms)':>23} "
          f"{'latency p50/p99 (s)':>20}")
    sums = [summary(r) for r in runs]
    for s in sums:
        t, p, l = s["ttft"], s["tpot"], s["latency"]
        print(f"{s['label']:<24} {s['tokens_per_s']:7.1f} {s['peak_held_bytes'] / 2**20:7.1f} MiB "
              f"{t['p50']:6.2f} {t['p90']:6.2f} {t['p99']:6.2f}   {1e3 * p['p50']:6.1f} {1e3 * p['p90']:6.1f} {1e3 * p['p99']:6.1f}   "
              f"{l['p50']:8.2f} {l['p99']:8.2f}")
    print(f"requests whose greedy tokens equal the full cache's: {same} of {args.requests}")
    plot(runs, args.plot)
    print(f"plot: {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "summaries": sums, "same_tokens": same,
                       "runs": [{k: r[k] for k in ("label", "requests", "trace")} for r in runs]}, f, indent=1)
    if args.check:
        apart = diverging(runs[1], served_alone(model, requests, factory, shape, args.prefill_chunk))
        print(f"requests whose greedy tokens equal their own served alone through {args.memory} {args.budget}: "
              f"{args.requests - len(apart)} of {args.requests}")
        if apart:
            sys.exit(f"--check: requests {apart} give other tokens in the shared batch than alone")
        holds_all = args.budget >= args.prompt_tokens[1] + args.output_tokens[1]
        if holds_all and same != args.requests:
            sys.exit(f"--check: {args.requests - same} of {args.requests} requests' tokens differ from the full cache's "
                     f"(the budget {args.budget} holds every token)")


if __name__ == "__main__":
    main()
