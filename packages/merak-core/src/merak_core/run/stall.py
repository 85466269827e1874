"""Name the rank that stalled or died, at the moment a collective times out.

[Note: heartbeats] While a rank trains, a daemon thread writes the rank's wall-clock time, pid
and host to its key in the default group's key-value store (the one torchrun or the test harness
rendezvoused through) every ``interval_s`` seconds. The thread runs while the main thread waits
in a collective (gloo and NCCL waits release the GIL), so a healthy rank that is itself blocked by
someone else keeps beating; a rank stopped by SIGSTOP, deadlocked while holding the GIL, or dead
stops. When a collective of a step fails, :meth:`Heartbeat.unresponsive` watches every other
rank's key: a rank that beats again is alive; a rank on this host whose process is gone (or a
zombie) is dead at once; any other rank is named once it has been silent for three intervals and
the check has lasted ``wait_s`` (a healthy rank whose thread was merely starved of CPU beats again
meanwhile). A rank killed a moment ago has a fresh last beat, and a peer's death makes a
collective fail at once (the connection closes), so a last beat younger than three intervals
proves nothing: the check waits for the next one, at most about three intervals. When every rank
beats, the check ends with the slowest rank's next beat (one interval). Clocks of different hosts
are compared, so they must agree to within about an interval (NTP does). The store is touched
once per interval per rank, never inside a step's critical path.

Not done here: the timeout itself (every process group of the layout has it, from
``comm_timeout_s``) and restarting the job (torchrun's ``--max-restarts``).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from merak_core.parallel import _compat

logger = logging.getLogger(__name__)

_PREFIX = "merak/heartbeat/"
_HOST = socket.gethostname()


def _process_gone(pid: int) -> bool:
    """Whether process ``pid`` of this host has exited (a zombie included: it runs no more code)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except (OSError, IndexError):  # no /proc (not Linux): ask the kernel whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return False


class Heartbeat:
    """One rank's heartbeat thread and the check of everyone else's (see [Note: heartbeats]).

    Args:
        rank, world_size: this rank in the default group, and the group's size.
        interval_s: seconds between two beats.
        describe: ``describe(rank) -> str`` for messages (e.g. the rank's dp/tp/pp coordinates).
        store: the store to beat in (default: the default process group's).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        *,
        interval_s: float,
        describe: Callable[[int], str] | None = None,
        store: Any = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.interval_s = interval_s
        self.describe = describe or (lambda r: f"rank {r}")
        self.store = store if store is not None else _compat.default_store()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_timeout(
        cls, rank: int, world_size: int, timeout_s: float, *, describe: Callable[[int], str] | None = None
    ) -> Heartbeat:
        """Beats 10 times per timeout, between every 0.2 s and every 1 s."""
        return cls(rank, world_size, interval_s=min(1.0, max(0.2, timeout_s / 10)), describe=describe)

    def start(self) -> Heartbeat:
        if self.store is None or self._thread is not None or self.world_size < 2:
            return self
        self._stop.clear()
        self._beat()
        self._thread = threading.Thread(target=self._run, name=f"merak-heartbeat-{self.rank}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5 * self.interval_s)
            self._thread = None

    def __enter__(self) -> Heartbeat:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _beat(self) -> None:
        assert self.store is not None
        self.store.set(f"{_PREFIX}{self.rank}", f"{time.time():.3f} {os.getpid()} {_HOST}")

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
            except Exception:  # noqa: BLE001 - the store is gone (the job is ending): stop beating
                return

    def _last_beats(self, ranks: list[int] | set[int]) -> dict[int, tuple[float, int | None, str | None]]:
        """Each rank's last beat: (wall-clock seconds, pid, host); (0, None, None) for a rank that never beat."""
        assert self.store is not None
        out: dict[int, tuple[float, int | None, str | None]] = {}
        for r in ranks:
            key = f"{_PREFIX}{r}"
            if not self.store.check([key]):
                out[r] = (0.0, None, None)
                continue
            fields = self.store.get(key).decode().split(" ", 2)
            pid = int(fields[1]) if len(fields) == 3 else None
            out[r] = (float(fields[0]), pid, fields[2] if pid is not None else None)
        return out

    @staticmethod
    def _dead(beat: tuple[float, int | None, str | None]) -> bool:
        """The beat comes from a process of this host that is gone."""
        _, pid, host = beat
        return pid is not None and host == _HOST and _process_gone(pid)

    def _check(self, wait_s: float) -> tuple[list[int], list[int]]:
        """(silent ranks, dead ranks of this host) among the others, as described in [Note: heartbeats]."""
        start = time.time()
        first = self._last_beats([r for r in range(self.world_size) if r != self.rank])
        deadline = {r: max(start + wait_s, t + 3 * self.interval_s) for r, (t, _, _) in first.items()}
        pending, silent, dead = set(first), [], []
        poll_s = min(0.2, max(0.02, self.interval_s / 5))
        while True:
            latest = self._last_beats(pending)
            for r in sorted(pending):
                if latest[r][0] != first[r][0]:  # it beat again: alive
                    pending.discard(r)
                elif self._dead(latest[r]):
                    pending.discard(r)
                    dead.append(r)
                elif time.time() >= deadline[r]:
                    pending.discard(r)
                    silent.append(r)
            if not pending:
                return sorted(silent), sorted(dead)
            time.sleep(poll_s)

    def unresponsive(self, wait_s: float | None = None) -> list[int] | None:
        """Global ranks that are dead or silent for three intervals (see [Note: heartbeats]).

        ``wait_s``: how long a rank already silent for three intervals is watched before it is
        named (default 2 intervals, >= 0.5 s). None when the check could not run (no store, or the
        store itself does not answer).
        """
        found = self._checked(wait_s)
        return None if found is None else sorted(found[0] + found[1])

    def _checked(self, wait_s: float | None) -> tuple[list[int], list[int]] | None:
        if self.store is None or self.world_size < 2:
            return None
        try:
            return self._check(max(0.5, 2 * self.interval_s) if wait_s is None else wait_s)
        except Exception as exc:  # noqa: BLE001 - the store's host may be the dead rank
            logger.warning("heartbeat check failed: %s", exc)
            return None

    def diagnosis(self, wait_s: float | None = None) -> str:
        """A sentence naming the dead and the stalled ranks, for a failure message."""
        found = self._checked(wait_s)
        if found is None:
            return "the ranks' heartbeats could not be read"
        silent, dead = found
        if not silent and not dead:
            return (
                "every other rank still beats its heartbeat: they are alive but did not reach this "
                "collective (one waits elsewhere, or the step needs more than the timeout)"
            )
        parts = []
        if dead:
            names = "; ".join(self.describe(r) for r in dead)
            parts.append(f"{names}: dead (the process is gone)")
        if silent:
            names = "; ".join(self.describe(r) for r in silent)
            parts.append(f"no heartbeat from {names}: stalled (stopped, hung) or dead")
        return "; ".join(parts)


__all__ = ["Heartbeat"]
