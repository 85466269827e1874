"""Name the rank that stalled or died, at the moment a collective times out.

[Note: heartbeats] While a rank trains, a daemon thread writes the rank's wall-clock time to its
key in the default group's key-value store (the one torchrun or the test harness rendezvoused
through) every ``interval_s`` seconds. The thread runs while the main thread waits in a
collective (gloo and NCCL waits release the GIL), so a healthy rank that is itself blocked by
someone else keeps beating; a rank stopped by SIGSTOP, deadlocked while holding the GIL, or dead
stops. When a collective of a step fails, :meth:`Heartbeat.unresponsive` reads every rank's last
beat: ranks silent for more than three intervals are suspects, and a suspect is named only if it
is still silent a little later (a healthy rank whose thread was merely starved of CPU beats again
meanwhile). Nothing waits when every rank beats. Clocks of different hosts are compared, so they
must agree to within about an interval (NTP does). The store is touched once per interval per
rank, never inside a step's critical path.

Not done here: the timeout itself (every process group of the layout has it, from
``comm_timeout_s``) and restarting the job (torchrun's ``--max-restarts``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from merak_core import _compat

logger = logging.getLogger(__name__)

_PREFIX = "merak/heartbeat/"


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
        self.store.set(f"{_PREFIX}{self.rank}", f"{time.time():.3f}")

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
            except Exception:  # noqa: BLE001 - the store is gone (the job is ending): stop beating
                return

    def _last_beats(self, ranks: list[int]) -> dict[int, float]:
        """Each rank's last beat (wall-clock seconds); 0 for a rank that never beat."""
        assert self.store is not None
        out = {}
        for r in ranks:
            key = f"{_PREFIX}{r}"
            out[r] = float(self.store.get(key)) if self.store.check([key]) else 0.0
        return out

    def unresponsive(self, wait_s: float | None = None) -> list[int] | None:
        """Global ranks silent for three intervals, and still silent ``wait_s`` later (default 2 intervals, >= 0.5 s).

        None when the check could not run (no store, or the store itself does not answer).
        """
        if self.store is None or self.world_size < 2:
            return None
        wait_s = max(0.5, 2 * self.interval_s) if wait_s is None else wait_s
        try:
            beats = self._last_beats([r for r in range(self.world_size) if r != self.rank])
            suspects = [r for r, t in beats.items() if time.time() - t > 3 * self.interval_s]
            if not suspects:
                return []
            time.sleep(wait_s)
            again = self._last_beats(suspects)
        except Exception as exc:  # noqa: BLE001 - the store's host may be the dead rank
            logger.warning("heartbeat check failed: %s", exc)
            return None
        return [r for r in suspects if again[r] == beats[r]]

    def diagnosis(self, wait_s: float | None = None) -> str:
        """A sentence naming the stalled or dead ranks, for a failure message."""
        stalled = self.unresponsive(wait_s)
        if stalled is None:
            return "the ranks' heartbeats could not be read"
        if not stalled:
            return (
                "every other rank still beats its heartbeat: they are alive but did not reach this "
                "collective (one waits elsewhere, or the step needs more than the timeout)"
            )
        names = "; ".join(self.describe(r) for r in stalled)
        return f"no heartbeat from {names}: stalled (stopped, hung) or dead"


__all__ = ["Heartbeat"]
