"""Preflight: ``output_dir``, ``export_hf_dir`` and ``--resume``."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from merak_core.checks.base import PreflightError


def check_output_dir(output_dir: str) -> None:
    """``output_dir`` is a writable directory, or can be created under a writable directory."""
    path = Path(output_dir)
    if path.exists() and not path.is_dir():
        raise PreflightError(
            f"training.output_dir={output_dir!r} exists and is not a directory; choose a directory "
            "path (training.output_dir=...)"
        )
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise PreflightError(
            f"training.output_dir={output_dir!r}: {str(probe)!r} is a file, so the directory cannot "
            "be created; choose another path"
        )
    try:  # a real write: permission bits say nothing for root or on read-only and special file systems
        os.rmdir(tempfile.mkdtemp(prefix=".merak-write-check-", dir=probe))
    except OSError as exc:
        what = "is not writable" if probe == path else f"cannot be created: {str(probe)!r} is not writable"
        raise PreflightError(
            f"training.output_dir={output_dir!r} {what} ({exc.strerror}); choose a writable "
            "directory (training.output_dir=...) or fix its permissions"
        ) from None


def check_export_dir(export_hf_dir: str | None) -> None:
    """``export_hf_dir`` can be a folder (the export at the end of training would find a file there)."""
    if export_hf_dir is None:
        return
    from merak_core.hf.export import check_out_dir

    try:
        check_out_dir(export_hf_dir, what="training.export_hf_dir")
    except ValueError as exc:
        raise PreflightError(str(exc)) from None


def check_resume(resume: str | None, output_dir: str) -> None:
    """``--resume latest`` needs a checkpoint in ``output_dir``; ``--resume PATH`` needs PATH to exist."""
    from merak_core.checkpoint.files import latest_candidates, pointer_root

    if resume in (None, "auto"):
        return
    root = Path(output_dir) / "checkpoints"
    if resume == "latest":
        if not latest_candidates(root):
            raise PreflightError(
                f"--resume latest: {str(root)!r} holds no checkpoint; start without --resume, or "
                "use --resume auto (the latest checkpoint when there is one, else a fresh start)"
            )
        return
    assert resume is not None
    if pointer_root(resume) is None and not Path(resume).exists() and not (root / resume).exists():
        raise PreflightError(
            f"--resume {resume!r}: no such checkpoint (neither that path nor {str(root / resume)!r} "
            "exists); pass a step_<N> directory, 'latest' or 'auto'"
        )
