"""Say where every rank is before a collective's timeout ends the job.

[Note: step watchdog] On CUDA a wait on a p2p or collective Work only orders streams: when a
peer dies or stalls, the host blocks later, in a synchronisation, until NCCL's own watchdog
aborts the process after ``comm_timeout_s``; the Python exception that would name the rank,
the stage and the action (``PipelineCommError``, the engine's ``TrainingStepError``) is never
raised. :class:`StepWatchdog` does not wait for that exception: the engine enters each phase of
a step (the pipeline round, the DP gradient sync, the norm, the loss all-reduce, the optimizer
step) through :meth:`StepWatchdog.watch`; a daemon thread notices a phase that has lasted
``warn_after_s`` (half the timeout by default) and logs, once per phase, at ERROR level: the
rank and its coordinates, the step, the phase, the pipeline stage, action and microbatch this
rank is in (read from the runner, :meth:`merak_pipe.PipelineRunner.describe_position`) and the
heartbeat's diagnosis of the silent ranks (:mod:`merak_core.run.stall`). Every rank that waits
says so, so the logs show who waits on whom before the job dies. The same code runs on gloo
(the CPU tests block a peer).

The thread costs nothing on the step's path (two attribute writes per phase); it exits after
a minute without a phase and starts again with the next one.

Not done here: aborting anything (the timeout and NCCL's watchdog do), and NCCL's flight
recorder (switched on by ``merak train``, :mod:`merak_core.cli.train`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping

logger = logging.getLogger(__name__)

_IDLE_EXIT_S = 60.0


def _nothing() -> str:
    return ""


class StepWatchdog:
    """Log where this rank waits when a phase of a step outlasts ``warn_after_s`` (see [Note: step watchdog]).

    Args:
        timeout_s: the collectives' timeout (``comm_timeout_s``), quoted in the message.
        who: this rank and its coordinates, e.g. ``"rank 3 (pp_rank 1, dp_rank 1, tp_rank 0)"``.
        diagnose: the heartbeat's sentence about the other ranks (may block a few seconds).
        warn_after_s: seconds in one phase before the message; default half of ``timeout_s``.
    """

    def __init__(
        self,
        *,
        timeout_s: float,
        who: str,
        diagnose: Callable[[], str],
        warn_after_s: float | None = None,
    ) -> None:
        self.timeout_s = float(timeout_s)
        self.who = who
        self.diagnose = diagnose
        self.warn_after_s = self.timeout_s / 2 if warn_after_s is None else float(warn_after_s)
        self.reports: list[str] = []
        """Every message logged (for tests and post-mortems)."""
        self._phase: tuple[int, str, int, float, Callable[[], str]] | None = None
        self._token = 0
        self._reported = 0
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def watch(self, phase: str, step: int, where: Callable[[], str] = _nothing) -> Iterator[None]:
        """Run the block as ``phase`` of optimizer step ``step``; ``where()`` says where inside it this rank is."""
        with self._lock:
            self._token += 1
            self._phase = (self._token, phase, step, time.monotonic(), where)
            if self._thread is None:
                # The thread holds the watchdog weakly: the engine (through ``diagnose``) and its
                # process groups go when their Trainer goes, not a minute later with the thread.
                self._thread = threading.Thread(
                    target=_watch_loop, args=(weakref.ref(self),), name="merak-step-watchdog", daemon=True
                )
                self._thread.start()
        try:
            yield
        finally:
            self._phase = None

    def _poll(self, idle_since: float) -> float | None:
        """One look at the current phase: the new ``idle_since``, or None when the thread should exit."""
        current = self._phase
        now = time.monotonic()
        if current is None:
            with self._lock:
                if self._phase is None and now - idle_since > _IDLE_EXIT_S:
                    self._thread = None
                    return None
            return idle_since
        token, phase, step, start, where = current
        if token != self._reported and now - start >= self.warn_after_s:
            self._reported = token
            self._report(phase, step, now - start, where)
        return now

    def _report(self, phase: str, step: int, waited_s: float, where: Callable[[], str]) -> None:
        try:
            position = where()
        except Exception as exc:  # noqa: BLE001 - a watchdog never raises into the job
            position = f"(position unknown: {exc})"
        inside = f"; pipeline position: {position}" if position else ""
        message = (
            f"{self.who}, step {step}: still in {phase} after {waited_s:.1f} s of the {self.timeout_s:g} s "
            f"timeout{inside}; {self.diagnose()}"
        )
        self.reports.append(message)
        logger.error("%s", message)


def _watch_loop(ref: weakref.ReferenceType[StepWatchdog]) -> None:
    """The watchdog's thread: polls while the watchdog lives, exits after an idle minute or with it."""
    watchdog = ref()
    if watchdog is None:
        return
    poll_s = min(1.0, max(0.05, watchdog.warn_after_s / 20))
    idle_since: float | None = time.monotonic()
    del watchdog  # no strong reference while asleep
    while idle_since is not None:
        time.sleep(poll_s)
        watchdog = ref()
        if watchdog is None:
            return
        idle_since = watchdog._poll(idle_since)
        del watchdog


def flight_recorder_env(output_dir: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment that switches NCCL's flight recorder on for the ranks (what the user set wins).

    A ring of the last 2000 collectives and p2p operations per rank
    (``TORCH_NCCL_TRACE_BUFFER_SIZE``), dumped when NCCL's watchdog times out
    (``TORCH_NCCL_DUMP_ON_TIMEOUT``) to ``<output_dir>/nccl_flight_recorder/rank_<r>``
    (``TORCH_FR_DUMP_TEMP_FILE``, and its older name ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``); read them
    with ``python -m torch.distributed.flight_recorder.fr_trace <dir>`` (torch's analyser).
    """
    prefix = f"{output_dir.rstrip('/')}/nccl_flight_recorder/rank_"
    wanted = {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
    }
    return {key: value for key, value in wanted.items() if key not in environ}


__all__ = ["StepWatchdog", "flight_recorder_env"]
