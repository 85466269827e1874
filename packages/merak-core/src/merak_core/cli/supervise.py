"""Run torchrun for ``merak train``: forward signals to it, wait for it, never leave ranks behind.

[Note: signal forwarding] torchrun starts in a session of its own (``start_new_session``), so
a Ctrl-C in the terminal reaches only ``merak train``, which forwards it (SIGINT, SIGTERM or
SIGHUP, as received) to torchrun's process group with ``os.killpg``. torchrun passes it to its
workers (each in a session of its own as well), waits for them and kills those that outlive
its shutdown timeout; ``merak train`` waits for torchrun in turn, so when it returns no rank of
the job is left. torchrun gets only the first signal (a second one would interrupt its own
shutdown and leave ranks running): a second one prints that the job is still stopping, a third
kills torchrun's ranks and torchrun with SIGKILL (no checkpoint). While stopping, the ranks' and torchrun's
shutdown tracebacks are held back: the user sees the ranks' own log lines (the one that says
how to resume among them), a count of what was hidden, and the command to resume.

Exit status: torchrun's, except :data:`merak_core.run.exitcodes.PREEMPTED` when the job was
stopped by a signal (sent to ``merak train``, to torchrun or to the ranks, which then exit with
that code) before it finished.

[Note: parent death] A SIGKILL of ``merak train`` itself cannot be forwarded, and torchrun, in a
session of its own, would train on, holding the output_dir lock (see [Note: output_dir lock]). So
on Linux torchrun is started with a parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGTERM)``, set
in the child between fork and exec): when ``merak train`` dies, however it died, the kernel sends
torchrun SIGTERM, and torchrun stops its ranks as after a forwarded SIGTERM (they finish the step,
save and exit), then exits and with it goes the lock. A child that finds its parent already gone
before the signal is armed exits at once. Elsewhere (no ``prctl``) the job outlives a killed
``merak train``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from types import FrameType
from typing import IO, Any

from merak_core.run.exitcodes import PREEMPTED

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Signals ``merak train`` passes on to torchrun."""

_EXITCODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")
_REPORT_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
_AGENT_SIGNAL = re.compile(
    r"got signal: (\d+)|Received (\d+) death signal|Received Signals\.(\w+) death signal"
)
_RANK_LINE = re.compile(r"^\[rank \d+\] ")

__all__ = ["FORWARDED", "JobOutcome", "failure_line", "run_torchrun"]


class _ShutdownFilter:
    """Decides which stderr lines to show once the job is stopping (see [Note: signal forwarding]).

    Shown: the ranks' log lines (``[rank N] ...``) outside tracebacks. Hidden: tracebacks
    (from ``Traceback`` to the exception line) and torchrun's own shutdown report.
    """

    def __init__(self) -> None:
        self.in_traceback = False
        self.hidden = 0

    def keep(self, line: str) -> bool:
        text = line.rstrip("\n")
        if text.startswith("Traceback (most recent call last)"):
            self.in_traceback = True
        elif self.in_traceback and not (
            text[:1].isspace() or text == "" or text.startswith(("During handling", "The above exception"))
        ):
            self.in_traceback = False  # the exception line closes the traceback
            self.hidden += 1
            return False
        if self.in_traceback or not _RANK_LINE.match(text):
            self.hidden += 1
            return False
        return True


class JobOutcome:
    """What :func:`run_torchrun` saw: torchrun's status, the signal that stopped the job, worker exit codes."""

    def __init__(self) -> None:
        self.returncode: int | None = None
        self.signal: int | None = None
        """The first signal ``merak train`` received and forwarded, or None."""
        self.agent_signal: str | None = None
        """A signal torchrun reported receiving itself (sent to torchrun directly), or None."""
        self.worker_exitcodes: list[int] = []
        self.hidden_lines = 0
        self.repeats = 0
        """Signals received after the first (the second warns, the third kills the job's processes)."""
        self.root_cause: tuple[int, int] | None = None
        """(global rank, exit code) of the first failure in torchrun's final report, or None."""

    @property
    def preempted(self) -> bool:
        """The job was stopped by a signal before it finished."""
        if self.returncode == 0:
            return False
        if self.signal is not None or self.agent_signal is not None:
            return True
        return bool(self.worker_exitcodes) and all(c == PREEMPTED for c in self.worker_exitcodes)

    @property
    def exit_status(self) -> int:
        if self.preempted:
            return PREEMPTED
        assert self.returncode is not None
        return self.returncode if self.returncode >= 0 else 128 - self.returncode


def _children(pid: int) -> list[int]:
    """Direct children of ``pid``, from ``/proc`` (empty where there is no ``/proc``)."""
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(entry))
    return found


