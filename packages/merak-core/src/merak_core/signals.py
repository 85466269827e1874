"""SIGTERM and SIGINT on a rank: finish the current step with every other rank, save, exit.

[Note: preemption] A scheduler preempts a job with SIGTERM (to torchrun, which forwards it to
every rank, or to one rank); Ctrl-C sends SIGINT to the whole process group. While
:meth:`merak_core.Trainer.train` runs, :class:`StopRequest` replaces the default handlers of
both signals on the main thread with one that only records the signal. The record rides in
the step's final all-reduce (see [Note: step flags] in :mod:`merak_core.nonfinite`), so every
rank learns in the same step that some rank was signalled: they all complete that step, the
trainer writes a preemption checkpoint, and :class:`TrainingPreempted` carries the step and the
checkpoint to the entry point, which prints how to resume and exits with
:data:`merak_core.exitcodes.PREEMPTED`. A rank signalled a second time keeps going (it is
already stopping); a third signal restores the default action, so a stuck rank can still be
killed by signal.

Not done here: forwarding signals from ``merak train`` to torchrun (the CLI) and writing the
checkpoint (the checkpoint manager).
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class TrainingPreempted(Exception):
    """Training stopped at ``step`` because a rank received ``signal_name``; ``checkpoint`` holds that step."""

    def __init__(self, step: int, checkpoint: str | None, signal_name: str) -> None:
        self.step = step
        self.checkpoint = checkpoint
        self.signal_name = signal_name
        saved = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint (no output_dir)"
        super().__init__(f"training stopped by {signal_name} after step {step}: {saved}")

    def resume_line(self, command: str) -> str:
        """The one line that tells the user how to continue (``command``: e.g. ``merak train job.yaml --resume latest``)."""
        if not self.checkpoint:
            return f"merak: stopped by {self.signal_name} after step {self.step}; nothing was saved (no output_dir)"
        return (f"merak: stopped by {self.signal_name} after step {self.step}, checkpoint {self.checkpoint}; "
                f"resume with: {command}")


class StopRequest:
    """Records SIGTERM/SIGINT while active (a context manager; see [Note: preemption]).

    ``announce``: log the first signal (a warning on the rank that received it).

    Outside the main thread (where Python cannot install handlers) it records nothing and the
    signals keep their previous handlers.
    """

    def __init__(self, *, announce: bool = True) -> None:
        self.announce = announce
        self.signal_name: str | None = None
        self.count = 0
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        """Whether this rank received a stop signal since the context was entered."""
        return self.signal_name is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        name = signal.Signals(signum).name
        if self.signal_name is None:
            self.signal_name = name
            if self.announce:
                logger.warning("received %s: finishing the current step with every rank, then saving and exiting",
                               name)
        if self.count >= 3:  # the user insists: the default action next time
            for sig, previous in self._previous.items():
                signal.signal(sig, previous)

    def __enter__(self) -> StopRequest:
        self.signal_name, self.count = None, 0
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()


__all__ = ["STOP_SIGNALS", "StopRequest", "TrainingPreempted"]
