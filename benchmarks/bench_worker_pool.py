"""Cost of the multi-process test worker pool (tests/support/dist.py).

Measures, for 2, 4 and 8 gloo ranks on this machine: the start-up of a pool
(fork + FileStore rendezvous + process group), the per-call overhead of an
empty test body, and of a body that runs one small all-reduce. Compared with
the cost of starting the same ranks with the ``spawn`` start method, which is
what a per-test ``torch.multiprocessing.spawn`` harness pays.

Run: OMP_NUM_THREADS=1 python benchmarks/bench_worker_pool.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.support.dist import WorkerPool  # noqa: E402


def _noop() -> int:
    return 0


def _allreduce() -> float:
    t = torch.ones(1024)
    dist.all_reduce(t)
    return float(t[0])


def _spawn_body(rank: int, world_size: int, path: str) -> None:
    import datetime

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(path, world_size),
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    dist.barrier()
    dist.destroy_process_group()


def spawn_startup(world_size: int) -> float:
    import tempfile

    import torch.multiprocessing as tmp

    with tempfile.TemporaryDirectory() as d:
        start = time.perf_counter()
        tmp.spawn(_spawn_body, args=(world_size, os.path.join(d, "store")), nprocs=world_size)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    calls = 20 if args.quick else 100
    rows = []
    for world_size in (2, 4, 8):
        start = time.perf_counter()
        pool = WorkerPool(world_size)
        startup = time.perf_counter() - start
        pool.run(_noop)  # warm
        noop = []
        for _ in range(calls):
            t0 = time.perf_counter()
            pool.run(_noop)
            noop.append(time.perf_counter() - t0)
        ar = []
        for _ in range(calls):
            t0 = time.perf_counter()
            pool.run(_allreduce)
            ar.append(time.perf_counter() - t0)
        pool.close()
        spawn = spawn_startup(world_size)
        rows.append((world_size, startup, statistics.median(noop), statistics.median(ar), spawn))
    print(f"worker pool on {os.cpu_count()} cores, torch {torch.__version__}, {calls} calls each")
    print(
        "| ranks | pool start-up (fork) | empty body / call | body with all-reduce / call | spawn start-up | spawn / fork start-up |"
    )
    print("|---|---|---|---|---|---|")
    for ws, startup, noop, ar, spawn in rows:
        print(
            f"| {ws} | {startup:.3f} s | {noop * 1e3:.2f} ms | {ar * 1e3:.2f} ms | {spawn:.2f} s | {spawn / startup:.0f}x |"
        )


if __name__ == "__main__":
    main()
