"""Saving a checkpoint: refuse non-finite values, write with DCP into ``step_<N>.tmp``, commit, prune.

See [Note: atomic commit] and [Note: checkpoint keys] in :mod:`merak_core.checkpoint` for the
protocol and what the DCP files hold; [Note: finite checkpoints] in ``integrity.py`` for the
refusal. Collective: every rank calls :func:`save_checkpoint` at the same point.

Not done here: loading (``load.py``), which tensors a rank holds (``specs.py``), files and
pointers (``files.py``), checksums (``integrity.py``), RNG and hyper-parameters (``state.py``).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from merak_core.checkpoint.files import (
    FORMAT,
    LATEST_FILE,
    META_FILE,
    CheckpointError,
    _atomic_write,
    _fsync_dir,
    _step_dirs,
    describe_failure,
    latest_candidates,
)
from merak_core.checkpoint.frozen import base_fingerprint, frozen_names
from merak_core.checkpoint.integrity import RecordingWriter, file_checksum, nonfinite_count, nonfinite_names
from merak_core.checkpoint.ranks import barrier
from merak_core.checkpoint.specs import _to_checkpoint, named_optimizer_params, tensor_specs
from merak_core.checkpoint.state import _inner_optimizer, rng_state
from merak_core.parallel.fsdp import local_tensor

if TYPE_CHECKING:
    from merak_core.checkpoint.parts import CheckpointParts

logger = logging.getLogger(__name__)

__all__ = ["NonFiniteCheckpointError", "save_checkpoint"]


class NonFiniteCheckpointError(CheckpointError):
    """``save`` found NaN or inf in the parameters or optimizer states: nothing was written or committed."""


def save_checkpoint(parts: CheckpointParts, root: Path, fingerprint: dict[str, tuple[int, ...]]) -> Path:
    """Write ``root/step_<global_step>`` (see [Note: atomic commit]); returns the committed directory.

    ``fingerprint``: the model's (every rank's, :meth:`CheckpointManager.fingerprint`), recorded in the
    checkpoint's metadata.

    Raises :class:`NonFiniteCheckpointError` on every rank, before anything is written,
    when a parameter or optimizer state holds NaN or inf (see [Note: finite checkpoints]).
    """
    step = parts.train.global_step
    _check_finite(parts, root, step)
    final = root / f"step_{step}"
    tmp = root / f"step_{step}.tmp"
    rank = dist.get_rank()
    start = time.perf_counter()
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    barrier("checkpoint directory created")
    state = _state_dict(parts)
    writer = RecordingWriter(str(tmp))
    try:
        dcp.save(state, storage_writer=writer)
    except (Exception, dcp.CheckpointException) as exc:
        # DCP raises on every rank once every rank's writes are over: rank 0 removes the partial directory
        # (a full disk must not keep the partial files filling it).
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(
            f"rank {rank}: writing checkpoint {str(tmp)!r} failed (the previous checkpoint "
            f"is untouched, the partial directory removed): {describe_failure(exc)}"
        ) from exc
    barrier("checkpoint written")
    written: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(written, writer.written)
    # [Note: adapter-only checkpoints]: a LoRA run records which base its adapters were trained on.
    base = base_fingerprint(parts) if parts.model.lora is not None else None
    if rank == 0:
        files: dict[str, Any] = {}
        for part in written:
            files.update(part)
        files[".metadata"] = file_checksum(tmp / ".metadata")
        layout = parts.layout
        meta = {
            "format": FORMAT,
            "step": step,
            "time": time.time(),
            "torch": torch.__version__,
            "layout": {
                "dp": layout.dp,
                "tp": layout.tp,
                "pp": layout.pp,
                "world_size": layout.world_size,
            },
            "zero_stage": parts.args.zero_stage,
            "training_arguments": parts.args.to_dict(),
            "pretrained": parts.pretrained,
            "lora": None if parts.model.lora is None else dict(vars(parts.model.lora)),
            "adapter_only": base is not None,
            "base": None if base is None else {"pretrained": parts.pretrained, "fingerprint": base},
            "fingerprint": {name: list(shape) for name, shape in fingerprint.items()},
            "files": dict(sorted(files.items())),
        }
        try:
            _atomic_write(tmp / META_FILE, json.dumps(meta, indent=1, default=str))
        except OSError as exc:  # e.g. the disk filled up with the last file
            shutil.rmtree(tmp, ignore_errors=True)
            raise RuntimeError(
                f"rank 0: writing {META_FILE} of checkpoint {str(tmp)!r} failed (the previous checkpoint is "
                f"untouched, the partial directory removed): {describe_failure(exc)}"
            ) from exc
        _commit(root, tmp, final)
        _prune(root, parts.args.save_total_limit)
    barrier("checkpoint committed")
    logger.info("saved checkpoint %s in %.2f s", final, time.perf_counter() - start)
    return final


def _local_tensors(parts: CheckpointParts) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) for this rank's parameters and optimizer states."""
    specs = tensor_specs(parts)
    out: list[tuple[str, torch.Tensor]] = [
        (f"parameter {name}", local_tensor(p.detach())) for name, (p, _) in specs.items()
    ]
    names = {id(p): name for name, (p, _) in specs.items()}
    inner = _inner_optimizer(parts.optimizer)
    for p, values in inner.state.items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                out.append((f"optimizer state {names.get(id(p), '?')}/{key}", local_tensor(value)))
    return out


