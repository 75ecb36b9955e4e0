#!/usr/bin/env python3
"""Fill the causal-LM blocks of docs/fidelity.md (lm-headline, lm-e2e-table, lm-layers-calibrated,
lm-calibration-table, lm-kvm-whole with --whole, lm-distilled with --distilled, lm-distilled-layers with
--held-out, lm-after-prompt with --after-prompt, lm-continuation with --continuation) from the reports of
end_to_end.py, calibrate.py fit, kvmem-eval, tools/distill/distill.py, tools/distill/held_out.py,
after_prompt.py and continuation.py, with tools/kvmem_eval/report.py's
block filler (a block missing from the document is an error, exit 2).

  report_lm.py --doc docs/fidelity.md --e2e e2e.json --calibration calibration.json \
               --layers layer0.json ... --calibrated layer0-kvm-calibrated.json layer0-ovq-calibrated.json ... \
               [--whole layer0-kvm-whole.json layer0-kvm-whole-calibrated.json ...] [--distilled kvm-fixed-8.json ...]
               [--held-out held-out.json ...] [--after-prompt ap.json] [--continuation cont.json]
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from statistics import mean

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "kvmem_eval"))
sys.path.insert(0, os.path.join(HERE, "..", "capture"))
sys.path.insert(0, HERE)
from report import fill, load, pct  # noqa: E402


def layer_mean(reports: list[dict], memory: str, fraction_label: str) -> float | None:
    vals = [x["rel_l2"] for r in reports for x in r["results"]
            if x["memory"] == memory and x["fraction_label"] == fraction_label]
    return mean(vals) if vals else None


def e2e_row(e2e: dict, memory: str, label: str, calibrated: bool, distilled: bool = False) -> dict | None:
    for r in e2e["results"]:
        if (r["memory"] == memory and r["fraction_label"] == label and r["calibrated"] == calibrated
                and bool(r.get("distilled")) == distilled):
            return r
    return None


def scalars(r: dict) -> str:
    """How a row's learned parameters were set: neutral, calibrated or distilled."""
    return "distilled" if r.get("distilled") else "calibrated" if r["calibrated"] else "neutral"


def distilled_table(e2e: dict, reports: list[dict]) -> str:
    """Per distill.py report: end-to-end perplexity, agreement and needles of the distilled memory beside the
    same memory neutral and calibrated and H2O and TOVA at the same budget (a dash where the run has no such
    row), and its training (stage 1: the mean over layers of the relative L2 error of the attention output on
    the training texts, the root of the layer's loss, before and after; KVPOP's scorers: the mean ranking loss;
    stage 2: the KL divergence per token)."""
    n = len(e2e["full"]["needle"])
    lines = ["| memory | budget | perplexity: neutral | calibrated | **distilled** | H2O | TOVA | agreement: distilled "
             f"| H2O | needles found (of {n}): distilled | H2O | stage 1: per-layer loss before -> after "
             "| stage 2: KL before -> after "
             "| training minutes |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|"]
    for d in reports:
        m, f = d["memory_id"], d["fraction"]
        row = next((r for r in e2e["results"] if r.get("distilled") and r["distilled"] == d["weights_sha256"][:16]), None)
        if row is None:
            continue
        base, cal, h2o = e2e_row(e2e, m, f, False), e2e_row(e2e, m, f, True), e2e_row(e2e, "h2o", f, False)
        tova = e2e_row(e2e, "tova", f, False)
        ppl = lambda r: f"{r['perplexity']:.2f}" if r else "—"  # noqa: E731
        agreement = lambda r: f"{r['agreement']:.3f}" if r else "—"  # noqa: E731
        found = lambda r: str(needle_found(r)) if r else "—"  # noqa: E731
        if not d["curves"]:
            stage1 = "its --init weights'"
        elif m == "kvpop":  # the ranking loss itself
            stage1 = f"ranking loss {mean(c[0] for c in d['curves']):.3f} -> {mean(c[-1] for c in d['curves']):.3f}"
        else:
            stage1 = (f"relative L2 error {mean(math.sqrt(c[0]) for c in d['curves']):.3f} -> "
                      f"{mean(math.sqrt(c[-1]) for c in d['curves']):.3f}")
        kl = f"{d['e2e_curve'][0]:.3f} -> {d['e2e_curve'][-1]:.3f}" if d.get("e2e_curve") else "not run"
        lines.append(f"| {row['label']} | {f} | {ppl(base)} | {ppl(cal)} | **{ppl(row)}** | {ppl(h2o)} | {ppl(tova)} | "
                     f"{agreement(row)} | {agreement(h2o)} | {found(row)} | {found(h2o)} | {stage1} | "
                     f"{kl} | {d['seconds'] / 60:.0f} |")
    return "\n".join(lines)


