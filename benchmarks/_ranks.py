"""Forked gloo ranks for the multi-process benchmarks: start, join, one result back.

A benchmark writes ``_worker(rank, world, store_path, cfg, queue)``, calls :func:`init_rank`
first thing in it and puts one result on ``queue`` from rank 0; :func:`run_ranks` forks the
ranks, waits for that result and checks every rank's exit code. :func:`rotated` is the
round-robin order the benchmarks step their modes in, so that load changes on a shared
machine hit every mode alike. This module measures nothing itself.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

T = TypeVar("T")


def init_rank(rank: int, world: int, store_path: str, timeout_s: float) -> None:
    """One thread per rank and a gloo group over a FileStore (collectives time out after ``timeout_s``)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )


def run_ranks(
    worker: Callable[..., None], world: int, cfg: Any, *, timeout_s: float, join_s: float = 120
) -> Any:
    """Fork ``world`` ranks of ``worker(rank, world, store_path, cfg, queue)``; return what rank 0 puts."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=worker, args=(r, world, os.path.join(tmp, "store"), cfg, queue))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        out = queue.get(timeout=timeout_s)
        for p in procs:
            p.join(timeout=join_s)
            if p.exitcode not in (0, None):
                raise RuntimeError(f"a benchmark rank exited with {p.exitcode}")
    return out


def rotated(names: Sequence[T], step: int) -> list[T]:
    """``names`` rotated left by ``step``: who goes first changes every step."""
    k = step % len(names)
    return [*names[k:], *names[:k]]


def machine_line() -> str:
    """The torch version, backend, CPU count and thread setting every benchmark prints first."""
    return (
        f"torch {torch.__version__}, gloo, {os.cpu_count()} CPUs, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}"
    )
