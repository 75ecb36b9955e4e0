"""Requests that come and go, from Python: every memory serves slots that requests take, prefill in one
call or in chunks interleaved with the other slots' decode steps, and free with reset_sequence(); each
request's outputs and final state equal, bit for bit, a batch-of-one memory that reads its whole prompt in
one prefill and then decodes (the C++ twin: tests/unit/test_lifecycle.cpp)."""

import random

import pytest
import torch

import kvmem

SLOTS, HQ, HKV, D, M = 3, 4, 2, 8, 4


def kvm(batch):
    return kvmem.KvmMemory(D, HQ, HKV, batch=batch, chunk=4, window_chunks=2, sinks=1, max_rows=64,
                           budget=kvmem.budget.PowerLaw(4, 2.0, 0.5))


def ovq(batch):
    return kvmem.OvqMemory(D, HQ, HKV, batch=batch, chunk=4, max_centroids=12)


def proportional(batch):
    return kvmem.ProportionalMemory(D, HQ, HKV, batch=batch, chunk=4, window_chunks=2, sinks=1, max_rows=64,
                                    budget=kvmem.budget.Fixed(12))


def h2o_merge(batch):
    return kvmem.EvictionMemory(D, HQ, HKV, batch=batch, scorer="h2o", sinks=2, window=6, top_k=8, merge_evicted=True)


def tova(batch):
    return kvmem.EvictionMemory(D, HQ, HKV, batch=batch, scorer="tova", sinks=1, window=4, top_k=6)


def trellis(batch):
    return kvmem.TrellisMemory(M, D, HKV, batch=batch, chunk=4)


#: (maker, multiple every prefill piece but a prompt's last must be: Trellis' chunk, else any)
FAMILIES = [(kvm, 1), (ovq, 1), (proportional, 1), (h2o_merge, 1), (tova, 1), (trellis, 4)]


def request_tokens(make, n, g):
    """One request's inputs [1, H, n, C] (and Trellis' extras) from generator g."""
    heads = HKV if make is trellis else HQ
    q, k, v = (torch.randn(1, h, n, D, generator=g) for h in (heads, HKV, HKV))
    if make is not trellis:
        return [q, k, v]
    alpha = torch.randn(1, HKV, n, M, generator=g)
    beta = lambda: 0.9 + 0.1 * torch.rand(1, HKV, n, generator=g)
    gamma = lambda: 0.1 * torch.rand(1, HKV, n, generator=g)
    return [q, k, v, alpha, beta(), gamma(), beta(), gamma()]


def state_of(memory, b):
    """Sequence b's counts and state (live rows, kept positions, or Trellis' matrices) as flat tensors."""
    s = memory.state()
    out = [torch.tensor([memory.tokens(b)], dtype=torch.float64)]
    if "m1" in s:
        return out + [s["m1"][b].flatten().double(), s["m2"][b].flatten().double()]
    if "kept_rows" in s:
        return out + [s["kept_rows"][b].flatten().double(), s["kept_positions"][b].flatten().double()]
    rows = s["rows"][b]
    return out + [torch.tensor([rows], dtype=torch.float64)] + [s[key][b, :, :rows].flatten().double()
                                                               for key in ("keys", "values")]


def batch_of(parts, slots):
    """The batch tensors of one call: parts[s] is slot s's tokens (a list like request_tokens') or None."""
    T = max(p[0].shape[2] for p in parts if p is not None)
    template = next(p for p in parts if p is not None)
    out = []
    for i, t in enumerate(template):
        x = torch.zeros((slots,) + t.shape[1:2] + (T,) + t.shape[3:])
        for s, p in enumerate(parts):
            if p is not None:
                x[s, :, :p[i].shape[2]] = p[i][0]
        out.append(x)
    return out


