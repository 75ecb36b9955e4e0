"""kvmem under a real tensor-parallel runtime: SmolLM2-135M-Instruct with transformers' tensor parallelism
(tp_plan="auto"), launched by torchrun, each rank holding the kvmem memories of its own kv-heads through
KvmemCache; greedy generation must give the one-process run's tokens, and the logits must agree within
--tolerance (docs/tensor-parallel.md).

    python examples/python/tensor_parallel.py --json one.json                       # one process
    torchrun --nproc-per-node 3 examples/python/tensor_parallel.py --json tp.json   # 3 ranks (gloo on CPU)
    python examples/python/tensor_parallel.py --nproc 3 --json tp.json              # the same, without torchrun
    python examples/python/tensor_parallel.py --compare one.json tp.json            # same tokens, close logits

--nproc N starts the N ranks with torch.multiprocessing.spawn and the environment torchrun gives them
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): torchrun's rendezvous store needs a PyTorch built
with libuv, which Debian's is not ("use_libuv was requested but PyTorch was built without libuv support"),
while the process group's own env:// rendezvous takes USE_LIBUV=0.

SmolLM2 has 9 query heads and 3 kv-heads, so 3 ranks each get 3 query heads and 1 kv-head (and a third of
every MLP); transformers shards the projections (colwise q/k/v, rowwise o) and all-reduces after o_proj and
the MLP's down_proj. kvmem sees a layer whose kv_heads is 1 on each rank: a memory needs nothing else,
since heads are independent. On CPU the ranks talk over gloo; on GPUs torchrun with NCCL (one GPU per
rank) is the same command. The memory: H2O eviction (4 sinks, a window of 32, --top-k retained) unless
--memory says kvm, proportional or streaming; prompts of about 300 tokens so that it evicts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import kvmem
import kvmem.transformers as kt

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "..", "tools", "capture"))
sys.path.insert(0, here)
import smollm2  # noqa: E402
from generate import CONTEXT, QUESTION  # noqa: E402

PROMPTS = [CONTEXT[:1400] + "\n\n" + QUESTION,
           CONTEXT[600:] + "\n\nIn the text above, how often do trains reach Velmora, and at what times?"]


def factory(name: str, top_k: int):
    if name == "h2o":
        return kt.eviction("h2o", sinks=4, window=32, top_k=top_k)
    if name == "streaming":
        return kt.eviction("streaming", sinks=4, window=32, top_k=top_k)
    if name == "kvm":
        return kt.kvm(chunk=16, window_chunks=2, sinks=1, max_rows=top_k, budget=kvmem.budget.Fixed(top_k))
    if name == "proportional":
        return kt.proportional(chunk=16, window_chunks=2, sinks=1, max_rows=top_k, budget=kvmem.budget.Fixed(top_k))
    raise ValueError(f"--memory = {name}: expected h2o, streaming, kvm or proportional")


def run(args):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    cache_dir = os.environ.get("KVMEM_MODEL_CACHE", "/var/cache/kvmem/models/smollm2-135m-f32")
    if not os.path.exists(os.path.join(cache_dir, "config.json")):
        smollm2.load(cache_dir)  # converts the GGUF once (one process)
    kwargs = {"tp_plan": "auto"} if distributed else {}
    model = AutoModelForCausalLM.from_pretrained(cache_dir, dtype=torch.float32, **kwargs).eval()
    tok = AutoTokenizer.from_pretrained(cache_dir)
    rank = int(os.environ.get("RANK", "0"))
    results = []
    for prompt in PROMPTS[:args.prompts]:
        enc = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)
        cache = kt.KvmemCache(model, factory(args.memory, args.top_k))
        with torch.no_grad():
            out = model.generate(enc["input_ids"], attention_mask=enc["attention_mask"], past_key_values=cache,
                                 max_new_tokens=args.new_tokens, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
        kv_heads = {layer.memory.kv_heads for layer in cache.layers if layer.memory is not None}
        results.append({"prompt_tokens": enc["input_ids"].shape[1],
                        "tokens": out.sequences[0, enc["input_ids"].shape[1]:].tolist(),
                        "logits": torch.stack(out.logits)[:, 0].tolist(), "kv_heads_per_rank": sorted(kv_heads),
                        "text": tok.decode(out.sequences[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)})
    if rank == 0:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        with open(args.json, "w") as f:
            json.dump({"world_size": world, "memory": args.memory, "top_k": args.top_k, "results": results}, f)
        for r in results:
            print(f"ranks {world}, kv-heads per rank {r['kv_heads_per_rank']}, prompt {r['prompt_tokens']} tokens: "
                  f"{r['text']!r}")
    if distributed:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def spawned(local_rank, nproc, port, args):
    """A rank started by --nproc: torchrun's environment, then the run."""
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), USE_LIBUV="0", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    run(args)


