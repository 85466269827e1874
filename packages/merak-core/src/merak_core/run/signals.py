"""SIGTERM and SIGINT on a rank: finish the current step with every other rank, save, exit.

[Note: preemption] A scheduler preempts a job with SIGTERM (to torchrun, which forwards it to
every rank, or to one rank); Ctrl-C sends SIGINT to the whole process group. While
:meth:`merak_core.Trainer.train` runs, :class:`StopRequest` replaces the default handlers of
both signals on the main thread with one that only records the signal. The record rides in
the step's final all-reduce (see [Note: step flags] in :mod:`merak_core.run.nonfinite`), so every
rank learns in the same step that some rank was signalled: they all complete that step, the
trainer writes a preemption checkpoint, and :class:`TrainingPreempted` carries the step and the
checkpoint to the entry point, which prints how to resume and exits with
:data:`merak_core.run.exitcodes.PREEMPTED`. A rank signalled a second time keeps going (it is
already stopping); a third signal restores the default action, so a stuck rank can still be
killed by signal.

[Note: signals during set-up] Before training starts (importing, building the model,
partitioning, creating process groups, loading a checkpoint) a rank has nothing to save, and
much of that time is spent inside C++ calls (a rendezvous, a store wait) where Python runs no
signal handler until the call returns. :class:`SetupSignals` covers that phase: the signal's
number reaches a watcher thread through :func:`signal.set_wakeup_fd` at once, and the thread
(or the handler, whichever runs first) writes one line and ends the process with
:data:`merak_core.run.exitcodes.PREEMPTED`, without tracebacks and without waiting for the call.
When set-up is over, :meth:`SetupSignals.__exit__` disarms it and :class:`StopRequest` takes
over; a signal that arrives in between is kept (``late``) and inherited by the stop request.

Not done here: forwarding signals from ``merak train`` to torchrun (the CLI) and writing the
checkpoint (the checkpoint manager).
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from merak_core.run.exitcodes import PREEMPTED

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
        return (
            f"merak: stopped by {self.signal_name} after step {self.step}, checkpoint {self.checkpoint}; "
            f"resume with: {command}"
        )


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
                logger.warning(
                    "received %s: finishing the current step with every rank, then saving and exiting", name
                )
        if self.count >= 3:  # the user insists: the default action next time
            for sig, previous in self._previous.items():
                signal.signal(sig, previous)

    def __enter__(self) -> StopRequest:
        self.signal_name, self.count = None, 0
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
            self._inherit(self._previous.get(signal.SIGTERM))
        return self

    def _inherit(self, outer: Any) -> None:
        """Keep a signal that the handler this one replaces has recorded (an enclosing request, or set-up's)."""
        owner = getattr(outer, "__self__", None)
        if isinstance(owner, StopRequest) and owner.signal_name is not None:
            self.signal_name, self.count = owner.signal_name, owner.count
        elif isinstance(owner, SetupSignals) and owner.late is not None:
            self.signal_name, self.count = signal.Signals(owner.late).name, 1

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()


class SetupSignals:
    """SIGTERM/SIGINT while a rank sets up: one line, then exit with PREEMPTED at once (see [Note: signals during set-up]).

    ``message(signal_name)`` gives the line to print (nothing when it returns None). Outside the
    main thread it does nothing. After the context exits, its handler stays installed until
    :meth:`restore`, recording signals in ``late`` instead of exiting; a :class:`StopRequest`
    entered then inherits the recorded signal.
    """

    def __init__(
        self, message: Callable[[str], str | None] | None = None, *, exit_code: int = PREEMPTED
    ) -> None:
        self.message = message
        self.exit_code = exit_code
        self.late: int | None = None
        self._armed = False
        self._once = threading.Lock()
        self._previous: dict[int, Any] = {}
        self._pipe: tuple[int, int] | None = None
        self._old_wakeup = -1
        self._watcher: threading.Thread | None = None

    def _stop(self, signum: int) -> None:
        if not self._once.acquire(blocking=False):  # the other path is already exiting
            return
        try:
            line = self.message(signal.Signals(signum).name) if self.message is not None else None
            if line:
                os.write(2, (line.rstrip("\n") + "\n").encode(errors="replace"))
        except BaseException:  # noqa: BLE001 - exiting is all that is left to do
            pass
        os._exit(self.exit_code)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._armed:
            self._stop(signum)
        elif self.late is None:
            self.late = signum

    def _watch(self, read_fd: int) -> None:
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            if not data or not self._armed:
                return
            for signum in data:
                if signum in STOP_SIGNALS:
                    self._stop(signum)

    def __enter__(self) -> SetupSignals:
        if threading.current_thread() is not threading.main_thread():
            return self
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        self._pipe = (read_fd, write_fd)
        self._armed = True
        self._old_wakeup = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        self._watcher = threading.Thread(
            target=self._watch, args=(read_fd,), name="merak-setup-signals", daemon=True
        )
        self._watcher.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pipe is None:
            return
        self._armed = False
        signal.set_wakeup_fd(self._old_wakeup)
        read_fd, write_fd = self._pipe
        try:
            os.write(write_fd, b"\0")  # wake the watcher: it sees the guard disarmed and returns
        except OSError:
            pass
        if self._watcher is not None:
            self._watcher.join(timeout=5)
        for fd in (read_fd, write_fd):
            os.close(fd)
        self._pipe = None

    def restore(self) -> None:
        """Put back the handlers that were installed before :meth:`__enter__`."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()


def restart_command(config: str, overrides: Sequence[str], checkpoints: str | os.PathLike[str] | None) -> str:
    """The command that continues a stopped job: with ``--resume latest`` only when ``checkpoints`` holds one."""
    from merak_core.checkpoint.files import latest_candidates

    command = ["merak", "train", config, *overrides]
    if checkpoints is not None and latest_candidates(Path(checkpoints)):
        command += ["--resume", "latest"]
    return shlex.join(command)


__all__ = ["STOP_SIGNALS", "SetupSignals", "StopRequest", "TrainingPreempted", "restart_command"]
