"""The heartbeat check (merak_core.run.stall) in one process, over an in-memory store: which ranks a failed
collective names as dead or silent. A rank killed a moment ago has a fresh last beat; it must be named
all the same, and a rank whose thread beats must be called alive.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import torch.distributed as dist

from merak_core.run.stall import _PREFIX, Heartbeat

INTERVAL_S = 0.1


def _beats(store: dist.Store, rank: int, world_size: int) -> Heartbeat:
    return Heartbeat(rank, world_size, interval_s=INTERVAL_S, store=store)


def test_a_rank_that_stopped_beating_a_moment_ago_is_named_not_called_alive() -> None:
    store = dist.HashStore()
    victim = _beats(store, 1, 2).start()
    victim.stop()  # its last beat is fresh (younger than three intervals), then nothing: it died
    start = time.monotonic()
    text = _beats(store, 0, 2).diagnosis()
    assert text == "no heartbeat from rank 1: stalled (stopped, hung) or dead", text
    assert time.monotonic() - start < 10 * INTERVAL_S + 1.0  # three intervals, and the default wait


def test_a_dead_process_is_named_at_once_and_a_beating_rank_is_alive() -> None:
    store = dist.HashStore()
    alive = _beats(store, 1, 3).start()
    try:
        gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
        pid = int(gone.stdout)  # exited and reaped: no such process any more
        store.set(f"{_PREFIX}2", f"{time.time():.3f} {pid} {socket.gethostname()}")
        check = _beats(store, 0, 3)
        start = time.monotonic()
        assert check.unresponsive() == [2]
        assert time.monotonic() - start < 3 * INTERVAL_S + 1.0  # not a silence measured: the process is gone
        assert check.diagnosis() == "rank 2: dead (the process is gone)"
    finally:
        alive.stop()


def test_every_rank_beating_is_reported_alive_within_about_an_interval() -> None:
    store = dist.HashStore()
    others = [_beats(store, r, 3).start() for r in (1, 2)]
    try:
        start = time.monotonic()
        assert _beats(store, 0, 3).unresponsive() == []
        assert time.monotonic() - start < 3 * INTERVAL_S + 1.0
    finally:
        for hb in others:
            hb.stop()


def test_a_rank_silent_for_long_and_another_host_is_named_silent() -> None:
    store = dist.HashStore()
    store.set(
        f"{_PREFIX}1", f"{time.time() - 60:.3f} 1 some-other-host"
    )  # a pid of another host: not ours to check
    assert (
        _beats(store, 0, 2).diagnosis(wait_s=0.2)
        == "no heartbeat from rank 1: stalled (stopped, hung) or dead"
    )
