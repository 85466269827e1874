"""Checkpoints with torch.distributed.checkpoint (DCP): atomic, retained, reshardable across layouts.

::

    trainer.checkpoints.save()            # output_dir/checkpoints/step_<N>, every rank
    step = trainer.resume("latest")       # or a directory; any (dp, tp, pp) layout
    load_full_state_dict(trainer, "model.safetensors")   # single-device weights (weights.py)
    export_full_state_dict("out/checkpoints/step_8", "model.pt")

[Note: checkpoint keys] A checkpoint is a DCP directory whose keys do not depend
on the layout that wrote it, so any layout can read it:

- ``model/<logical name>``: the full logical parameter (see [Note: logical names]
  in compose.py), in the user's unsharded model's shape and orientation. A
  TP-sharded parameter is saved as a ``DTensor`` on the 1-D TP mesh with
  ``Shard(_merak_tp_dim)``, so each TP rank writes only its block and DCP records
  the chunk offsets; replicated parameters are plain tensors. DP replicas and the
  copies of a parameter tied across stages write the same chunks, which DCP's
  planner deduplicates, so each chunk is stored once. A fused parameter
  (``_merak_tp_sections > 1``: its shard is several blocks of the full tensor) is
  gathered over TP and saved whole.
- ``optim/<logical name>/<state key>``: optimizer state (AdamW ``exp_avg``,
  ``exp_avg_sq``, ``step``). States shaped like the parameter are sharded like it;
  other tensors (the step count) are plain, non-tensors are pickled. Under ZeRO-1 only the owning DP rank writes.
- ``train_state`` (pickled, written by rank 0): step, LR scheduler, optimizer
  hyper-parameters per group, data-loader position.
- ``rng/rank_<r>`` (pickled, per rank): torch CPU/CUDA, Python and NumPy RNG states.
  Restored only under the same (dp, tp, pp) layout (elsewhere ranks do not correspond).

Next to the DCP files, ``merak_checkpoint.json`` holds the step, the layout, the
``TrainingArguments`` and the model fingerprint (every logical name with its full
shape), checked before anything is read so a checkpoint of another model is
rejected with the differences named.

[Note: atomic commit] ``save`` writes into ``step_<N>.tmp``; after every rank's DCP
write has finished (DCP's final gather, then a barrier) rank 0 renames it to
``step_<N>`` and replaces the ``latest`` pointer with ``os.replace``. A crash at
any point leaves the previous committed checkpoint and pointer intact; a leftover
``.tmp`` is never loaded and is removed by the next save of that step.
``save_total_limit`` keeps the newest K committed checkpoints.

Every collective here runs on groups created with a timeout (the default group,
the layout's groups); barriers use ``monitored_barrier`` on gloo, which names the
rank that did not arrive.

Not done here: asynchronous saving, and checkpoints of models other than through
a :class:`~merak_core.trainer.Trainer`.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import re
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

if TYPE_CHECKING:
    from merak_core.trainer import Trainer

logger = logging.getLogger(__name__)

FORMAT = "merak-dcp-1"
META_FILE = "merak_checkpoint.json"
LATEST_FILE = "latest"
_STEP_RE = re.compile(r"^step_(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint is missing, partial, corrupt or belongs to another model; the message names the path."""


# ---------------------------------------------------------------------------- shard specs


class _Spec:
    """How one local parameter relates to its full logical tensor (see [Note: checkpoint keys])."""

    def __init__(self, param: torch.Tensor, tp: int, tp_rank: int) -> None:
        dim = getattr(param, "_merak_tp_dim", None) if tp > 1 else None
        self.transposed = bool(getattr(param, "_merak_tp_transposed", False)) and param.ndim == 2
        self.sections = int(getattr(param, "_merak_tp_sections", 1) or 1)
        self.tp, self.tp_rank = tp, tp_rank
        local_shape = list(param.shape)
        if dim is not None:
            local_shape[dim] *= tp
        if self.transposed:
            local_shape.reverse()
            dim = None if dim is None else 1 - dim
        self.dim: int | None = dim  # the sharded dim in the checkpoint's orientation
        self.full_shape = tuple(local_shape)

    @property
    def whole(self) -> bool:
        """Saved and loaded as one full tensor (replicated, or fused sections gathered over TP)."""
        return self.dim is None or self.sections > 1

    def oriented(self, local: torch.Tensor) -> torch.Tensor:
        return local.t() if self.transposed else local

    def slice_full(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the full tensor, in the parameter's own orientation (a view where possible)."""
        if self.dim is not None:
            parts = full.chunk(self.sections, dim=self.dim) if self.sections > 1 else (full,)
            blocks = [part.chunk(self.tp, dim=self.dim)[self.tp_rank] for part in parts]
            full = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=self.dim)
        return full.t() if self.transposed else full


