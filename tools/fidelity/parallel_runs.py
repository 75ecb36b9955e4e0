"""Runs of a fidelity tool spread over worker processes, each with one thread: on a small model a decode step is
a few small matrix products, which two threads of one process run slower than one (measured on SmolLM2-135M
on two cores: 0.27 s a step with two threads, 0.07 s with one), so two processes of one thread each do the
work in about an eighth of the time of one process with two.

Each worker loads the model once (`load(model_name, dtype)` of the calling tool, by module and function
name, since workers are started fresh, not forked: torch's and OpenMP's thread pools do not survive a
fork) and then runs the tool's `run(model, tok, job)` for each job it is given. Results come back in the
jobs' order, so a report is the same whatever the number of workers.
"""
from __future__ import annotations

import importlib
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor

_state: dict = {}


def _init(module: str, paths: list[str], model_name: str, dtype: str) -> None:
    sys.path[:0] = [p for p in paths if p not in sys.path]
    import torch

    torch.set_num_threads(1)
    tool = importlib.import_module(module)
    _state["tool"] = tool
    _state["model"], _state["tok"] = tool.load(model_name, dtype)


def _run(job):
    return _state["tool"].run(_state["model"], _state["tok"], job)


def map_jobs(module: str, model_name: str, dtype: str, jobs: list, workers: int, progress=None) -> list:
    """[module.run(model, tok, job) for job in jobs], over `workers` processes of one thread each (1: in this
    process, with one thread). `progress(what)` is called as each job starts (in-process) or ends
    (workers), with the job's `describe` string when the job is a dict that has one."""
    if workers < 1:
        raise ValueError(f"--jobs {workers}: must be at least 1")
    if workers == 1:
        import torch

        torch.set_num_threads(1)
        tool = importlib.import_module(module)
        model, tok = tool.load(model_name, dtype)
        out = []
        for job in jobs:
            if progress:
                progress(job.get("describe", "") if isinstance(job, dict) else "")
            out.append(tool.run(model, tok, job))
        return out
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # kvmem's OpenMP threads in the workers, read when they start
    try:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_init,
                                 initargs=(module, list(sys.path), model_name, dtype)) as pool:
            futures = [pool.submit(_run, job) for job in jobs]
            out = []
            for job, fut in zip(jobs, futures):
                out.append(fut.result())
                if progress:
                    progress(job.get("describe", "") if isinstance(job, dict) else "")
            return out
    finally:
        if before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = before
