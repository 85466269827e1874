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
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from merak_core.checkpoint.files import (
    CheckpointCorruptError,
    CheckpointError,
    dcp_metadata,
    describe_failure,
    is_corruption,
    latest_candidates,
    pointer_root,
    read_checkpoint_meta,
)
from merak_core.checkpoint.integrity import VerifyingReader, check_manifest
from merak_core.checkpoint.parts import CheckpointParts
from merak_core.checkpoint.specs import TensorSpec, model_fingerprint, tensor_specs
from merak_core.parallel.compose import gather_full_state_dict
from merak_core.parallel.fsdp import copy_into_shard_

logger = logging.getLogger(__name__)


def _open_source(source: Mapping[str, torch.Tensor] | str | os.PathLike[str]) -> tuple[Any, list[str]]:
    """(getter name -> tensor-like supporting slicing, names) for a state dict, safetensors or torch.save file."""
    if isinstance(source, Mapping):
        return source.__getitem__, list(source)
    path = Path(source)
    if path.is_dir() or pointer_root(path) is not None:  # a checkpoint, or a 'latest' pointer
        state = read_checkpoint_model(path)
        return state.__getitem__, list(state)
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


def _read_shard(entry: Any, spec: TensorSpec) -> torch.Tensor:
    """This rank's shard from a full tensor or a safetensors slice, reading only that part when possible."""
    if isinstance(entry, torch.Tensor):
        return spec.slice_full(entry)
    shape = tuple(entry.get_shape())
    if spec.dim is None or shape != spec.full_shape or spec.expert is not None:
        return spec.slice_full(entry[:])
    index: list[slice] = [slice(None)] * len(shape)
    blocks = []
    section = shape[spec.dim] // spec.sections
    width = section // spec.tp
    for s in range(spec.sections):
        lo = s * section + spec.tp_rank * width
        index[spec.dim] = slice(lo, lo + width)
        blocks.append(entry[tuple(index)])
    part = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=spec.dim)
    return part.t() if spec.transposed else part


def load_full_state_dict(
    parts: CheckpointParts,
    source: Mapping[str, torch.Tensor] | str | os.PathLike[str],
    *,
    strict: bool = True,
) -> list[str]:
    """Load single-device weights (a state dict, a ``torch.save`` file or ``.safetensors``) into any layout.

    ``parts``: the run's :class:`CheckpointParts` (``trainer.checkpoint_parts``).

    ``source`` may also be a checkpoint directory or a ``latest`` pointer
    (``.../checkpoints/latest``): its model weights only, verified (see :func:`read_checkpoint_model`;
    every rank reads the whole model then).

    Each rank reads only its own stage's parameters and slices only its own TP block
    (safetensors and ``torch.save`` files are memory-mapped, so other ranks' parts are
    never materialised). Names are logical names (the unsharded model's). With
    ``strict`` every parameter of the model must be present and nothing else; returns
    the names of the model's parameters that were not in ``source`` (``strict=False``).
    Collective (the model fingerprint is agreed once); optimizer state is left as is.
    """
    mine = model_fingerprint(parts)
    getter, names = _open_source(source)
    available = set(names)
    missing = sorted(set(mine) - available)
    unexpected = sorted(available - set(mine))
    if strict and (missing or unexpected):
        raise ValueError(
            f"state dict does not match the model: missing {missing[:8]}{' ...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}; names must be the unsharded "
            "model's parameter names (pass strict=False to load the matching ones)"
        )
    with torch.no_grad():
        for name, (p, spec) in tensor_specs(parts).items():
            if name not in available:
                continue
            entry = getter(name)
            shape = tuple(entry.shape) if isinstance(entry, torch.Tensor) else tuple(entry.get_shape())
            if shape != spec.full_shape:
                raise ValueError(
                    f"parameter {name!r}: the state dict holds shape {list(shape)}, the model "
                    f"{list(spec.full_shape)}: load weights of the same architecture"
                )
            copy_into_shard_(p, _read_shard(entry, spec))  # ZeRO-2/3: this DP rank's part
    return missing


def read_checkpoint_model(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The full logical parameters of a checkpoint, in this process only (no collectives).

    ``path``: a checkpoint directory, or a ``latest`` pointer (``.../checkpoints/latest``,
    or the checkpoints directory): then the newest checkpoint whose files verify, each
    corrupt one skipped with a warning (see [Note: latest] in ``merak_core.checkpoint``).
    Every file read is checked against the checkpoint's manifest of checksums.
    """
    root = pointer_root(path)
    if root is None:
        return _read_model(Path(path))
    candidates = latest_candidates(root)
    if not candidates:
        raise CheckpointError(f"no checkpoint under {str(root)!r}: it holds no committed step_<N> directory")
    skipped = []
    for directory in candidates:
        try:
            return _read_model(directory)
        except CheckpointCorruptError as exc:
            skipped.append(f"{directory.name}: {exc}")
            logger.warning("%s: skipping checkpoint %s, it fails verification: %s", path, directory, exc)
    raise CheckpointCorruptError(
        f"no checkpoint under {str(root)!r} verifies; skipped: " + " | ".join(skipped)
    )


def _read_model(directory: Path) -> dict[str, torch.Tensor]:
    meta = read_checkpoint_meta(directory)
    manifest = check_manifest(directory, meta)
    available = dcp_metadata(directory)
    request: dict[str, Any] = {}
    for key, md in available.items():
        if key.startswith("model/") and isinstance(md, TensorStorageMetadata):
            request[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        elif key.startswith("model/") and isinstance(md, BytesStorageMetadata):  # pragma: no cover
            raise CheckpointError(f"checkpoint {str(directory)!r}: {key} is not a tensor")
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(
                request,
                storage_reader=VerifyingReader(str(directory), manifest, meta.get("step")),
                no_dist=True,
            )
    except (Exception, dcp.CheckpointException) as exc:
        kind = CheckpointCorruptError if is_corruption(exc) else CheckpointError
        raise kind(
            f"checkpoint {str(directory)!r} is corrupt or unreadable: {describe_failure(exc)}"
        ) from exc
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