def _specs(trainer: Trainer) -> dict[str, tuple[nn.Parameter, _Spec]]:
    layout = trainer.layout
    out: dict[str, tuple[nn.Parameter, _Spec]] = {}
    for name, p in trainer.model.named_parameters():
        out.setdefault(name, (p, _Spec(p, layout.tp, layout.tp_rank)))
    return out


def _to_checkpoint(trainer: Trainer, tensor: torch.Tensor, spec: _Spec, like: nn.Parameter) -> torch.Tensor | None:
    """What this rank writes for ``tensor`` (a parameter or a state shaped like it); collective over TP."""
    layout = trainer.layout
    if spec.dim is None:
        return spec.oriented(tensor.detach())
    if spec.sections > 1:
        import merak_tp

        full = merak_tp.gather_tensor(tensor.detach(), like=like, group=layout.tp_group)
        return spec.oriented(full) if layout.tp_rank == 0 else None
    from torch.distributed.tensor import DTensor, Shard

    local = spec.oriented(tensor.detach())
    return DTensor.from_local(local, layout.mesh["tp"], [Shard(spec.dim)], run_check=False,
                              shape=torch.Size(spec.full_shape), stride=_contiguous_stride(spec.full_shape))


def _load_target(trainer: Trainer, spec: _Spec, local: torch.Tensor, dtype: torch.dtype) -> tuple[Any, torch.Tensor]:
    """(object DCP loads into, tensor that receives the full data) for a local tensor shaped like a param."""
    if spec.whole:
        full = torch.empty(spec.full_shape, dtype=dtype, device=local.device)
        return full, full
    from torch.distributed.tensor import DTensor, Shard

    buf = torch.empty(spec.oriented(local).shape, dtype=dtype, device=local.device)
    dt = DTensor.from_local(buf, trainer.layout.mesh["tp"], [Shard(spec.dim or 0)], run_check=False,
                            shape=torch.Size(spec.full_shape), stride=_contiguous_stride(spec.full_shape))
    return dt, buf


def _from_loaded(spec: _Spec, loaded: torch.Tensor) -> torch.Tensor:
    """The local shard (parameter orientation) from what ``_load_target`` received."""
    if spec.whole:
        return spec.slice_full(loaded)
    return spec.oriented(loaded)


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(1, size)
    return tuple(reversed(stride))


# ---------------------------------------------------------------------------- helpers


def _describe_failure(exc: BaseException) -> str:
    """A short text for an exception of a DCP call (``CheckpointException`` lists every failing rank)."""
    failures = getattr(exc, "failures", None)
    if isinstance(exc, dcp.CheckpointException) and isinstance(failures, dict):
        parts = []
        for rank, pair in sorted(failures.items()):
            err = pair[0] if isinstance(pair, tuple) else pair
            parts.append(f"rank {rank}: {type(err).__name__}: {err}")
        return "; ".join(parts)
    return f"{type(exc).__name__}: {exc}"