def needle_logprob(run: dict) -> float:
    """Mean over the needle cases of the log-probability of the answer's tokens (natural log)."""
    return mean(x["logprob"] for x in run["needle"])


def needle_found(run: dict) -> int:
    """Needle cases whose answer greedy decoding writes."""
    return sum(x["retrieved"] for x in run["needle"])


def e2e_table(e2e: dict) -> str:
    full = e2e["full"]
    n = len(full["needle"])
    lines = ["| memory | budget | scalars | held per kv-head and layer (tokens) | held MiB (all layers) | perplexity "
             f"| next-token agreement | needle found (of {n}) | needle mean log-prob |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|",
             f"| full KV cache | 1 | | {e2e['ppl_tokens']} | {full['kv_bytes'] / 1048576:.1f} | "
             f"{full['perplexity']:.2f} | 1.000 | {needle_found(full)} | {needle_logprob(full):.1f} |"]
    for r in e2e["results"]:
        lines.append(f"| {r['label']} | {r['fraction_label']} | {scalars(r)} | "
                     f"{r['held_tokens']} | {r['held_bytes'] / 1048576:.1f} | {r['perplexity']:.2f} | "
                     f"{r['agreement']:.3f} | {needle_found(r)} | {needle_logprob(r):.1f} |")
    return "\n".join(lines)


def calibrated_table(layers: list[dict], calibrated: list[dict]) -> str:
    lines = ["| memory | budget | neutral: rel. L2 (mean over layers) | calibrated | H2O at the same budget |",
             "|---|---|---:|---:|---:|"]
    seen = []
    for r in calibrated:
        for x in r["results"]:
            key = (x["memory"], x["label"], x["fraction_label"])
            if key not in seen:
                seen.append(key)
    for mid, label, f in seen:
        before, after, h2o = layer_mean(layers, mid, f), layer_mean(calibrated, mid, f), layer_mean(layers, "h2o", f)
        cell = lambda v: "" if v is None else f"{v:.3f}"  # noqa: E731
        lines.append(f"| {label} | {f} | {cell(before)} | {cell(after)} | {cell(h2o)} |")
    return "\n".join(lines)


def calibration_table(cal: dict) -> str:
    lines = ["| layer | attention on token 0 | its key norm / mean | KVM neutral | KVM, LN_s fitted | KVM calibrated "
             "| LN_s kept | tau_s (per query head) | OVQ neutral | OVQ calibrated | beta (min-max) |",
             "|---|---:|---:|---:|---:|---:|---|---|---:|---:|---|"]
    for layer, c in sorted(cal["layers"].items(), key=lambda kv: int(kv[0])):
        e = c["errors"]
        lines.append(f"| {layer} | {pct(c['sink']['attention_share'])} | {c['sink']['key_norm_ratio']:.2f} | "
                     f"{mean(e['kvm_before']):.3f} | {mean(e['kvm_ln_only']):.3f} | {mean(e['kvm_after']):.3f} | "
                     f"{c['ln_affine']} | {' '.join(f'{t:g}' for t in c['tau_state'])} | {mean(e['ovq_before']):.3f} | "
                     f"{mean(e['ovq_after']):.3f} | {min(c['beta']):.2f}-{max(c['beta']):.2f} |")
    tokens = next(iter(cal["layers"].values()))["tokens"]
    lines.append("")
    lines.append(f"Attention on token 0: the share of all attention weight (every query and query head) that the first "
                 f"token receives in exact attention; its key norm / mean: over the kv-heads. Errors: relative L2 error "
                 f"of the attention output (mean over the query heads) on the calibration text "
                 f"({tokens} tokens) at {cal['fraction']:g} of its cache; tau_s grid {list(cal['tau_grid'])}, "
                 f"beta = closed form x {list(cal['beta_grid'])}.")
    return "\n".join(lines)