@pytest.mark.parametrize("make,multiple", FAMILIES, ids=[f.__name__ for f, _ in FAMILIES])
@pytest.mark.parametrize("seed", [1, 2])
def test_requests_that_come_and_go_are_served_as_alone(make, multiple, seed):
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    reqs = []
    for _ in range(7):
        prompt, output = rng.randint(1, 40), rng.randint(1, 15)
        reqs.append({"prompt": prompt, "output": output, "x": request_tokens(make, prompt + output, g),
                     "y": torch.zeros(1, HKV if make is trellis else HQ, prompt + output, D)})
    memory = make(SLOTS)
    holds, seen, used = [None] * SLOTS, [0] * SLOTS, [False] * SLOTS
    nxt, finished, chunked, reused = 0, 0, 0, 0
    while finished < len(reqs):
        for s in range(SLOTS):
            if holds[s] is None and nxt < len(reqs) and rng.random() < 0.6:
                reused += used[s]
                holds[s], seen[s], used[s], nxt = nxt, 0, True, nxt + 1
        piece = [0] * SLOTS
        for s in range(SLOTS):
            r = holds[s]
            if r is not None and seen[s] < reqs[r]["prompt"] and rng.random() < 0.7:
                left = reqs[r]["prompt"] - seen[s]
                piece[s] = multiple * rng.randint(1, (left - 1) // multiple) if left > multiple and rng.random() < 0.5 else left
                chunked += piece[s] < left
        if any(piece):
            parts = [None if not piece[s] else [x[:, :, seen[s]:seen[s] + piece[s]] for x in reqs[holds[s]]["x"]]
                     for s in range(SLOTS)]
            y = memory.prefill(*batch_of(parts, SLOTS), lengths=piece)
            for s in range(SLOTS):
                if piece[s]:
                    reqs[holds[s]]["y"][0, :, seen[s]:seen[s] + piece[s]] = y[s, :, :piece[s]]
                    seen[s] += piece[s]
            continue
        active = [holds[s] is not None and seen[s] >= reqs[holds[s]]["prompt"] for s in range(SLOTS)]
        if not any(active):
            continue
        parts = [[x[:, :, seen[s]:seen[s] + 1] for x in reqs[holds[s]]["x"]] if active[s] else None for s in range(SLOTS)]
        y = memory.decode(*batch_of(parts, SLOTS), active=active)
        for s in range(SLOTS):
            if active[s]:
                req = reqs[holds[s]]
                req["y"][0, :, seen[s]] = y[s, :, 0]
                seen[s] += 1
                if seen[s] == req["prompt"] + req["output"]:
                    req["state"] = state_of(memory, s)
                    memory.reset_sequence(s)
                    holds[s], finished = None, finished + 1
    assert chunked > 0 and reused > 0
    for req in reqs:
        alone, P = make(1), req["prompt"]
        ys = [alone.prefill(*[x[:, :, :P] for x in req["x"]])]
        ys += [alone.decode(*[x[:, :, t:t + 1] for x in req["x"]]) for t in range(P, P + req["output"])]
        torch.testing.assert_close(req["y"], torch.cat(ys, dim=2), rtol=0, atol=0)
        for got, want in zip(req["state"], state_of(alone, 0)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("make,multiple", FAMILIES, ids=[f.__name__ for f, _ in FAMILIES])
def test_reset_sequence_refuses_a_slot_out_of_range(make, multiple):
    memory = make(SLOTS)
    for b in (-1, SLOTS):
        with pytest.raises(ValueError, match=f"sequence = {b}"):
            memory.reset_sequence(b)


@pytest.mark.parametrize("make,multiple", FAMILIES, ids=[f.__name__ for f, _ in FAMILIES])
def test_strict_slots_refuse_a_busy_prefill_and_an_empty_chunk_or_step(make, multiple):
    """Under the strict slot protocol a prefill into a busy slot, an extend of an empty one and a decode
    step of an empty one raise ValueError naming the sequence, and change nothing; the calls that fit go
    through (the C++ twin: test_lifecycle.cpp, "the strict slot protocol ...")."""
    g = torch.Generator().manual_seed(3)
    P, C = 2 * multiple, multiple
    x = batch_of([request_tokens(make, P + C + 1, g), request_tokens(make, P + C + 1, g)], 2)
    at = lambda a, b: [t[:, :, a:b] for t in x]
    memory = make(2)
    assert not memory.strict_slots
    memory.strict_slots = True
    assert memory.strict_slots
    memory.prefill(*at(0, P), lengths=[P, 0])
    before = [state_of(memory, b) for b in (0, 1)]
    with pytest.raises(ValueError, match=f"prefill: sequence 0 = busy \\(holds {P} tokens\\)"):
        memory.prefill(*at(P, P + C), lengths=[C, 0])
    with pytest.raises(ValueError, match=r"extend: sequence 1 = empty \(holds no token\)"):
        memory.extend(*at(P, P + C), lengths=[C, C])
    with pytest.raises(ValueError, match=r"decode: sequence 1 = empty \(holds no token\)"):
        memory.decode(*at(P, P + 1))
    for b in (0, 1):
        for got, want in zip(state_of(memory, b), before[b]):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    memory.extend(*at(P, P + C), lengths=[C, 0])
    memory.prefill(*at(0, P), lengths=[0, P])
    memory.decode(*at(P + C, P + C + 1))
    assert (memory.tokens(0), memory.tokens(1)) == (P + C + 1, P + 1)
