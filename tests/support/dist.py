"""A persistent pool of gloo worker processes for multi-rank tests.

A test body is a plain, module-level function; ``run_on_ranks(world_size, fn,
*args)`` runs ``fn(*args)`` on every rank of a pool of ``world_size`` forked
processes that share one gloo default process group, and returns the per-rank
results as a list (index = rank).

Why a pool: starting 8 torch processes and a process group costs seconds with
``spawn``; forking once per test session and reusing the processes makes a
4-rank test body cost milliseconds (see ``benchmarks/bench_worker_pool.py``).

Guarantees:
- workers are started with the ``fork`` start method, with
  ``OMP_NUM_THREADS=1`` and ``torch.set_num_threads(1)``;
- rendezvous goes through a ``FileStore`` in a fresh temporary directory (no
  port guessing);
- the default process group has a timeout (``PG_TIMEOUT_S``), and the parent
  waits at most ``timeout_s`` for a test body, so a hang becomes an error;
- a worker's exception is re-raised in the test with the worker's traceback and
  rank; after any failure the pool is torn down and rebuilt on next use, so
  one broken test cannot poison the next.

Not done here: GPU pools. Functions passed in must be picklable by reference
(module-level), and so must their arguments and results.
"""

from __future__ import annotations

import atexit
import gc
import multiprocessing as mp
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

PG_TIMEOUT_S = float(os.environ.get("MERAK_TEST_PG_TIMEOUT_S", "60"))
DEFAULT_TIMEOUT_S = float(os.environ.get("MERAK_TEST_TIMEOUT_S", "180"))
# How long the other ranks may still take once one rank has failed: long enough for a trivial body
# to return on a machine at load average 60 (3 s was not: a test saw rank 0 miss it), short against
# the process-group timeout that ranks stuck in a collective with the failed one would wait out.
ERROR_GRACE_S = 10.0
# Bodies a pool runs before it is replaced by a fresh one (0: never); see [Note: pool recycling].
RECYCLE_AFTER = int(os.environ.get("MERAK_TEST_POOL_RECYCLE", "40"))


class WorkerError(RuntimeError):
    """One or more ranks raised; the message holds every failing rank's traceback."""


def _worker_main(rank: int, world_size: int, store_path: str, conn: Connection) -> None:
    # Every object inherited from the parent (torch, transformers, the collected tests: ~400,000)
    # lives as long as the rank: frozen, no collection walks them again. Without it, the full
    # collection after each test body (``_release_groups``) walked them all: ~0.25 s of CPU per rank
    # and body, most of a small body's cost (40 small bodies on 4 ranks: 42 s of the ranks' CPU, 2 s
    # frozen), and wrote into every inherited page (copy-on-write). A body's own objects are
    # collected as before.
    gc.freeze()
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MERAK_TEST_RANK"] = str(rank)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=PG_TIMEOUT_S),
        )
        conn.send(("ready", None))
    except BaseException:  # noqa: BLE001 - report any start-up failure to the parent
        conn.send(("err", traceback.format_exc()))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        fn, args, kwargs = msg
        try:
            result = fn(*args, **kwargs)
            _release_groups(dist)
            conn.send(("ok", result))
        except BaseException:  # noqa: BLE001 - the test decides what is fatal
            conn.send(("err", traceback.format_exc()))
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort at shutdown
        pass


def _release_groups(dist: Any) -> None:
    """Destroy the process groups a test body created; the default group stays.

    Every Trainer or layout builds its own dp/tp/pp groups, and each gloo group keeps threads
    of its own: without this, hundreds of bodies leave thousands of live threads in the pool's
    workers (seen: about 1,000 in one worker, dozens of them busy), which slows every later test.
    Every rank runs the same bodies, so every rank destroys the same groups.
    """
    import gc

    gc.collect()
    world = dist.GroupMember.WORLD
    for group in list(dist.distributed_c10d._world.pg_map):
        if group is world:
            continue
        try:
            dist.destroy_process_group(group)
        except Exception:  # noqa: BLE001 - a group already broken by its body's failure
            pass


# Imported once in the parent before it forks, so that no rank of any pool pays for them again: a
# rank that imported merak-core (torch.distributed.checkpoint, torch.export and its sympy) itself
# spent ~5 s of CPU on it, each time a pool was started or rebuilt after a failing test. Modules
# that are not installed (a library's own session installs only that library) are skipped.
PRELOAD = (
    "torch.distributed.checkpoint",
    "torch.export",
    "merak_pipe",
    "merak_graph",
    "merak_tp",
    "merak_core",
    "merak_core.trainer",
)


_PRELOADED = False


def _preload() -> None:
    """Import ``PRELOAD`` and run one tiny ``torch.export`` (its first call imports and sets up more)."""
    global _PRELOADED
    if _PRELOADED:
        return
    _PRELOADED = True
    import importlib

    import torch

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    torch.export.export(torch.nn.Linear(2, 2), (torch.zeros(1, 2),))