def whole_table(whole: list[dict], layers: list[dict], calibrated: list[dict]) -> str:
    """Per layer: KVM with every token its own row (fraction 1, nothing merges), neutral and calibrated,
    beside KVM fixed at 1/8 (neutral, calibrated) and H2O at 1/8."""
    def err(reps, label, memory, fraction_label, cal):
        for r in reps:
            if r["label"] == label + (", calibrated" if cal else ""):
                for x in r["results"]:
                    if x["memory"] == memory and x["fraction_label"] == fraction_label:
                        return f"{x['rel_l2']:.3f}"
        return ""
    lines = ["| layer | KVM, every token a row: neutral | calibrated | KVM fixed 1/8: neutral | calibrated | H2O 1/8 |",
             "|---|---:|---:|---:|---:|---:|"]
    for rep in layers:
        label = rep["label"]
        lines.append(f"| {label} | {err(whole, label, 'kvm-fixed', '1', False)} | {err(whole, label, 'kvm-fixed', '1', True)} | "
                     f"{err(layers, label, 'kvm-fixed', '1/8', False)} | {err(calibrated, label, 'kvm-fixed', '1/8', True)} | "
                     f"{err(layers, label, 'h2o', '1/8', False)} |")
    return "\n".join(lines)


def headline(e2e: dict, layers: list[dict], calibrated: list[dict]) -> str:
    labels = [r["fraction_label"] for r in e2e["results"]]
    out, f = [], "1/8" if "1/8" in labels else (labels[0] if labels else "1/8")
    full = e2e["full"]
    out.append(f"- Full KV cache: perplexity {full['perplexity']:.2f} on {e2e['ppl_tokens']} tokens, needle found "
               f"in {needle_found(full)} of {len(full['needle'])} cases (mean log-probability of the answer "
               f"{needle_logprob(full):.1f}).")
    best = sorted((r for r in e2e["results"] if r["fraction_label"] == f), key=lambda r: r["perplexity"])
    if best:
        out.append(f"- At {f} of the cache, end to end, by perplexity: " + "; ".join(
            f"{r['label']}{'' if scalars(r) == 'neutral' else f' ({scalars(r)})'} {r['perplexity']:.2f} "
            f"(agreement {r['agreement']:.2f}, needle {needle_found(r)} of {len(r['needle'])}, "
            f"log-prob {needle_logprob(r):.1f})"
            for r in best) + ".")
    kvm_cal, h2o = e2e_row(e2e, "kvm-fixed", f, True), e2e_row(e2e, "h2o", f, False)
    lk, lh = layer_mean(calibrated, "kvm-fixed", f), layer_mean(layers, "h2o", f)
    if kvm_cal and h2o and lk is not None and lh is not None:
        met = kvm_cal["perplexity"] < h2o["perplexity"] and lk < lh
        out.append(f"- Target (calibrated KVM fixed at {f} below H2O at {f} in per-layer error and perplexity): "
                   f"{'met' if met else 'not met'}: per-layer error {lk:.3f} against {lh:.3f}, perplexity "
                   f"{kvm_cal['perplexity']:.2f} against {h2o['perplexity']:.2f}.")
    return "\n".join(out)