def problems(one: dict, tp: dict, tolerance: float) -> tuple[list[str], float]:
    """What keeps a tensor-parallel run ``tp`` from matching the one-process run ``one`` (both this script's
    JSON): a ``tp`` of one rank or ``one`` of several; a ``tp`` whose ranks did not each hold their share of
    the kv-heads (one process's kv-heads / ranks: an unsharded run holds them all); other prompts, other
    tokens, logits of another shape (nothing is cut to the shorter) or farther apart than ``tolerance``.
    Returns (the problems, empty when none; the largest absolute logit difference)."""
    found, worst = [], 0.0
    ranks = tp["world_size"]
    if one["world_size"] != 1:
        found.append(f"the one-process run has world_size {one['world_size']}")
    if ranks < 2:
        found.append(f"the tensor-parallel run has world_size {ranks}: not sharded")
    if len(one["results"]) != len(tp["results"]):
        found.append(f"{len(one['results'])} prompts against {len(tp['results'])}")
    for i, (a, b) in enumerate(zip(one["results"], tp["results"])):
        heads = a["kv_heads_per_rank"]
        want = [heads[0] // ranks] if len(heads) == 1 and ranks >= 1 and heads[0] % ranks == 0 else None
        if want is None or b["kv_heads_per_rank"] != want:
            found.append(f"prompt {i}: kv-heads per rank {b['kv_heads_per_rank']} over {ranks} ranks, expected "
                         f"{want if want else 'an even share of ' + str(heads)}")
        if a["prompt_tokens"] != b["prompt_tokens"]:
            found.append(f"prompt {i}: {a['prompt_tokens']} prompt tokens against {b['prompt_tokens']}")
        if a["tokens"] != b["tokens"]:
            found.append(f"prompt {i}: the tokens differ")
        la, lb = torch.tensor(a["logits"]), torch.tensor(b["logits"])
        if la.shape != lb.shape:
            found.append(f"prompt {i}: logits of shape {list(la.shape)} against {list(lb.shape)}")
            continue
        diff = float((la - lb).abs().max()) if la.numel() else 0.0
        if diff != diff or diff > tolerance:  # NaN fails too
            found.append(f"prompt {i}: largest logit difference {diff:.2e} > {tolerance:g}")
        worst = max(worst, diff) if diff == diff else float("nan")
    return found, worst


def compare(one_path, tp_path, tolerance):
    one, tp = (json.load(open(p)) for p in (one_path, tp_path))
    found, worst = problems(one, tp, tolerance)
    print(f"{tp['world_size']} ranks against one process ({one['memory']}): "
          f"{'agree' if not found else 'DIFFER'}, largest logit difference {worst:.2e} (tolerance {tolerance:g})")
    for line in found:
        print(f"  {line}")
    if found:
        sys.exit(1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--memory", default="h2o")
    ap.add_argument("--top-k", type=int, default=96, help="retained rows (eviction) or state rows (merges)")
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), choices=range(1, len(PROMPTS) + 1),
                    help=f"how many of the {len(PROMPTS)} test prompts to run (default all)")
    ap.add_argument("--json", default="tensor-parallel.json")
    ap.add_argument("--nproc", type=int, default=1, help="start this many ranks without torchrun (see above)")
    ap.add_argument("--compare", nargs=2, metavar=("ONE", "TP"), help="compare two runs' JSON and exit")
    ap.add_argument("--tolerance", type=float, default=1e-3,
                    help="largest absolute logit difference allowed (default 1e-3; the all-reduces sum in another order)")
    args = ap.parse_args()
    if args.compare:
        compare(*args.compare, args.tolerance)
    elif args.nproc > 1:
        import socket

        with socket.socket() as sock:  # a free port for the process group's store
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        torch.multiprocessing.spawn(spawned, args=(args.nproc, port, args), nprocs=args.nproc)
    else:
        run(args)


if __name__ == "__main__":
    main()
