"""The checks of the examples that scripts/test runs can fail: the serving check
(examples/python/serving.py --check) finds a request whose tokens in the shared batch are not its tokens
alone (here: a memory whose reset_sequence forgets nothing, so a slot's next request reads the previous
one's rows), and the tensor-parallel check (examples/python/tensor_parallel.py --compare) refuses an
unsharded run, a run of one rank, other tokens, logits cut short, NaN logits and a missing prompt."""

import copy
import os
import random
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tqdm")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples", "python"))
import serving  # noqa: E402
import tensor_parallel  # noqa: E402

import kvmem.transformers as kt  # noqa: E402


def requests(count=5, seed=3):
    """Requests of 12 to 40 prompt tokens (ids 3..95) and 3 to 6 output tokens, arriving together."""
    rng = random.Random(seed)
    return [{"id": i, "arrival": 0.0, "prompt": [rng.randint(3, 95) for _ in range(rng.randint(12, 40))],
             "output": rng.randint(3, 6)} for i in range(count)]


class Leaky:
    """A memory whose reset_sequence keeps the slot's rows: the defect the serving check must catch."""

    def __init__(self, memory):
        self.memory = memory

    def reset_sequence(self, b):
        pass

    def __getattr__(self, name):
        return getattr(self.memory, name)


def serve_and_check(model, factory, wrap=lambda m: m, slots=2, chunk=8):
    shape = dict(head_dim=16, query_heads=4, kv_heads=2, value_dim=16, batch=slots, dtype=torch.float32)
    reqs = requests()
    mems = [wrap(factory(i, **shape)) for i in range(model.config.num_hidden_layers)]
    run = serving.serve(model, mems, copy.deepcopy(reqs), slots, chunk, "batch", progress=False)
    return serving.diverging(run, serving.served_alone(model, reqs, factory, shape, chunk))


def test_serving_check_passes_a_memory_that_keeps_requests_apart(model):
    assert serve_and_check(model, kt.eviction("h2o", sinks=2, window=4, top_k=6)) == []


def test_serving_check_fails_a_memory_that_leaks_between_requests(model):
    """Five requests on two slots: three reuse a slot, and with reset_sequence a no-op they read what the
    slot's previous request left, so their tokens differ from their tokens alone."""
    found = serve_and_check(model, kt.eviction("h2o", sinks=2, window=4, top_k=6), wrap=Leaky)
    assert found, "the serving check passed a memory that leaks rows between requests"


def test_serving_check_reports_a_missing_request():
    run = {"requests": [{"id": 0, "tokens": [5, 6]}]}
    assert serving.diverging(run, {0: [5, 6], 1: [7]}) == [1]
    assert serving.diverging(run, {0: [5, 7]}) == [0]


def tp_run(world, kv_heads, tokens=(4, 5, 6), logits=((0.0, 1.0), (1.0, 2.0), (2.0, 0.5)), prompts=1):
    return {"world_size": world, "memory": "h2o", "top_k": 96,
            "results": [{"prompt_tokens": 30, "tokens": list(tokens), "logits": [list(r) for r in logits],
                         "kv_heads_per_rank": [kv_heads], "text": ""} for _ in range(prompts)]}


def test_tensor_parallel_compare_passes_a_sharded_run():
    found, worst = tensor_parallel.problems(tp_run(1, 3), tp_run(3, 1, logits=((0.0, 1.0005), (1.0, 2.0), (2.0, 0.5))), 1e-3)
    assert found == [] and worst == pytest.approx(5e-4, abs=1e-6)


@pytest.mark.parametrize("tp, what", [
    (tp_run(3, 3), "kv-heads per rank [3]"),                       # unsharded: every rank held all kv-heads
    (tp_run(1, 3), "world_size 1: not sharded"),                   # one rank
    (tp_run(3, 1, tokens=(4, 5, 7)), "the tokens differ"),
    (tp_run(3, 1, logits=((0.0, 1.0), (1.0, 2.0))), "logits of shape [3, 2] against [2, 2]"),  # cut short
    (tp_run(3, 1, logits=((0.0, float("nan")), (1.0, 2.0), (2.0, 0.5))), "largest logit difference nan"),
    (tp_run(3, 1, logits=((0.0, 1.1), (1.0, 2.0), (2.0, 0.5))), "largest logit difference 1.00e-01"),
    (tp_run(3, 1, prompts=2), "1 prompts against 2"),
], ids=["unsharded", "one-rank", "tokens", "cut-short", "nan", "far", "prompts"])
def test_tensor_parallel_compare_fails(tp, what):
    found, _ = tensor_parallel.problems(tp_run(1, 3), tp, 1e-3)
    assert any(what in line for line in found), found
