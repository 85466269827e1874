"""Checkpoint integrity: a checksum of every file, written at save, verified by the rank that reads it.

[Note: checkpoint manifest] ``merak_checkpoint.json`` carries ``files``: for every
other file of the directory (DCP's ``.metadata`` and each ``*.distcp``) its size
in bytes and its CRC-32 (``zlib.crc32``, hex). The checksums are computed where
the data is: each rank checksums the ``.distcp`` files it has just written
(:class:`RecordingWriter`), rank 0 gathers them and adds ``.metadata``.

At load, every rank first checks that each listed file exists with its listed
size and that ``.metadata`` matches (cheap, and the same verdict on every rank);
then :class:`VerifyingReader` checksums each ``.distcp`` file a rank is about to
read, before reading it, so a flipped byte fails with the file and the step
named instead of loading garbage. A failure on one rank reaches every rank
through DCP's own gather of read results. A checkpoint written before manifests
existed loads without verification (logged once).

[Note: finite checkpoints] ``save`` refuses to commit a checkpoint whose
parameters or optimizer states hold NaN or inf: every rank reduces its tensors'
``isfinite`` flags to one count, and one all-reduce of that count decides on
every rank before anything is written (see :func:`nonfinite_count`).

Not done here: which tensors are saved (``save.py``), the directory layout (``files.py``).
"""

from __future__ import annotations

import logging
import warnings
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from merak_core.checkpoint.files import (
    META_FILE,
    CheckpointCorruptError,
    CheckpointError,
    describe_failure,
    is_corruption,
    read_checkpoint_meta,
)

logger = logging.getLogger(__name__)

CHECKSUM = "crc32"
_CHUNK = 1 << 20


def file_checksum(path: Path) -> dict[str, Any]:
    """``{"bytes": size, "crc32": hex}`` of one file, read in chunks into one reused buffer (a load's
    host memory is bounded: [Note: bounded checkpoint loads] in ``regions.py``)."""
    crc, size = 0, 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb") as f:
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return {"bytes": size, CHECKSUM: f"{crc:08x}"}


def _mismatch(
    directory: Path, step: Any, name: str, expected: Mapping[str, Any], found: Mapping[str, Any]
) -> str:
    what = (
        f"has {found['bytes']} bytes, the manifest says {expected['bytes']}"
        if found["bytes"] != expected["bytes"]
        else f"has {CHECKSUM} {found[CHECKSUM]}, the manifest says {expected[CHECKSUM]}"
    )
    return (
        f"checkpoint {str(directory)!r} (step {step}) is corrupt: file {name!r} {what} (changed or damaged "
        "after the save): resume from an older checkpoint ('latest' skips corrupt ones)"
    )


def check_manifest(directory: Path, meta: Mapping[str, Any]) -> dict[str, Any] | None:
    """Every listed file exists with its size and ``.metadata`` matches; returns the manifest (None if absent)."""
    files = meta.get("files")
    step = meta.get("step", "?")
    if files is None:
        logger.info(
            "checkpoint %s has no manifest of checksums (written by an older version): not verified",
            directory,
        )
        return None
    for name, expected in sorted(files.items()):
        path = directory / name
        if not path.is_file():
            raise CheckpointCorruptError(
                f"checkpoint {str(directory)!r} (step {step}) is corrupt: file {name!r} listed in {META_FILE} "
                "is missing: resume from an older checkpoint ('latest' skips corrupt ones)"
            )
        size = path.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointCorruptError(_mismatch(directory, step, name, expected, {"bytes": size}))
    if ".metadata" in files:
        verify_file(directory, step, ".metadata", files[".metadata"])
    return dict(files)


def verify_file(directory: Path, step: Any, name: str, expected: Mapping[str, Any]) -> None:
    """Raise :class:`CheckpointCorruptError` naming ``name`` and ``step`` unless the file matches ``expected``."""
    found = file_checksum(directory / name)
    if found["bytes"] != expected["bytes"] or found[CHECKSUM] != expected[CHECKSUM]:
        raise CheckpointCorruptError(_mismatch(directory, step, name, expected, found))


