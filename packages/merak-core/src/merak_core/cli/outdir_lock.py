"""One job per ``output_dir``: a lock file that names the host and process holding it.

``merak train`` takes ``OUTPUT_DIR/merak.lock`` before torchrun starts and holds it until the
job is over. Two jobs writing one directory would interleave their metrics and overwrite each
other's checkpoints, so the second one stops at once with the holder's host, pid and start time.

[Note: output_dir lock] The lock is an exclusive ``fcntl.flock`` on the file, not the file's
existence: the kernel drops it when every process holding the open file is gone, however it
died (SIGKILL, OOM, a crash of the node's job), so a dead job never blocks the next one. The
file's content (JSON: host, pid, start time, command) only describes the holder. A lock taken
over the content of a job that did not release it (it died) is a *stale lock*: the new job logs
a warning naming the dead job and goes on. The launcher passes the locked file descriptor to
torchrun, so the lock lives as long as torchrun does, even when the launching process is killed
first. On release the content is cleared and the file stays (removing it would let a third job
lock a new file while a second still holds the old one).

Not covered: jobs started without ``merak train`` (the Python API) take no lock, and ``flock``
is advisory and only as reliable as the file system's support for it (local disks and most
cluster file systems; old NFS setups may not propagate it between hosts).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

LOCK_NAME = "merak.lock"

__all__ = ["LOCK_NAME", "OutputDirLock", "OutputDirLocked"]


class OutputDirLocked(RuntimeError):
    """Another live job holds the lock of this ``output_dir``."""


def _describe(holder: dict[str, Any]) -> str:
    started = holder.get("started")
    when = (
        time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
        if isinstance(started, (int, float))
        else "?"
    )
    command = holder.get("command")
    torchrun = f" (torchrun pid {holder['torchrun_pid']})" if holder.get("torchrun_pid") else ""
    return f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}{torchrun}, started {when}" + (
        f", command: {command}" if command else ""
    )


def _read_holder(fd: int) -> dict[str, Any] | None:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = b""
    while chunk := os.read(fd, 65536):
        raw += chunk
    if not raw.strip():
        return None
    try:
        holder = json.loads(raw.decode("utf-8", "replace"))
    except json.JSONDecodeError:
        return {"host": "?", "pid": "?", "content": raw[:200].decode("utf-8", "replace")}
    return holder if isinstance(holder, dict) else {"content": str(holder)[:200]}


class OutputDirLock:
    """The exclusive lock of one ``output_dir`` (see [Note: output_dir lock]).

    ``OutputDirLock.acquire(path)`` creates the directory when needed, locks ``path/merak.lock``
    and writes this process's description into it; it raises :class:`OutputDirLocked` when a
    live job holds it. ``fd`` is the locked descriptor (pass it to child processes to share the
    lock); :meth:`release` clears the file and unlocks. Also a context manager.
    """

    def __init__(self, path: Path, fd: int, stale: dict[str, Any] | None) -> None:
        self.path = path
        self.fd = fd
        self.stale = stale
        """The description left by a job that died holding the lock, or None."""
        self.holder: dict[str, Any] = {}

    @classmethod
    def acquire(cls, output_dir: str | os.PathLike[str], *, command: str | None = None) -> OutputDirLock:
        directory = Path(output_dir)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd) or {}
            os.close(fd)
            raise OutputDirLocked(
                f"output_dir {str(directory)!r} is in use by another running job ({_describe(holder)}; lock file "
                f"{str(path)!r}). Wait for that job to finish or stop it (kill {holder.get('pid', '<pid>')} on "
                f"{holder.get('host', 'its host')}), or give this job another directory "
                "(training.output_dir=...)"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        stale = _read_holder(fd)
        if stale is not None:
            logger.warning(
                "output_dir %s: taking over the lock of a job that is gone (%s)", directory, _describe(stale)
            )
        me = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.time(),
            "command": command if command is not None else " ".join(sys.argv),
        }
        lock = cls(path, fd, stale)
        lock._write(me)
        return lock

    def _write(self, holder: dict[str, Any]) -> None:
        os.ftruncate(self.fd, 0)
        os.lseek(self.fd, 0, os.SEEK_SET)
        os.write(self.fd, (json.dumps(holder) + "\n").encode())
        os.fsync(self.fd)
        self.holder = holder

    def note(self, **fields: Any) -> None:
        """Add fields to the holder's description (e.g. ``torchrun_pid`` once torchrun runs)."""
        self._write({**self.holder, **fields})

    def release(self) -> None:
        """Clear the description and unlock (idempotent)."""
        if self.fd < 0:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, 0)
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = -1

    def __enter__(self) -> OutputDirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
