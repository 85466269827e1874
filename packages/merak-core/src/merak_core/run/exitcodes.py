"""Exit codes of ``merak train`` and its ranks, defined once for the CLI, the launcher and the trainer.

``0`` is success and ``2`` a bad job file or command line (found before torchrun starts). A job
stopped by a signal (SIGTERM from a scheduler, Ctrl-C) exits with :data:`PREEMPTED`: the ranks
after writing their preemption checkpoint, ``merak train`` after its ranks are gone. The value
is ``EX_TEMPFAIL`` of ``sysexits.h`` ("temporary failure, the user is invited to retry"): a
wrapper script or a scheduler can tell "stopped, resume me" from a crash (``1``) and from a
process killed outright by a signal (``128 + signal``, e.g. 137 for SIGKILL).
"""

from __future__ import annotations

OK = 0
"""The job finished."""
FAILED = 1
"""A rank failed (an exception, a dead peer, a timeout)."""
BAD_INPUT = 2
"""The job file, an override or a command-line flag is wrong; nothing was started."""
PREEMPTED = 75
"""Stopped by SIGTERM or SIGINT; resume with ``merak train JOB --resume latest``."""

__all__ = ["BAD_INPUT", "FAILED", "OK", "PREEMPTED"]