def _inner_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds state (ZeRO-1 wraps one over the owned shard)."""
    return getattr(optimizer, "inner", optimizer)


def _barrier(what: str) -> None:
    """A barrier that names the missing rank on gloo (``monitored_barrier``); timeouts of the default group."""
    if dist.get_world_size() == 1:
        return
    if dist.get_backend() == "gloo":
        try:
            dist.monitored_barrier(wait_all_ranks=True)
        except RuntimeError as exc:
            raise RuntimeError(f"rank {dist.get_rank()}: barrier '{what}' failed: {exc}") from exc
    else:
        dist.barrier()


def _rng_state() -> bytes:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy is optional
        pass
    return pickle.dumps(state)


def _set_rng_state(blob: bytes) -> None:
    state = pickle.loads(blob)  # noqa: S301 - our own checkpoint (see the merak-core README, "Limits": trust)
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


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
        raise CheckpointError(
            f"checkpoint {str(directory)!r} is partial or not a Merak checkpoint: {META_FILE} is missing"
        )
    if not (directory / ".metadata").is_file():
        raise CheckpointError(f"checkpoint {str(directory)!r} is partial: DCP's .metadata file is missing")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {str(directory)!r} is corrupt: cannot read {META_FILE}: {exc}") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint {str(directory)!r} has format {meta.get('format') if isinstance(meta, dict) else None!r}, "
            f"expected {FORMAT!r}: it was not written by this version of merak-core"
        )
    return meta


def _dcp_metadata(directory: Path) -> dict[str, Any]:
    try:
        return dict(dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata)
    except Exception as exc:  # noqa: BLE001 - any unreadable metadata is a corrupt checkpoint
        raise CheckpointError(f"checkpoint {str(directory)!r} is corrupt: cannot read DCP metadata: {exc}") from exc


def _check_fingerprint(directory: Path, saved: Mapping[str, Any], mine: Mapping[str, tuple[int, ...]]) -> None:
    theirs = {name: tuple(shape) for name, shape in saved.items()}
    missing = sorted(set(mine) - set(theirs))
    extra = sorted(set(theirs) - set(mine))
    shapes = sorted(f"{n}: checkpoint {list(theirs[n])} vs model {list(mine[n])}"
                    for n in set(mine) & set(theirs) if theirs[n] != tuple(mine[n]))
    if missing or extra or shapes:
        detail = []
        if missing:
            detail.append(f"parameters missing from the checkpoint: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        if extra:
            detail.append(f"parameters the model does not have: {extra[:8]}{' ...' if len(extra) > 8 else ''}")
        if shapes:
            detail.append(f"shape mismatches: {shapes[:8]}{' ...' if len(shapes) > 8 else ''}")
        raise CheckpointError(
            f"checkpoint {str(directory)!r} was written for another model: " + "; ".join(detail)
            + ". Load a checkpoint of this model (same logical names and full shapes), or import only "
            "matching weights with load_full_state_dict(..., strict=False)"
        )


# ---------------------------------------------------------------------------- the manager


class CheckpointManager:
    """Save and load a :class:`~merak_core.trainer.Trainer`'s whole state (see the module docstring).

    Collective: every rank calls ``save``/``load`` at the same point. Checkpoints go to
    ``args.output_dir/checkpoints``; ``save_total_limit`` bounds how many are kept.
    """

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self._fingerprint: dict[str, tuple[int, ...]] | None = None

    @property
    def root(self) -> Path:
        """The directory holding ``step_<N>`` checkpoints and the ``latest`` pointer."""
        return Path(self.trainer.args.output_dir) / "checkpoints"

    def checkpoints(self) -> list[Path]:
        """Committed checkpoint directories, oldest first."""
        return [p for _, p in _step_dirs(self.root)]

    def latest(self) -> Path | None:
        """The checkpoint ``latest`` points to (the newest committed one if the pointer is missing)."""
        pointer = self.root / LATEST_FILE
        if pointer.is_file():
            name = pointer.read_text().strip()
            target = self.root / name
            if name and target.is_dir():
                return target
        dirs = self.checkpoints()
        return dirs[-1] if dirs else None

    def fingerprint(self) -> dict[str, tuple[int, ...]]:
        """Every logical parameter name with its full shape, over all stages (collective once, then cached)."""
        if self._fingerprint is None:
            local = {name: spec.full_shape for name, (_, spec) in _specs(self.trainer).items()}
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, local)
            merged: dict[str, tuple[int, ...]] = {}
            for part in gathered:
                merged.update(part)
            self._fingerprint = dict(sorted(merged.items()))
        return self._fingerprint

    # ------------------------------------------------------------------ save

    def save(self) -> Path:
        """Write ``step_<global_step>`` (see [Note: atomic commit]); returns the committed directory."""
        trainer = self.trainer
        step = trainer.global_step
        fingerprint = self.fingerprint()
        final = self.root / f"step_{step}"
        tmp = self.root / f"step_{step}.tmp"
        rank = dist.get_rank()
        start = time.perf_counter()
        if rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        _barrier("checkpoint directory created")
        state = self._state_dict_to_save()
        try:
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp)))
        except (Exception, dcp.CheckpointException) as exc:
            raise RuntimeError(f"rank {rank}: writing checkpoint {str(tmp)!r} failed (the previous checkpoint "
                               f"is untouched): {_describe_failure(exc)}") from exc
        _barrier("checkpoint written")
        if rank == 0:
            layout = trainer.layout
            meta = {
                "format": FORMAT, "step": step, "time": time.time(), "torch": torch.__version__,
                "layout": {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp, "world_size": layout.world_size},
                "zero_stage": trainer.args.zero_stage, "training_arguments": trainer.args.to_dict(),
                "fingerprint": {name: list(shape) for name, shape in fingerprint.items()},
            }
            _atomic_write(tmp / META_FILE, json.dumps(meta, indent=1, default=str))
            self._commit(tmp, final)
            self._prune()
        _barrier("checkpoint committed")
        logger.info("saved checkpoint %s in %.2f s", final, time.perf_counter() - start)
        return final

    def _commit(self, tmp: Path, final: Path) -> None:
        _fsync_dir(tmp)
        old = final.with_name(final.name + ".old")
        if final.exists():  # re-saving a step (e.g. right after a resume): keep the old one until the swap
            if old.exists():
                shutil.rmtree(old)
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(self.root)
        _atomic_write(self.root / LATEST_FILE, final.name + "\n")
        if old.exists():
            shutil.rmtree(old)

    def _prune(self) -> None:
        limit = self.trainer.args.save_total_limit
        if not limit:
            return
        dirs = self.checkpoints()
        for path in dirs[:-limit]:
            logger.info("removing old checkpoint %s (save_total_limit=%d)", path, limit)
            shutil.rmtree(path, ignore_errors=True)

    def _state_dict_to_save(self) -> dict[str, Any]:
        trainer = self.trainer
        state: dict[str, Any] = {}
        specs = _specs(trainer)
        for name, (p, spec) in specs.items():
            value = _to_checkpoint(trainer, p, spec, p)
            if value is not None:
                state[f"model/{name}"] = value
        inner = _inner_optimizer(trainer.optimizer)
        names = {id(p): name for name, (p, _) in specs.items()}
        for group in inner.param_groups:
            for p in group["params"]:
                owner_name = names.get(id(p))
                if owner_name is None:
                    continue
                name = owner_name
                spec = specs[name][1]
                for key, value in sorted(inner.state.get(p, {}).items()):
                    if not isinstance(value, torch.Tensor):  # e.g. SGD's momentum_buffer=None: pickled
                        state[f"optim/{name}/{key}"] = pickle.dumps(value)
                        continue
                    if value.shape == p.shape and value.ndim > 0:
                        out = _to_checkpoint(trainer, value, spec, p)
                    else:
                        out = value.detach().clone()
                    if out is not None:
                        state[f"optim/{name}/{key}"] = out
        if dist.get_rank() == 0:
            groups = [{k: v for k, v in g.items() if k != "params"} for g in trainer.optimizer.param_groups]
            train_state = {
                "step": trainer.global_step, "scheduler": trainer.lr_scheduler.state_dict(), "param_groups": groups,
                "data": trainer.train_loader.state_dict() if trainer.train_loader is not None else None,
            }
            state["train_state"] = pickle.dumps(train_state)
        state[f"rng/rank_{dist.get_rank()}"] = _rng_state()
        return state

    # ------------------------------------------------------------------ load

    def resolve(self, path: str | os.PathLike[str] = "latest") -> Path | None:
        """The checkpoint directory for ``path``: ``latest``, ``auto`` (None when there is none), a directory."""
        text = str(path)
        if text in ("latest", "auto"):
            found = self.latest()
            if found is None and text == "latest":
                raise CheckpointError(
                    f"no checkpoint to resume from: {str(self.root)!r} holds no committed step_<N> directory "
                    "(set save_steps to write checkpoints, or pass a checkpoint directory)"
                )
            return found
        candidate = Path(text)
        if not candidate.exists() and (self.root / text).exists():
            candidate = self.root / text
        return candidate

    def load(self, path: str | os.PathLike[str] = "latest") -> int:
        """Restore everything saved by :meth:`save` (any layout); returns the checkpoint's step.

        ``path``: a checkpoint directory, ``latest``, or ``auto`` (``latest`` if one
        exists, else nothing is loaded and the current step is returned).
        """
        directory = self.resolve(path)
        if directory is None:
            logger.info("resume=auto: no checkpoint under %s, starting from scratch", self.root)
            return self.trainer.global_step
        meta = read_checkpoint_meta(directory)
        _check_fingerprint(directory, meta.get("fingerprint", {}), self.fingerprint())
        available = _dcp_metadata(directory)
        trainer = self.trainer
        layout = trainer.layout
        saved_layout = meta.get("layout", {})
        same_layout = (saved_layout.get("dp"), saved_layout.get("tp"), saved_layout.get("pp")) == (
            layout.dp, layout.tp, layout.pp)
        specs = _specs(trainer)
        request: dict[str, Any] = {}
        receivers: dict[str, tuple[torch.Tensor, _Spec]] = {}
        for name, (p, spec) in specs.items():
            key = f"model/{name}"
            target, buf = _load_target(trainer, spec, p, p.dtype)
            request[key], receivers[key] = target, (buf, spec)
        inner = _inner_optimizer(trainer.optimizer)
        names = {id(p): name for name, (p, _) in specs.items()}
        optim_keys: dict[str, list[str]] = {}
        for key in available:
            if key.startswith("optim/"):
                name, _, state_key = key[len("optim/"):].rpartition("/")
                optim_keys.setdefault(name, []).append(state_key)
        owned: list[tuple[nn.Parameter, str]] = []
        for group in inner.param_groups:
            for p in group["params"]:
                owner_name = names.get(id(p))
                if owner_name is None:
                    continue
                name = owner_name
                owned.append((p, name))
                spec = specs[name][1]
                for state_key in optim_keys.get(name, []):
                    key = f"optim/{name}/{state_key}"
                    md = available[key]
                    if not isinstance(md, TensorStorageMetadata):
                        request[key] = b""  # a pickled non-tensor state
                        continue
                    dtype = md.properties.dtype
                    if tuple(md.size) == spec.full_shape and len(md.size) > 0:
                        target, buf = _load_target(trainer, spec, p, dtype)
                    else:
                        buf = torch.empty(tuple(md.size), dtype=dtype, device="cpu")
                        target, spec = buf, _Spec(buf, 1, 0)
                    request[key], receivers[key] = target, (buf, spec)
        rng_key = f"rng/rank_{dist.get_rank()}"
        if "train_state" not in available:
            raise CheckpointError(f"checkpoint {str(directory)!r} is corrupt: it has no 'train_state' entry")
        request["train_state"] = b""
        if same_layout and rng_key in available:
            request[rng_key] = b""
        try:
            dcp.load(request, storage_reader=dcp.FileSystemReader(str(directory)))
        except (Exception, dcp.CheckpointException) as exc:
            raise CheckpointError(
                f"rank {dist.get_rank()}: checkpoint {str(directory)!r} is corrupt or unreadable: "
                f"{_describe_failure(exc)}"
            ) from exc
        train_state = pickle.loads(request["train_state"])  # noqa: S301 - our own checkpoint
        self._restore_train_state(directory, train_state)  # checks first: fails before any tensor is copied
        with torch.no_grad():
            for name, (p, _) in specs.items():
                buf, spec = receivers[f"model/{name}"]
                p.copy_(_from_loaded(spec, buf))
            for p, name in owned:
                state = {}
                for state_key in optim_keys.get(name, []):
                    key = f"optim/{name}/{state_key}"
                    if key in receivers:
                        buf, spec = receivers[key]
                        value = _from_loaded(spec, buf)
                        state[state_key] = value.to(p.device) if value.ndim else value
                    elif key in request:
                        state[state_key] = pickle.loads(request[key])  # noqa: S301 - our own checkpoint
                if state:
                    inner.state[p] = state
        if rng_key in request:
            _set_rng_state(request[rng_key])
        else:
            logger.info("checkpoint layout %s differs from dp=%d tp=%d pp=%d: RNG states not restored",
                        saved_layout, layout.dp, layout.tp, layout.pp)
        _barrier("checkpoint loaded")
        step = int(train_state["step"])
        trainer.global_step = step
        logger.info("loaded checkpoint %s (step %d, saved under %s)", directory, step, saved_layout)
        return step

    def _restore_train_state(self, directory: Path, state: Mapping[str, Any]) -> None:
        """Data position, optimizer hyper-parameters and LR schedule; raises before changing anything."""
        trainer = self.trainer
        groups = state["param_groups"]
        if len(groups) != len(trainer.optimizer.param_groups):
            raise CheckpointError(
                f"checkpoint {str(directory)!r} has {len(groups)} optimizer parameter groups, this trainer "
                f"{len(trainer.optimizer.param_groups)}: resume with the same optimizer set-up"
            )
        if state.get("data") is not None and trainer.train_loader is not None:
            try:
                trainer.train_loader.load_state_dict(state["data"])  # checks everything before assigning
            except ValueError as exc:
                raise CheckpointError(f"checkpoint {str(directory)!r}: {exc}") from exc
        for group, saved in zip(trainer.optimizer.param_groups, groups, strict=True):
            group.update(saved)
        inner = _inner_optimizer(trainer.optimizer)
        if inner is not trainer.optimizer:
            for group, saved in zip(inner.param_groups, groups, strict=True):
                group.update(saved)
        trainer.lr_scheduler.load_state_dict(state["scheduler"])


__all__ = ["CheckpointError", "CheckpointManager", "read_checkpoint_meta"]
