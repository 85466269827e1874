"""Loading a checkpoint: which directory a path means, verifying it, and restoring every part of a run.

See [Note: latest] and [Note: checkpoint keys] in :mod:`merak_core.checkpoint`: any layout reads
any checkpoint, each rank asking DCP for its own blocks of the full logical tensors; the manifest's
checksums and the model fingerprint are checked before a tensor is copied.

Not done here: the fallback from a corrupt ``latest`` to an older checkpoint (``manager.py``),
saving (``save.py``), shard specs (``specs.py``), files and pointers (``files.py``).
"""

from __future__ import annotations

import logging
import os
import pickle
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from merak_core.checkpoint.files import (
    LATEST_FILE,
    CheckpointError,
    _check_fingerprint,
    dcp_metadata,
    latest_candidates,
    pointer_root,
)
from merak_core.checkpoint.frozen import base_fingerprint, check_base, frozen_names
from merak_core.checkpoint.integrity import open_verified, read_verified
from merak_core.checkpoint.ranks import barrier
from merak_core.checkpoint.regions import Region, RegionLoadPlanner, local_regions
from merak_core.checkpoint.specs import named_optimizer_params, tensor_specs
from merak_core.checkpoint.state import _inner_optimizer, restore_train_state, set_rng_state

if TYPE_CHECKING:
    from merak_core.checkpoint.parts import CheckpointParts

logger = logging.getLogger(__name__)

__all__ = ["checkpoint_candidates", "load_checkpoint", "place_optimizer_state"]


def checkpoint_candidates(
    home: Path, path: str | os.PathLike[str], *, warn: bool = False
) -> tuple[list[Path], bool]:
    """(directories to try in order, whether ``path`` meant 'the latest good one'); ``warn``: about a dangling pointer.

    ``home``: the run's checkpoints directory, where ``latest``, ``auto`` and bare names are looked up.
    """
    text = str(path)
    if text in ("latest", "auto"):
        return _warn_if_dangling(home, latest_candidates(home), warn), True
    root = pointer_root(text)
    if root is None and not Path(text).exists() and (home / text).exists():
        root = pointer_root(home / text)
        if root is None:
            return [home / text], False
    if root is not None:
        return _warn_if_dangling(root, latest_candidates(root), warn), True
    return [Path(text)], False


def load_checkpoint(
    parts: CheckpointParts, directory: Path, fingerprint: Callable[[], dict[str, tuple[int, ...]]]
) -> int:
    """Restore ``parts`` from the checkpoint ``directory`` (any layout); its step.

    Verified first (manifest, then ``fingerprint()``, the model's, against the saved one): a checkpoint
    that fails raises :class:`CheckpointCorruptError` or :class:`CheckpointError` before any tensor is
    copied. Collective.
    """
    meta, manifest = open_verified(directory)
    _check_fingerprint(directory, meta.get("fingerprint", {}), fingerprint())
    skip = _adapter_only_base(parts, directory, meta)
    available = dcp_metadata(directory)
    layout = parts.layout
    saved_layout = meta.get("layout", {})
    same_layout = (saved_layout.get("dp"), saved_layout.get("tp"), saved_layout.get("pp")) == (
        layout.dp,
        layout.tp,
        layout.pp,
    )
    rng_key = f"rng/rank_{dist.get_rank()}"
    if "train_state" not in available:
        raise CheckpointError(f"checkpoint {str(directory)!r} is corrupt: it has no 'train_state' entry")
    states: dict[str, Any] = {"train_state": b""}
    if same_layout and rng_key in available:
        states[rng_key] = b""
    verified: set[str] = set()
    _read(states, directory, manifest, meta, verified)
    train_state = pickle.loads(states["train_state"])  # noqa: S301 - our own checkpoint
    # Checks first: fails before any tensor is read (tensors are read into the parameters themselves).
    restore_train_state(parts, directory, train_state, meta.get("training_arguments", {}))
    request, regions, new_states, owned = _load_request(parts, available, skip)
    with torch.no_grad():  # the parameters receive their blocks in place
        _read(request, directory, manifest, meta, verified, regions)
    _set_optimizer_state(parts, owned, _state_keys(available), new_states, request)
    if rng_key in states:
        set_rng_state(states[rng_key], parts)
    else:
        logger.info(
            "checkpoint layout %s differs from dp=%d tp=%d pp=%d: RNG states not restored",
            saved_layout,
            layout.dp,
            layout.tp,
            layout.pp,
        )
    barrier("checkpoint loaded")
    step = int(train_state["step"])
    parts.train.global_step = step
    logger.info("loaded checkpoint %s (step %d, saved under %s)", directory, step, saved_layout)
    return step


def _read(
    request: dict[str, Any],
    directory: Path,
    manifest: Any,
    meta: Mapping[str, Any],
    verified: set[str],
    regions: Mapping[str, list[Region]] | None = None,
) -> None:
    """DCP's collective load of ``request`` and ``regions`` (every rank calls it), its files verified first
    (once per load)."""
    read_verified(
        request, directory, manifest, meta, verified=verified, planner=RegionLoadPlanner(regions or {})
    )


