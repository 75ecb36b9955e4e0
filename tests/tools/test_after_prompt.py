"""Tests of what tools/fidelity reads after a prompt: after_prompt.py (needles decoded after the prompt),
kvpress_presses.py (kvpress 0.5.5 beside kvmem, with what was adapted to this transformers), the sizes of the
compressing memories (lm_memories.py) and parallel_runs.py. A tiny Llama with random weights stands in for
SmolLM2 (no download); every check compares with the model's own attention or a small obvious computation.
Runs with pytest where kvmem and kvpress are installed (CTest fidelity.after_prompt; scripts/test installs
kvpress with scripts/lib/env.sh kvmem_kvpress_install).
"""
from __future__ import annotations

import sys

import pytest
import torch

import after_prompt  # noqa: E402
import continuation  # noqa: E402
import kvpress_presses  # noqa: E402
import lm_memories  # noqa: E402
import parallel_runs  # noqa: E402


@pytest.fixture(scope="module")
def model(tiny):
    """conftest's tiny Llama, read with SDPA."""
    tiny.set_attn_implementation("sdpa")
    return tiny


def case(T: int, prompt: int, seed: int) -> dict:
    """A needle case of T random tokens whose first `prompt` are the prompt and last 3 the answer."""
    ids = torch.randint(0, 97, (1, T), generator=torch.Generator().manual_seed(seed))
    return {"haystack": 0, "fact": "f", "depth": 0.5, "answer": "x", "ids": ids, "prompt": prompt,
            "positions": list(range(T - 4, T - 1)), "answer_ids": ids[0, T - 3:].tolist()}


def job(kind: str, name: str, fraction: float, cases: list[dict]) -> dict:
    return {"kind": kind, "name": name, "label": name, "fraction_label": str(fraction), "fraction": fraction,
            "cases": cases}


def test_a_memory_that_holds_everything_decodes_the_model_after_the_prompt(model):
    """A prompt-end or per-chunk memory whose budget holds every token gives the full cache's logits at every
    position after the prompt, so it finds what the full cache finds with the same log-probability."""
    cases = [case(100, 90, 1), case(120, 100, 2)]
    full = after_prompt.run(model, None, job("full", "full", 1.0, cases))
    for memory in ("snapkv-end", "h2o-chunk", "h2o"):
        got = after_prompt.run(model, None, job("kvmem", memory, 1.4, cases))  # 1.4 x the prompt: every token
        assert got["found"] == full["found"] and got["cases"] == 2
        assert got["logprob_mean"] == pytest.approx(full["logprob_mean"], abs=1e-3)


def test_a_small_memory_after_the_prompt_is_not_the_model(model):
    """At 1/4 of the prompt the decoded positions read a compressed cache: their logits differ from the model's,
    the prompt's last position does not (the prefill attends the whole prompt exactly)."""
    c = case(100, 90, 3)
    with torch.no_grad():
        own = model(c["ids"]).logits[0, 89:]
    got, sizes = after_prompt.case_logits(model, None, c, "kvmem", "snapkv-end", 0.25)
    torch.testing.assert_close(got[0], own[0], rtol=1e-4, atol=1e-5)
    assert (got[1:] - own[1:]).abs().max() > 1e-3
    assert sizes == {"held_tokens": 22, "peak_tokens": 91, "held_bytes": sizes["held_bytes"]}
    assert sizes["held_bytes"] > 0


def test_kvpress_at_this_transformers(model):
    """kvpress 0.5.5 through kvpress_presses: without a press its loop is the model's own forward; a press
    compresses each layer to kept_tokens at the end of the prefill (the adapted hook fires) and the decoded
    positions then differ from the model's; decode steps do not compress again."""
    ids = torch.randint(0, 97, (1, 110), generator=torch.Generator().manual_seed(4))
    assert kvpress_presses.full_cache_check(model, ids, 100) < 1e-4
    from transformers import DynamicCache

    for press_id in ("kvpress-snapkv", "kvpress-knorm", "kvpress-streaming", "kvpress-tova"):
        press = kvpress_presses.make(press_id, 0.25, model, None)
        cache = DynamicCache()
        with torch.no_grad(), press(model):
            model(input_ids=ids[:, :100], past_key_values=cache, use_cache=True)
            kept = kvpress_presses.kept_tokens(100, 0.25)
            assert kept == 25
            assert all(layer.keys.shape[-2] == kept for layer in cache.layers), press_id
            model(ids[:, 100:101], past_key_values=cache, use_cache=True, position_ids=torch.tensor([[100]]))
            assert all(layer.keys.shape[-2] == kept + 1 for layer in cache.layers), press_id
        got = kvpress_presses.prefill_decode(model, ids, 100, kvpress_presses.make(press_id, 0.25, model, None))
        with torch.no_grad():
            own = model(ids).logits[0, 99:]
        assert got.shape == own.shape
        assert (got[1:] - own[1:]).abs().max() > 1e-3, press_id
    assert kvpress_presses.installed_versions()["kvpress"] == kvpress_presses.KVPRESS_VERSION
    # what kvpress's own __init__ does besides importing the presses: head-wise masking in the attention
    # functions (KVzip's per-head budgets), applied once
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert ALL_ATTENTION_FUNCTIONS["sdpa"].__qualname__ == "attention_patch.<locals>.wrapper"
    kvpress_presses.load()
    assert ALL_ATTENTION_FUNCTIONS["sdpa"].__closure__[0].cell_contents.__qualname__ != "attention_patch.<locals>.wrapper"