def _check_finite(parts: CheckpointParts, root: Path, step: int) -> None:
    """Refuse to save NaN/inf (see [Note: finite checkpoints]); one all-reduce of one number."""
    tensors = _local_tensors(parts)
    count = nonfinite_count([t for _, t in tensors], parts.device)
    dist.all_reduce(count)
    if float(count.item()) == 0:
        return
    bad: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(bad, nonfinite_names(tensors))
    named = [f"{name} (rank {rank})" for rank, names in enumerate(bad) for name in names]
    previous = latest_candidates(root)
    kept = (
        f"the previous checkpoint {previous[0].name} and the 'latest' pointer are unchanged"
        if previous
        else "no checkpoint was written"
    )
    raise NonFiniteCheckpointError(
        f"step {step}: refusing to save checkpoint step_{step} under {str(root)!r}: "
        f"{int(count.item())} tensors hold NaN or inf, first {named[:4]}{' ...' if len(named) > 4 else ''}; "
        f"a checkpoint with non-finite values is never committed, {kept}. Resume from an earlier checkpoint "
        "with a lower learning_rate or gradient clipping (max_grad_norm), or bf16 instead of float16"
    )


def _state_dict(parts: CheckpointParts) -> dict[str, Any]:
    state: dict[str, Any] = {}
    specs = tensor_specs(parts)
    frozen = frozen_names(parts)  # [Note: adapter-only checkpoints]: a LoRA run's base is not written
    for name, (p, spec) in specs.items():
        if name in frozen:
            continue
        value = _to_checkpoint(parts, p, spec, p)
        if value is not None:
            state[f"model/{name}"] = value
    inner = _inner_optimizer(parts.optimizer)
    for p, name in named_optimizer_params(inner, specs):
        spec = specs[name][1]
        for key, value in sorted(inner.state.get(p, {}).items()):
            if not isinstance(value, torch.Tensor):  # e.g. SGD's momentum_buffer=None: pickled
                state[f"optim/{name}/{key}"] = pickle.dumps(value)
                continue
            if value.shape == p.shape and value.ndim > 0:
                out = _to_checkpoint(parts, value, spec, p)
            else:
                out = value.detach().clone()
            if out is not None:
                state[f"optim/{name}/{key}"] = out
    if dist.get_rank() == 0:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in parts.optimizer.param_groups]
        train_state = {
            "step": parts.train.global_step,
            "scheduler": parts.lr_scheduler.state_dict(),
            "param_groups": groups,
            "data": parts.train_loader.state_dict() if parts.train_loader is not None else None,
        }
        state["train_state"] = pickle.dumps(train_state)
    state[f"rng/rank_{dist.get_rank()}"] = rng_state(parts)
    return state


def _commit(root: Path, tmp: Path, final: Path) -> None:
    _fsync_dir(tmp)
    old = final.with_name(final.name + ".old")
    if final.exists():  # re-saving a step (e.g. right after a resume): keep the old one until the swap
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(root)
    _atomic_write(root / LATEST_FILE, final.name + "\n")
    if old.exists():
        shutil.rmtree(old)


def _prune(root: Path, limit: int | None) -> None:
    if not limit:
        return
    dirs = [p for _, p in _step_dirs(root)]
    for path in dirs[:-limit]:
        logger.info("removing old checkpoint %s (save_total_limit=%d)", path, limit)
        shutil.rmtree(path, ignore_errors=True)