#: the layers held_out_table shows one by one (those of a 30-layer model; a smaller one shows its own)
HELD_OUT_LAYERS = (0, 3, 6, 9, 12, 15, 18, 21, 24, 27, 29)


def held_out_table(reports: list[dict]) -> str:
    """tools/distill/held_out.py's rows of one or more reports on the same held-out text and model (a row
    of a later report replaces an earlier one of the same memory, fraction and weights): each memory's
    relative L2 error per layer (the layers of HELD_OUT_LAYERS the model has, then the mean over all its
    layers), with how its parameters were set (neutral, or distilled: its training stages and the weights
    file's SHA-256 prefix; training-free memories have none). Raises ValueError naming the report whose
    text, tokens or layers differ from the first's."""
    first = reports[0]
    rows: dict[tuple, dict] = {}
    for rep in reports:
        for key in ("text", "tokens", "layers"):
            if rep[key] != first[key]:
                raise ValueError(f"--held-out: reports of different {key} ({rep[key]!r} and {first[key]!r})")
        for r in rep["rows"]:
            rows[(r["memory"], r["fraction_label"], r["distilled"])] = r
    order = sorted(rows.values(), key=lambda r: (-r["fraction"], bool(r["distilled"]), r["memory"] != "kvm-fixed"))
    shown = [i for i in HELD_OUT_LAYERS if i < first["layers"]]
    lines = ["| memory | budget | parameters | " + " | ".join(f"layer {i}" for i in shown) +
             f" | **mean of {first['layers']}** |", "|---|---|---|" + "---:|" * (len(shown) + 1)]
    for r in order:
        params = (f"distilled, stage {r['stages']} ({r['distilled'][:8]})" if r["distilled"] else
                  "neutral" if r["memory"] in ("kvm-fixed", "kvm-sqrt", "ovq") else "—")
        lines.append(f"| {r['label']} | {r['fraction_label']} | {params} | " +
                     " | ".join(f"{r['errors'][i]:.3f}" for i in shown) + f" | **{r['mean']:.3f}** |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--doc", required=True)
    ap.add_argument("--e2e", required=True)
    ap.add_argument("--calibration", required=True)
    ap.add_argument("--layers", nargs="+", required=True)
    ap.add_argument("--calibrated", nargs="+", required=True)
    ap.add_argument("--whole", nargs="*", default=[], help="kvmem-eval reports of KVM fixed at fraction 1")
    ap.add_argument("--distilled", nargs="*", default=[], help="tools/distill/distill.py reports (--report)")
    ap.add_argument("--held-out", nargs="*", default=[], help="tools/distill/held_out.py's reports (one or more runs)")
    ap.add_argument("--after-prompt", default=None, help="after_prompt.py's report (needles decoded after the prompt)")
    ap.add_argument("--continuation", default=None, help="continuation.py's report")
    a = ap.parse_args()
    e2e, cal = load(a.e2e), load(a.calibration)
    layers, calibrated = [load(p) for p in a.layers], [load(p) for p in a.calibrated]
    blocks = {"lm-headline": headline(e2e, layers, calibrated), "lm-e2e-table": e2e_table(e2e),
              "lm-layers-calibrated": calibrated_table(layers, calibrated),
              "lm-calibration-table": calibration_table(cal)}
    if a.whole:
        blocks["lm-kvm-whole"] = whole_table([load(p) for p in a.whole], layers, calibrated)
    if a.distilled:
        blocks["lm-distilled"] = distilled_table(e2e, [load(p) for p in a.distilled])
    if a.held_out:
        blocks["lm-distilled-layers"] = held_out_table([load(p) for p in a.held_out])
    if a.after_prompt:
        import after_prompt

        blocks["lm-after-prompt"] = after_prompt.markdown(load(a.after_prompt)).rstrip("\n")
    if a.continuation:
        import continuation

        blocks["lm-continuation"] = continuation.markdown(load(a.continuation)).rstrip("\n")
    fill(a.doc, blocks)


if __name__ == "__main__":
    main()
