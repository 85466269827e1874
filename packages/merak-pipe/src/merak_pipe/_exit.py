"""End the default process group at a normal exit when the script did not (see [Note: groups at exit]).

[Note: groups at exit] A script that runs the pipeline on its own ``dist.init_process_group``
and ends without ``dist.destroy_process_group()`` leaves gloo's worker threads running into the
interpreter's shutdown. A worker that drops its last reference to a finished collective or
send/receive there (the tensors in it, which hold Python objects) must take the GIL, which a
finalising interpreter no longer gives: the rank aborts with "terminate called without an active
exception" (SIGABRT, torchrun exit 1), about one bare run in six on a loaded machine. Destroying
a group joins its workers, but only once nothing else refers to it: the groups a script keeps in
its own variables (and this package's runners) live until the interpreter clears them, so
destroying them here would not stop their threads. The default group is the one torch holds for
the script: it is destroyed here, once, from an ``atexit`` handler registered when the runtime is
first used, while the interpreter is still whole. Not after an uncaught exception (a collective
may still wait on a dead peer, and destroying its group would wait with it), and not when the
script (or the library that composes this package) destroyed it first.
"""

from __future__ import annotations

import atexit
import sys

import torch.distributed as dist

_registered = False


def destroy_default_group_at_exit() -> None:
    """Register :func:`_end_default_group` with ``atexit`` once per process."""
    global _registered
    if not _registered:
        atexit.register(_end_default_group)
        _registered = True


def _end_default_group() -> None:
    if getattr(sys, "last_value", None) is not None:  # an uncaught exception ended the script
        return
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