class RecordingWriter(dcp.FileSystemWriter):
    """DCP's file writer that checksums the files this rank wrote (``written``: name -> entry)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.directory = Path(path)
        self.written: dict[str, dict[str, Any]] = {}

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        results = future.wait()  # a completed torch.futures.Future (the write is synchronous)
        for name in sorted({r.storage_data.relative_path for r in results}):
            self.written[name] = file_checksum(self.directory / name)
        return future


class VerifyingReader(dcp.FileSystemReader):
    """DCP's file reader that checksums each file against the manifest before reading from it."""

    def __init__(
        self, path: str, manifest: Mapping[str, Any] | None, step: Any, verified: set[str] | None = None
    ) -> None:
        super().__init__(path)
        self.directory = Path(path)
        self.manifest = manifest
        self.step = step
        self.verified = set() if verified is None else verified
        """Files already checked (shared by the reads of one load: each file is checksummed once)."""

    def read_data(self, plan: Any, planner: Any) -> Any:
        if self.manifest is not None:
            names = sorted({self.storage_data[item.storage_index].relative_path for item in plan.items})
            for name in names:
                if name in self.verified:
                    continue
                expected = self.manifest.get(name)
                if expected is None:
                    raise CheckpointCorruptError(
                        f"checkpoint {str(self.directory)!r} (step {self.step}) is corrupt: file {name!r} is not in "
                        f"the manifest of {META_FILE}: resume from an older checkpoint"
                    )
                verify_file(self.directory, self.step, name, expected)
                self.verified.add(name)
        return super().read_data(plan, planner)


def open_verified(directory: Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the checkpoint's metadata, its manifest) once the listed files are checked (:func:`check_manifest`)."""
    meta = read_checkpoint_meta(directory)
    return meta, check_manifest(directory, meta)


def verify_all(directory: Path, manifest: Mapping[str, Any] | None, meta: Mapping[str, Any]) -> set[str]:
    """Checksum every file of the manifest (the names checked): every process then judges the checkpoint
    alike, whichever files it goes on to read."""
    for name, expected in sorted((manifest or {}).items()):
        verify_file(directory, meta.get("step", "?"), name, expected)
    return set(manifest or {})


def read_verified(
    request: dict[str, Any],
    directory: Path,
    manifest: Mapping[str, Any] | None,
    meta: Mapping[str, Any],
    *,
    verified: set[str] | None = None,
    planner: Any = None,
    one_process: bool = False,
) -> None:
    """DCP's load of ``request`` from ``directory`` through :class:`VerifyingReader` (``verified``: the files
    already checksummed in this load); collective unless ``one_process``. A failure raises
    :class:`CheckpointCorruptError` (damaged data) or :class:`CheckpointError`, naming the directory."""
    try:
        reader = VerifyingReader(str(directory), manifest, meta.get("step"), verified)
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            if one_process:
                warnings.simplefilter("ignore", UserWarning)
            dcp.load(request, storage_reader=reader, planner=planner, no_dist=one_process)
    except (Exception, dcp.CheckpointException) as exc:
        kind = CheckpointCorruptError if is_corruption(exc) else CheckpointError
        where = "" if one_process else f"rank {dist.get_rank()}: "
        raise kind(
            f"{where}checkpoint {str(directory)!r} is corrupt or unreadable: {describe_failure(exc)}"
        ) from exc


def nonfinite_count(tensors: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """How many of this rank's floating tensors hold NaN or inf, as a 1-element float64 tensor on ``device``.

    The per-tensor flags stay on their device and are summed there: the only host sync
    is the caller's all-reduce of the result.
    """
    flags = [torch.isfinite(t).all().to(device) for t in tensors if t.is_floating_point() and t.numel()]
    if not flags:
        return torch.zeros(1, dtype=torch.float64, device=device)
    return (~torch.stack(flags)).sum().to(torch.float64).reshape(1)


def nonfinite_names(tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of the floating tensors that hold NaN or inf (error path only)."""
    return [
        n for n, t in tensors if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all())
    ]
