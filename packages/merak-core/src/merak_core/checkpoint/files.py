"""The files of a checkpoint directory: layout on disk, the metadata file, the ``latest`` pointer.

``checkpoints/step_<N>/`` holds DCP's ``.metadata`` and ``*.distcp`` files and
``merak_checkpoint.json`` (step, layout, training arguments, model fingerprint and
the manifest of checksums, see ``integrity.py``); ``checkpoints/latest`` names the
newest committed directory. Everything here is local to one process (no
collectives), so every rank reaches the same verdict on the same files.

Not done here: what the DCP files hold (``save.py``, ``load.py``), checksums (``integrity.py``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp

FORMAT = "merak-dcp-1"
META_FILE = "merak_checkpoint.json"
LATEST_FILE = "latest"
_STEP_RE = re.compile(r"^step_(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint is missing, partial, corrupt or belongs to another model; the message names the path."""


class CheckpointCorruptError(CheckpointError):
    """A committed checkpoint's files are damaged (checksum, size, missing or unreadable file).

    ``resume('latest')`` skips such a checkpoint (with a warning) and takes the next older one.
    """


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Committed checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_RE.match(child.name)
        if match and child.is_dir():
            found.append((int(match.group(1)), child))
    return sorted(found)


def _step_of(directory: Path) -> str:
    match = _STEP_RE.match(directory.name)
    return match.group(1) if match else "?"


def latest_candidates(root: Path) -> list[Path]:
    """What ``latest`` under ``root`` may mean, best first.

    The directory the ``latest`` pointer names, then the committed checkpoints older
    than it, newest first (without a pointer: every committed checkpoint, newest
    first). Directories newer than the pointer's are not candidates: they belong to
    a save whose pointer update never happened, or to a run that was resumed from an
    earlier step.
    """
    dirs = _step_dirs(root)
    pointer = root / LATEST_FILE
    name = pointer.read_text().strip() if pointer.is_file() else ""
    target = root / name if name else None
    if target is None or not target.is_dir() or not _STEP_RE.match(target.name):
        return [path for _, path in reversed(dirs)]
    limit = int(_STEP_RE.match(target.name).group(1))  # type: ignore[union-attr]
    return [target] + [path for step, path in reversed(dirs) if step < limit]


def pointer_root(path: str | os.PathLike[str]) -> Path | None:
    """The checkpoints directory when ``path`` is a ``latest`` pointer (``.../checkpoints/latest``), else None.

    A directory that holds ``step_<N>`` checkpoints (or a ``latest`` file) but is not
    a checkpoint itself counts as its own ``latest``.
    """
    candidate = Path(path)
    if candidate.name == LATEST_FILE and not candidate.is_dir():
        return candidate.parent
    if (
        candidate.is_dir()
        and not (candidate / META_FILE).exists()
        and ((candidate / LATEST_FILE).is_file() or _step_dirs(candidate))
    ):
        return candidate
    return None