class WorkerPool:
    """``world_size`` forked gloo ranks that run test bodies on request."""

    def __init__(self, world_size: int, *, start_timeout_s: float = 60.0) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.bodies = 0
        self._tmpdir = tempfile.mkdtemp(prefix=f"merak-pool{world_size}-")
        store_path = os.path.join(self._tmpdir, "store")
        _preload()
        ctx = mp.get_context("fork")
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        for rank in range(world_size):
            parent, child = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, world_size, store_path, child),
                daemon=True,
                name=f"merak-test-rank{rank}",
            )
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        replies = self._collect(start_timeout_s, what="process-group start-up")
        self._raise_on_errors(replies, what="process-group start-up")

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None, **kwargs: Any
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return results by rank."""
        timeout = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
        self.bodies += 1
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        replies = self._collect(timeout, what=getattr(fn, "__qualname__", repr(fn)))
        self._raise_on_errors(replies, what=getattr(fn, "__qualname__", repr(fn)))
        return [payload for _, payload in replies]

    def _collect(self, timeout_s: float, *, what: str) -> list[tuple[str, Any]]:
        deadline = time.monotonic() + timeout_s
        waited = f"within {timeout_s:.0f} s"
        replies: dict[int, tuple[str, Any]] = {}
        pending = {conn: rank for rank, conn in enumerate(self._conns)}
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            ready = wait(list(pending), timeout=min(remaining, 1.0))
            for conn in ready:
                rank = pending.pop(conn)  # type: ignore[call-overload]
                try:
                    replies[rank] = conn.recv()  # type: ignore[union-attr]
                except EOFError:
                    self._procs[rank].join(timeout=2.0)  # let the exit code settle
                    code = self._procs[rank].exitcode
                    replies[rank] = ("err", f"rank {rank} died (exit code {code})")
                if replies[rank][0] == "err":
                    # The other ranks may now wait in a collective for the failed one:
                    # give them a short grace period, not the whole timeout.
                    if time.monotonic() + ERROR_GRACE_S < deadline:
                        deadline = time.monotonic() + ERROR_GRACE_S
                        waited = f"within {ERROR_GRACE_S:.0f} s of rank {rank}'s error"
            # A dead rank with nothing to say would otherwise cost the whole timeout.
            for conn, rank in list(pending.items()):
                if not self._procs[rank].is_alive() and not conn.poll():
                    pending.pop(conn)
                    code = self._procs[rank].exitcode
                    replies[rank] = ("err", f"rank {rank} died (exit code {code})")
        if pending:
            missing = sorted(pending.values())
            others = {r: v for r, v in replies.items() if v[0] == "err"}
            detail = "".join(f"\n--- rank {r} ---\n{tb}" for r, (_, tb) in sorted(others.items()))
            raise WorkerError(
                f"{what}: ranks {missing} of {self.world_size} did not answer {waited} "
                f"(a hang or deadlock); the pool will be rebuilt.{detail}"
            )
        return [replies[r] for r in range(self.world_size)]

    def _raise_on_errors(self, replies: list[tuple[str, Any]], *, what: str) -> None:
        errors = [(rank, payload) for rank, (kind, payload) in enumerate(replies) if kind == "err"]
        if errors:
            detail = "".join(f"\n--- rank {rank} ---\n{tb}" for rank, tb in errors)
            raise WorkerError(
                f"{what} failed on ranks {[r for r, _ in errors]} of {self.world_size}:{detail}"
            )

    def close(self, *, force: bool = False) -> None:
        """Stop the workers: politely, or at once with ``force`` (a broken pool)."""
        for conn in [] if force else self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + (0.0 if force else 5.0)
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
        for conn in self._conns:
            conn.close()
        shutil.rmtree(self._tmpdir, ignore_errors=True)


_POOLS: dict[int, WorkerPool] = {}


def get_pool(world_size: int) -> WorkerPool:
    """The session's pool for ``world_size`` ranks, started on first use."""
    pool = _POOLS.get(world_size)
    if pool is not None and not pool.alive:
        pool.close(force=True)
        pool = None
    if pool is None:
        pool = WorkerPool(world_size)
        _POOLS[world_size] = pool
    return pool


def run_on_ranks(
    world_size: int, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None, **kwargs: Any
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; results by rank.

    On any failure the pool is discarded (its ranks may be stuck in a collective)
    and the error is re-raised with every failing rank's traceback.
    """
    pool = get_pool(world_size)
    try:
        return pool.run(fn, *args, timeout_s=timeout_s, **kwargs)
    except BaseException:
        _POOLS.pop(world_size, None)
        pool.close(force=True)
        raise


def recycle_pools() -> None:
    """Replace each pool that has run ``RECYCLE_AFTER`` bodies by a fresh one on its next use.

    [Note: pool recycling] A rank that has run many test bodies costs more per body than a fresh
    one: in one measurement the ZeRO-2/3 tests took 176 s of the ranks' CPU in fresh pools and
    257 s after 130 other tests had run in them (process groups that a body's step watchdog keeps
    alive for its idle minute, with their gloo threads; a larger heap for each collection to walk).
    A fresh pool costs about a second (the parent forks its preloaded self). Called between tests
    (tests/conftest.py), never inside one: a test may keep state in its ranks from one body to the next.
    """
    if not RECYCLE_AFTER:
        return
    for world_size, pool in list(_POOLS.items()):
        if pool.bodies >= RECYCLE_AFTER:
            del _POOLS[world_size]
            pool.close()


def shutdown_pools() -> None:
    """Stop every pool (called at the end of the test session)."""
    for pool in list(_POOLS.values()):
        pool.close()
    _POOLS.clear()


atexit.register(shutdown_pools)
