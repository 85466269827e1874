"""Weights in and out of a Merak run, as single-device state dicts.

``load_full_state_dict(trainer.checkpoint_parts, source)`` loads a full (unsharded) state dict, a
``torch.save`` file or a safetensors file into any layout: each rank reads only
its own stage's tensors and its own TP slice (files are memory-mapped,
safetensors read through ``get_slice``). ``export_full_state_dict`` writes a
run's (its :class:`CheckpointParts`) or a checkpoint directory's logical parameters as one
single-device file; ``read_checkpoint_model`` reads them in one process. A run is handed as its
:class:`CheckpointParts`, never as the Trainer.

The checkpoint format itself lives in this package's ``__init__`` ([Note: checkpoint keys]).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from merak_core.checkpoint.files import (
    CheckpointCorruptError,
    CheckpointError,
    dcp_metadata,
    latest_candidates,
    pointer_root,
)
from merak_core.checkpoint.integrity import open_verified, read_verified, verify_all
from merak_core.checkpoint.parts import CheckpointParts
from merak_core.checkpoint.regions import RegionLoadPlanner, copy_regions_, local_regions
from merak_core.checkpoint.specs import model_fingerprint, tensor_specs
from merak_core.parallel.compose import gather_full_state_dict

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


def _open_source(source: Mapping[str, torch.Tensor] | str | os.PathLike[str]) -> tuple[Any, list[str]]:
    """(getter name -> tensor-like supporting slicing, names) for a state dict, safetensors or torch.save file."""
    if isinstance(source, Mapping):
        return source.__getitem__, list(source)
    path = Path(source)
    if not path.is_file():
        raise ValueError(f"state dict file {str(path)!r} does not exist")
    if path.suffix == ".safetensors":
        try:
            from safetensors import safe_open
        except ImportError as exc:
            raise ImportError(
                "reading .safetensors files needs the safetensors package: "
                "pip install 'merak-core[safetensors]'"
            ) from exc
        handle = safe_open(str(path), framework="pt")
        return handle.get_slice, list(handle.keys())
    loaded = torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)
    if not isinstance(loaded, Mapping):
        raise ValueError(f"{str(path)!r} holds a {type(loaded).__name__}, not a state dict of tensors")
    return loaded.__getitem__, list(loaded)


def load_full_state_dict(
    parts: CheckpointParts,
    source: Mapping[str, torch.Tensor] | str | os.PathLike[str],
    *,
    strict: bool = True,
) -> list[str]:
    """Load single-device weights (a state dict, a ``torch.save`` file or ``.safetensors``) into any layout.

    ``parts``: the run's :class:`CheckpointParts` (``trainer.checkpoint_parts``).

    ``source`` may also be a checkpoint directory or a ``latest`` pointer
    (``.../checkpoints/latest``, the newest checkpoint that verifies): its model weights only, the files
    read verified (see :func:`read_checkpoint_model`).

    Each rank reads only its own stage's parameters and, of each, only the elements it holds (its TP
    block, each section of a fused one, its ZeRO-2/3 rows), straight into the parameter (safetensors
    and ``torch.save`` files are memory-mapped, so other ranks' parts are never materialised; a
    checkpoint's are read through DCP, in each process alone). Names are logical names (the unsharded
    model's). With ``strict`` every parameter of the model must be present and nothing else; returns
    the names of the model's parameters that were not in ``source`` (``strict=False``).
    Collective (the model fingerprint is agreed once); optimizer state is left as is.
    """
    mine = model_fingerprint(parts)
    if not isinstance(source, Mapping) and (Path(source).is_dir() or pointer_root(source) is not None):
        return _newest_verified(
            source, lambda directory: _load_checkpoint_model(parts, directory, mine, strict)
        )
    getter, names = _open_source(source)
    available = set(names)
    missing = _check_names(mine, available, strict)
    with torch.no_grad():
        for name, (p, spec) in tensor_specs(parts).items():
            if name not in available:
                continue
            entry = getter(name)
            shape = tuple(entry.shape) if isinstance(entry, torch.Tensor) else tuple(entry.get_shape())
            _check_shape(name, shape, spec.full_shape)
            copy_regions_(local_regions(p, spec), entry.__getitem__)  # [Note: bounded checkpoint loads]
    return missing


def _check_names(mine: Mapping[str, Any], available: set[str], strict: bool) -> list[str]:
    """The model's names ``available`` lacks; with ``strict``, refuses any missing or unexpected name."""
    missing = sorted(set(mine) - available)
    unexpected = sorted(available - set(mine))
    if strict and (missing or unexpected):
        raise ValueError(
            f"state dict does not match the model: missing {missing[:8]}{' ...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}; names must be the unsharded "
            "model's parameter names (pass strict=False to load the matching ones)"
        )
    return missing


def _check_shape(name: str, shape: tuple[int, ...], full_shape: tuple[int, ...]) -> None:
    if shape != full_shape:
        raise ValueError(
            f"parameter {name!r}: the state dict holds shape {list(shape)}, the model "
            f"{list(full_shape)}: load weights of the same architecture"
        )


def _load_checkpoint_model(
    parts: CheckpointParts, directory: Path, mine: Mapping[str, Any], strict: bool
) -> list[str]:
    """A checkpoint's model weights into ``parts``: DCP reads this rank's blocks of each straight into its
    parameters (in this process alone; [Note: bounded checkpoint loads]); the names missing."""
    meta, manifest = open_verified(directory)
    verified = verify_all(directory, manifest, meta)  # every rank alike: all fall back from a corrupt one
    shapes = {
        key[len("model/") :]: tuple(md.size)
        for key, md in dcp_metadata(directory).items()
        if key.startswith("model/") and isinstance(md, TensorStorageMetadata)
    }
    missing = _check_names(mine, set(shapes), strict)
    regions = {}
    for name, (p, spec) in tensor_specs(parts).items():
        if name in shapes:
            _check_shape(name, shapes[name], spec.full_shape)
            regions[f"model/{name}"] = local_regions(p, spec)
    with torch.no_grad():
        planner = RegionLoadPlanner(regions)
        read_verified({}, directory, manifest, meta, verified=verified, planner=planner, one_process=True)
    return missing


def read_checkpoint_model(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The full logical parameters of a checkpoint, in this process only (no collectives).

    ``path``: a checkpoint directory, or a ``latest`` pointer (``.../checkpoints/latest``,
    or the checkpoints directory): then the newest checkpoint whose files verify, each
    corrupt one skipped with a warning (see [Note: latest] in ``merak_core.checkpoint``).
    Every file read is checked against the checkpoint's manifest of checksums.
    """
    return _newest_verified(path, _read_model)


def _newest_verified(path: str | os.PathLike[str], read: Callable[[Path], _T]) -> _T:
    """``read`` of the checkpoint ``path`` names, or for a ``latest`` pointer of the newest one that verifies
    (each corrupt one skipped with a warning)."""
    root = pointer_root(path)
    if root is None:
        return read(Path(path))
    candidates = latest_candidates(root)
    if not candidates:
        raise CheckpointError(f"no checkpoint under {str(root)!r}: it holds no committed step_<N> directory")
    skipped = []
    for directory in candidates:
        try:
            return read(directory)
        except CheckpointCorruptError as exc:
            skipped.append(f"{directory.name}: {exc}")
            logger.warning("%s: skipping checkpoint %s, it fails verification: %s", path, directory, exc)
    raise CheckpointCorruptError(
        f"no checkpoint under {str(root)!r} verifies; skipped: " + " | ".join(skipped)
    )


def _read_model(directory: Path) -> dict[str, torch.Tensor]:
    meta, manifest = open_verified(directory)
    request: dict[str, Any] = {}
    for key, md in dcp_metadata(directory).items():
        if key.startswith("model/") and isinstance(md, TensorStorageMetadata):
            request[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        elif key.startswith("model/") and isinstance(md, BytesStorageMetadata):  # pragma: no cover
            raise CheckpointError(f"checkpoint {str(directory)!r}: {key} is not a tensor")
    read_verified(request, directory, manifest, meta, one_process=True)
    return {key[len("model/") :]: value for key, value in sorted(request.items())}


def export_full_state_dict(
    source: CheckpointParts | str | os.PathLike[str], out_path: str | os.PathLike[str]
) -> dict[str, torch.Tensor] | None:
    """Write one single-device state dict (logical names) to ``out_path``; return it where it was built.

    ``source``: a checkpoint directory or a ``latest`` pointer such as ``out/checkpoints/latest``
    (read in this process alone, no collectives, verified; see :func:`read_checkpoint_model`) or a
    run's :class:`CheckpointParts` (``trainer.checkpoint_parts``; collective, rank 0 writes and gets the dict,
    other ranks get None). ``out_path`` ending in ``.safetensors`` is written with the
    safetensors package, anything else with ``torch.save``.
    """
    if isinstance(source, (str, os.PathLike)):
        state: dict[str, torch.Tensor] | None = read_checkpoint_model(source)
    else:
        state = gather_full_state_dict(source.model)
    if state is None:
        return None
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".safetensors":
        try:
            from safetensors.torch import save_file
        except ImportError as exc:
            raise ImportError(
                "writing .safetensors files needs the safetensors package: "
                "pip install 'merak-core[safetensors]', or export to a .pt file"
            ) from exc
        save_file({k: v.contiguous() for k, v in state.items()}, str(out))
    else:
        torch.save(state, str(out))
    return state


__all__ = ["export_full_state_dict", "load_full_state_dict", "read_checkpoint_model"]