def _kill_tree(pid: int) -> None:
    """SIGKILL torchrun's ranks (each leads a session of its own) and torchrun's process group."""
    for child in _children(pid):
        for kill in (os.killpg, os.kill):
            try:
                kill(child, signal.SIGKILL)
                break
            except (ProcessLookupError, PermissionError):
                continue
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def _parent_death_signal() -> Any:
    """A ``preexec_fn`` that gives the child SIGTERM when this process dies (see [Note: parent death]).

    None where Linux's ``prctl`` is not available. The C function is looked up here, before the
    fork, so that the child only calls it.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def arm() -> None:
        if prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            return  # not armed: the child runs as it would without (nothing to report from here)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(128 + int(signal.SIGTERM))

    return arm


def _pump(stream: IO[str], out: IO[str], outcome: JobOutcome, stopping: threading.Event) -> None:
    filt = _ShutdownFilter()
    in_root_cause, root_rank = False, None
    for line in stream:
        found = _EXITCODE.match(line)
        if found:
            outcome.worker_exitcodes.append(int(found.group(1)))
        if line.startswith("Root Cause"):
            in_root_cause = True
        elif in_root_cause:
            rank_found = _REPORT_RANK.match(line)
            if rank_found:
                root_rank = int(rank_found.group(1))
            elif found and root_rank is not None and outcome.root_cause is None:
                outcome.root_cause = (root_rank, int(found.group(1)))
        sig = _AGENT_SIGNAL.search(line)
        if sig and outcome.signal is None:
            outcome.agent_signal = next(g for g in sig.groups() if g)
        if stopping.is_set() or outcome.agent_signal is not None:
            if not filt.keep(line):
                continue
        out.write(line)
        out.flush()
    outcome.hidden_lines = filt.hidden


def failure_line(outcome: JobOutcome, max_restarts: int) -> str | None:
    """What ``merak train`` says after torchrun's report when the job failed (None: it did not fail).

    torchrun gives up only when ``--max-restarts`` attempts are spent, so a fault that repeats in
    every attempt ends here, after ``max_restarts + 1`` attempts, never in a loop.
    """
    status = outcome.exit_status
    if status in (0, PREEMPTED):
        return None
    if outcome.root_cause is not None:
        rank, code = outcome.root_cause
        how = (
            f"killed by {signal.Signals(-code).name}"
            if code < 0 and -code in signal.valid_signals()
            else f"exit code {code}"
        )
        cause = f"rank {rank} failed first ({how}); its error is above"
    else:
        cause = f"torchrun exited with status {status}; the error is above"
    spent = (
        f"; torchrun restarted the job {max_restarts} time{'s' if max_restarts != 1 else ''} "
        f"(--max-restarts {max_restarts}) and every attempt failed, so it gave up"
        if max_restarts > 0
        else ""
    )
    return f"merak train: the job failed: {cause}{spent}"


def run_torchrun(
    cmd: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    pass_fds: Sequence[int] = (),
    on_start: Any = None,
    err: IO[str] | None = None,
) -> JobOutcome:
    """Run ``cmd`` (a torchrun command line) as described in [Note: signal forwarding].

    ``on_start(pid)`` is called once torchrun runs; ``err`` receives torchrun's stderr
    (default: ``sys.stderr``). Must be called from the main thread (it installs signal handlers).
    """
    out = err if err is not None else sys.stderr
    outcome = JobOutcome()
    stopping = threading.Event()
    started: list[subprocess.Popen[str]] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        stopping.set()
        if outcome.signal is not None:  # a repeated signal: torchrun is already stopping its ranks
            outcome.repeats += 1
            if outcome.repeats == 1:
                out.write(
                    "merak train: still stopping (the ranks finish their step and save); signal once more "
                    "to kill them now\n"
                )
            elif started:
                out.write("merak train: killing torchrun and its ranks\n")
                _kill_tree(started[0].pid)
            out.flush()
            return
        outcome.signal = signum
        out.write(f"merak train: {signal.Signals(signum).name} received, stopping the job\n")
        out.flush()
        if started:
            try:
                os.killpg(started[0].pid, signum)
            except ProcessLookupError:
                pass

    previous = {s: signal.signal(s, forward) for s in FORWARDED}  # before Popen: no signal is missed
    try:
        proc = subprocess.Popen(
            list(cmd),
            env=env,
            start_new_session=True,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            bufsize=1,
            pass_fds=tuple(pass_fds),
            preexec_fn=_parent_death_signal(),
        )
    except BaseException:
        for s, handler in previous.items():
            signal.signal(s, handler)
        raise
    started.append(proc)
    if outcome.signal is not None:  # arrived while torchrun was starting
        os.killpg(proc.pid, outcome.signal)
    pump = threading.Thread(target=_pump, args=(proc.stderr, out, outcome, stopping), daemon=True)
    pump.start()
    try:
        if on_start is not None:
            on_start(proc.pid)
        outcome.returncode = proc.wait()
        pump.join()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if proc.poll() is None:  # only on an exception here: take the job down with us
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
    return outcome


def launch_or_print(cmd: Sequence[str], *, dry_run: bool) -> int:
    """Run a torchrun command built by ``merak eval`` or ``merak generate`` (one thread per rank unless
    ``OMP_NUM_THREADS`` says otherwise) and return its exit status; with ``dry_run``, print it and return 0."""
    if dry_run:
        print(shlex.join(cmd))
        return 0
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    logging.getLogger(__name__).info("launching: %s", shlex.join(cmd))
    return subprocess.call(list(cmd), env=env)