def _adapter_only_base(parts: CheckpointParts, directory: Path, meta: Mapping[str, Any]) -> set[str]:
    """The frozen names an adapter-only checkpoint does not hold (empty for any other), after checking this
    run's base against the one the adapters were trained on ([Note: adapter-only checkpoints]; collective)."""
    if not meta.get("adapter_only"):
        return set()
    if parts.model.lora is None:
        raise CheckpointError(
            f"checkpoint {str(directory)!r} holds a LoRA run's adapters only (no base weights): resume it "
            "with the same model.lora (and its model.pretrained base), or export it with merak export --merge"
        )
    check_base(directory, meta.get("base") or {}, base_fingerprint(parts), parts.pretrained)
    return frozen_names(parts)


def _load_request(
    parts: CheckpointParts, available: dict[str, Any], skip: set[str]
) -> tuple[dict[str, Any], dict[str, list[Region]], dict[str, torch.Tensor], list[tuple[nn.Parameter, str]]]:
    """What to ask DCP for: (request: plain and pickled entries, regions read into the rank's own tensors,
    the new state tensors by key, the owned parameters with their names).

    [Note: bounded checkpoint loads] (``regions.py``): a parameter receives its blocks in place; an
    optimizer state shaped like it is a new tensor on the parameter's device holding the same blocks (a
    DTensor sharded like it under ZeRO-2/3). Nothing is staged whole.
    """
    specs = tensor_specs(parts)
    request: dict[str, Any] = {}
    regions: dict[str, list[Region]] = {}
    for name, (p, spec) in specs.items():
        if name not in skip:  # a frozen base weight of an adapter-only checkpoint: the run's own base is kept
            regions[f"model/{name}"] = local_regions(p, spec)
    states: dict[str, torch.Tensor] = {}
    owned = named_optimizer_params(_inner_optimizer(parts.optimizer), specs)
    keys = _state_keys(available)
    for p, name in owned:
        param_spec = specs[name][1]
        for key in keys.get(name, []):
            md = available[key]
            if not isinstance(md, TensorStorageMetadata):
                request[key] = b""  # a pickled non-tensor state
            elif tuple(md.size) == param_spec.full_shape and len(md.size) > 0:
                states[key] = _empty_like_shard(p, md.properties.dtype)
                regions[key] = local_regions(states[key], param_spec)
            else:  # e.g. AdamW's 0-d step: a plain tensor, stored as it is
                request[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype, device="cpu")
    return request, regions, states, owned


def _state_keys(available: Mapping[str, Any]) -> dict[str, list[str]]:
    """The checkpoint's ``optim/<name>/<state key>`` keys by parameter name, in the checkpoint's order."""
    out: dict[str, list[str]] = {}
    for key in available:
        if key.startswith("optim/"):
            out.setdefault(key[len("optim/") :].rpartition("/")[0], []).append(key)
    return out


def _empty_like_shard(param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A new tensor of ``dtype`` holding what ``param`` holds (a DTensor sharded like it, or a plain one)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return torch.empty(param.shape, dtype=dtype, device=param.device)
    local = torch.empty(param.to_local().shape, dtype=dtype, device=param.device)
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def _set_optimizer_state(
    parts: CheckpointParts,
    owned: list[tuple[nn.Parameter, str]],
    keys: Mapping[str, list[str]],
    states: dict[str, torch.Tensor],
    request: dict[str, Any],
) -> None:
    """Every owned parameter's optimizer state from what was read (``keys``: the state keys by name)."""
    inner = _inner_optimizer(parts.optimizer)
    group_of = {id(q): group for group in inner.param_groups for q in group["params"]}
    for p, name in owned:
        state = {}
        for key in keys.get(name, []):
            if key not in states and key not in request:
                continue
            value = states[key] if key in states else request[key]
            state_key = key.rpartition("/")[2]
            if isinstance(value, torch.Tensor):
                state[state_key] = place_optimizer_state(value, state_key, p, group_of[id(p)])
            else:
                state[state_key] = pickle.loads(value)  # noqa: S301 - our own checkpoint
        if state:
            inner.state[p] = state


def place_optimizer_state(
    value: torch.Tensor, key: str, param: torch.Tensor, group: Mapping[str, Any]
) -> torch.Tensor:
    """Where ``Optimizer.load_state_dict`` would put a loaded state tensor, and in which dtype.

    [Note: optimizer state placement] The checkpoint writes states straight into
    ``optimizer.state`` (the layouts' shards are assembled here, not by torch), so it must
    follow torch's own rule: AdamW's ``step`` stays a CPU tensor unless the group is
    ``fused`` or ``capturable``, where the kernels read it on the parameter's device as
    float32 (a CPU ``step`` fails the first fused CUDA step after a resume); every other
    floating state takes the parameter's device and dtype.
    """
    if key == "step":
        if group.get("fused") or group.get("capturable"):
            return value.to(dtype=torch.float32, device=param.device)
        return value
    if value.is_floating_point() and param.is_floating_point():
        return value.to(dtype=param.dtype, device=param.device)
    return value.to(device=param.device)


def _warn_if_dangling(root: Path, candidates: list[Path], warn: bool) -> list[Path]:
    """Warn (rank 0, if ``warn``) when ``root/latest`` names a directory that is gone; ``candidates`` unchanged."""
    pointer = root / LATEST_FILE
    if not warn:
        return candidates
    name = pointer.read_text().strip() if pointer.is_file() else ""
    if name and not (root / name).is_dir() and (not dist.is_initialized() or dist.get_rank() == 0):
        instead = (
            f"using the newest committed checkpoint, {candidates[0].name}" if candidates else "none is left"
        )
        logger.warning(
            "the 'latest' pointer %s names %s, which does not exist (deleted?): %s", pointer, name, instead
        )
    return candidates