def test_kvpress_rows_and_errors(model):
    with pytest.raises(ValueError, match="press = 'kvpress-lru': unknown"):
        kvpress_presses.make("kvpress-lru", 0.25, model, None)
    with pytest.raises(ValueError, match="fraction = 1.0: must be in"):
        kvpress_presses.make("kvpress-snapkv", 1.0, model, None)
    r = after_prompt.run(model, None, job("kvpress", "kvpress-knorm", 0.25, [case(100, 90, 5)]))
    assert r["held_tokens_mean"] == 22 and r["peak_tokens_mean"] == 90 and r["cases"] == 1


def test_sizes_of_the_compressing_memories():
    """Peak held tokens: the prompt and one token at the prompt's end, the budget and a chunk per chunk, the
    budget when streaming; the observation window never longer than a quarter of the prompt or the chunk."""
    assert lm_memories.held_tokens("snapkv-end", 1536, 0.25) == 384
    assert lm_memories.peak_tokens("snapkv-end", 1536, 0.25) == 1537
    assert lm_memories.chunk_tokens(1536) == 192
    assert lm_memories.peak_tokens("snapkv-chunk", 1536, 0.25) == 384 + 192  # 3/8 of the prompt
    assert lm_memories.peak_tokens("h2o", 1536, 0.25) == 384
    assert lm_memories.observation_tokens(1536) == 64 and lm_memories.observation_tokens(40) == 10
    assert lm_memories.observation_tokens(3) == 1


def test_tables():
    ap = {"prompt_tokens_mean": 100.0, "full": {"found": 3, "cases": 4},
          "results": [{"kind": "kvmem", "memory": "snapkv-end", "label": "SnapKV at prompt end", "fraction_label": "1/4",
                       "found": 2, "cases": 4, "peak_tokens_mean": 101.0},
                      {"kind": "kvmem", "memory": "snapkv-chunk", "label": "SnapKV per chunk", "fraction_label": "1/4",
                       "found": 1, "cases": 4, "peak_tokens_mean": 37.5},
                      {"kind": "kvpress", "memory": "kvpress-snapkv", "label": "kvpress SnapKV", "fraction_label": "1/4",
                       "found": 3, "cases": 4, "peak_tokens_mean": 100.0}]}
    table = after_prompt.markdown(ap)
    assert "| full KV cache | never | 3 of 4 (1) |" in table
    assert "| SnapKV at prompt end | prompt end (chunk 0) | 2 of 4 (1.01) |" in table
    assert "| SnapKV per chunk | per chunk of 0.125 of the prompt | 1 of 4 (0.38) |" in table
    assert "| kvpress SnapKV | prompt end (kvpress) | 3 of 4 (1.00) |" in table
    cont = {"full": {"perplexity": 9.0},
            "results": [{"kind": "kvpress", "memory": "kvpress-tova", "label": "kvpress TOVA", "fraction_label": "1/8",
                         "perplexity": 10.25, "agreement": 0.75}]}
    assert "| kvpress TOVA | prompt end (kvpress) | 10.25 (75 %) |" in continuation.markdown(cont)


def test_parallel_runs_keep_the_order(tmp_path):
    """Two worker processes give the jobs' results in the jobs' order, as one process does."""
    (tmp_path / "double_tool.py").write_text(
        "import os\n"
        "def load(model_name, dtype):\n    return model_name, dtype\n"
        "def run(model, tok, job):\n    return (job['x'] * 2, model, tok, os.environ.get('OMP_NUM_THREADS'))\n")
    sys.path.insert(0, str(tmp_path))
    try:
        jobs = [{"x": i, "describe": f"job {i}"} for i in range(5)]
        seen = []
        one = parallel_runs.map_jobs("double_tool", "m", "float32", jobs, 1, seen.append)
        two = parallel_runs.map_jobs("double_tool", "m", "float32", jobs, 2)
    finally:
        sys.path.remove(str(tmp_path))
    assert [r[0] for r in one] == [r[0] for r in two] == [0, 2, 4, 6, 8]
    assert all(r[1:3] == ("m", "float32") for r in one + two)
    assert all(r[3] == "1" for r in two)  # one OpenMP thread per worker
    assert seen == [f"job {i}" for i in range(5)]
    with pytest.raises(ValueError, match="--jobs 0"):
        parallel_runs.map_jobs("double_tool", "m", "float32", jobs, 0)


def test_after_prompt_errors(tmp_path, capsys):
    out = str(tmp_path / "a.json")
    assert after_prompt.main(["--output", out, "--haystack", "x", "--memories", "nope"]) == 2
    assert "--memories: 'nope' unknown" in capsys.readouterr().err
    assert after_prompt.main(["--output", out, "--haystack", "x", "--presses", "kvpress-nope"]) == 2
    assert "--presses: 'kvpress-nope' unknown" in capsys.readouterr().err
    assert after_prompt.main(["--output", out, "--haystack", "x", "--jobs", "0", "--presses", ""]) == 2
    assert "--jobs 0" in capsys.readouterr().err
    assert continuation.main(["--output", out, "--text", "x", "--presses", "kvpress-nope"]) == 2
    assert "--presses: 'kvpress-nope' unknown" in capsys.readouterr().err