def read_checkpoint_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``merak_checkpoint.json`` of a committed checkpoint; CheckpointError if missing/partial/corrupt."""
    directory = Path(path)
    if directory.name.endswith(".tmp"):
        raise CheckpointError(
            f"checkpoint {str(directory)!r} is partial: its save never committed (a crash during the save); "
            "load the previous step_<N> directory or 'latest'"
        )
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint {str(directory)!r} does not exist (or is not a directory)")
    meta_path = directory / META_FILE
    if not meta_path.is_file():
        raise CheckpointCorruptError(
            f"checkpoint {str(directory)!r} is partial or not a Merak checkpoint: {META_FILE} is missing"
        )
    if not (directory / ".metadata").is_file():
        raise CheckpointCorruptError(
            f"checkpoint {str(directory)!r} is partial: DCP's .metadata file is missing"
        )
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointCorruptError(
            f"checkpoint {str(directory)!r} is corrupt: cannot read {META_FILE}: {exc}"
        ) from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint {str(directory)!r} has format {meta.get('format') if isinstance(meta, dict) else None!r}, "
            f"expected {FORMAT!r}: it was not written by this version of merak-core"
        )
    return meta


def dcp_metadata(directory: Path) -> dict[str, Any]:
    try:
        return dict(dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata)
    except Exception as exc:  # noqa: BLE001 - any unreadable metadata is a corrupt checkpoint
        raise CheckpointCorruptError(
            f"checkpoint {str(directory)!r} is corrupt: cannot read DCP metadata: {exc}"
        ) from exc


def describe_failure(exc: BaseException) -> str:
    """A short text for an exception of a DCP call (``CheckpointException`` lists every failing rank)."""
    failures = getattr(exc, "failures", None)
    if isinstance(exc, dcp.CheckpointException) and isinstance(failures, dict):
        parts = []
        for rank, pair in sorted(failures.items()):
            err = pair[0] if isinstance(pair, tuple) else pair
            parts.append(f"rank {rank}: {type(err).__name__}: {err}")
        return "; ".join(parts)
    return f"{type(exc).__name__}: {exc}"


def is_corruption(exc: BaseException) -> bool:
    """True when a DCP failure (on any rank) is a :class:`CheckpointCorruptError` raised while reading files."""
    if isinstance(exc, CheckpointCorruptError):
        return True
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict):
        return False
    return any(
        isinstance(pair[0] if isinstance(pair, tuple) else pair, CheckpointCorruptError)
        for pair in failures.values()
    )


def _check_fingerprint(
    directory: Path, saved: Mapping[str, Any], mine: Mapping[str, tuple[int, ...]]
) -> None:
    """Refuse a checkpoint of another model (names or full shapes differ), naming each difference and the fix."""
    theirs = {name: tuple(shape) for name, shape in saved.items()}
    missing = sorted(set(mine) - set(theirs))
    extra = sorted(set(theirs) - set(mine))
    shapes = sorted(
        f"parameter {n}: checkpoint {list(theirs[n])} vs model {list(mine[n])}"
        for n in set(mine) & set(theirs)
        if theirs[n] != tuple(mine[n])
    )
    if missing or extra or shapes:
        detail = []
        if missing:
            detail.append(
                f"parameters missing from the checkpoint: {missing[:8]}{' ...' if len(missing) > 8 else ''}"
            )
        if extra:
            detail.append(
                f"parameters the model does not have: {extra[:8]}{' ...' if len(extra) > 8 else ''}"
            )
        if shapes:
            detail.append(f"shape mismatches: {shapes[:8]}{' ...' if len(shapes) > 8 else ''}")
        raise CheckpointError(
            f"checkpoint {str(directory)!r} (step {_step_of(directory)}) was written for another model: "
            + "; ".join(detail)
            + ". Model shapes (layer sizes, layer counts, the vocabulary) cannot change on resume. Load a "
            "checkpoint of this model (same logical names and full shapes): build the model with the sizes of "
            "the job that wrote it, or start a new run in another output_dir and import only the matching "
            "weights with load_full_state_dict(..., strict=False)"
        )


def check_checkpoint_arg(command: str, checkpoint: str, output_dir: str) -> None:
    """Refuse a ``--checkpoint`` of ``command`` (``merak eval``, ``merak generate``) that names nothing.

    ``latest``/``auto`` need a committed checkpoint under ``output_dir/checkpoints``; a path must exist,
    as given or under that folder (or be a ``latest`` pointer). Checked before torchrun starts.
    """
    root = Path(output_dir) / "checkpoints"
    if checkpoint in ("latest", "auto"):
        if not latest_candidates(root):
            raise ValueError(
                f"{command} --checkpoint {checkpoint}: {str(root)!r} holds no checkpoint; train with "
                "training.save_steps set, or pass --checkpoint PATH"
            )
    elif (
        pointer_root(checkpoint) is None
        and not Path(checkpoint).exists()
        and not (root / checkpoint).exists()
    ):
        raise ValueError(
            f"{command} --checkpoint {checkpoint!r}: no such checkpoint (neither that path nor "
            f"{str(root / checkpoint)!r} exists); pass a step_<N> directory or 'latest'"
        )
