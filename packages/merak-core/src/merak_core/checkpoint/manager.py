"""CheckpointManager: save and load a run's whole state (:class:`CheckpointParts`) with DCP, any layout to any layout.

See the package docstring (``merak_core.checkpoint``) for the keys, the atomic
commit, the manifest and the ``latest`` pointer.

Not done here: shard specs (``specs.py``), files and pointers (``files.py``),
checksums and finiteness (``integrity.py``), RNG and hyper-parameters (``state.py``).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
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

from merak_core.checkpoint.files import (
    FORMAT,
    LATEST_FILE,
    META_FILE,
    CheckpointCorruptError,
    CheckpointError,
    _atomic_write,
    _check_fingerprint,
    _fsync_dir,
    _step_dirs,
    dcp_metadata,
    describe_failure,
    is_corruption,
    latest_candidates,
    pointer_root,
    read_checkpoint_meta,
)
from merak_core.checkpoint.integrity import (
    RecordingWriter,
    VerifyingReader,
    check_manifest,
    file_checksum,
    nonfinite_count,
    nonfinite_names,
)
from merak_core.checkpoint.specs import TensorSpec, _from_loaded, _load_target, _to_checkpoint, tensor_specs
from merak_core.checkpoint.state import _inner_optimizer, restore_train_state, rng_state, set_rng_state
from merak_core.fsdp import copy_into_shard_, local_tensor, shard_like

if TYPE_CHECKING:
    from merak_core.checkpoint.parts import CheckpointParts

logger = logging.getLogger(__name__)


class NonFiniteCheckpointError(CheckpointError):
    """``save`` found NaN or inf in the parameters or optimizer states: nothing was written or committed."""


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


def _warn_rank0(message: str, *args: Any) -> None:
    if dist.get_rank() == 0:
        logger.warning(message, *args)


class CheckpointManager:
    """Save and load the explicit state of a run, :class:`CheckpointParts` (see the package docstring).

    Collective: every rank calls ``save``/``load`` at the same point. Checkpoints go to
    ``args.output_dir/checkpoints``; ``save_total_limit`` bounds how many are kept.
    """

    def __init__(self, parts: CheckpointParts) -> None:
        self.parts = parts
        self._fingerprint: dict[str, tuple[int, ...]] | None = None

    @property
    def root(self) -> Path:
        """The directory holding ``step_<N>`` checkpoints and the ``latest`` pointer."""
        return Path(self.parts.args.output_dir) / "checkpoints"

    def checkpoints(self) -> list[Path]:
        """Committed checkpoint directories, oldest first."""
        return [p for _, p in _step_dirs(self.root)]

    def latest(self) -> Path | None:
        """The checkpoint ``latest`` points to (the newest committed one if the pointer is missing).

        Only what is on disk is looked at; :meth:`load` verifies the files and falls back
        to older checkpoints when this one is corrupt.
        """
        candidates = latest_candidates(self.root)
        return candidates[0] if candidates else None

    def fingerprint(self) -> dict[str, tuple[int, ...]]:
        """Every logical parameter name with its full shape, over all stages (collective once, then cached)."""
        if self._fingerprint is None:
            local = {name: spec.full_shape for name, (_, spec) in tensor_specs(self.parts).items()}
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, local)
            merged: dict[str, tuple[int, ...]] = {}
            for part in gathered:
                merged.update(part)
            self._fingerprint = dict(sorted(merged.items()))
        return self._fingerprint

    # ------------------------------------------------------------------ save

    def save(self) -> Path:
        """Write ``step_<global_step>`` (see [Note: atomic commit]); returns the committed directory.

        Raises :class:`NonFiniteCheckpointError` on every rank, before anything is written,
        when a parameter or optimizer state holds NaN or inf (see [Note: finite checkpoints]).
        """
        parts = self.parts
        step = parts.train.global_step
        fingerprint = self.fingerprint()
        self._check_finite(step)
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
        writer = RecordingWriter(str(tmp))
        try:
            dcp.save(state, storage_writer=writer)
        except (Exception, dcp.CheckpointException) as exc:
            raise RuntimeError(
                f"rank {rank}: writing checkpoint {str(tmp)!r} failed (the previous checkpoint "
                f"is untouched): {describe_failure(exc)}"
            ) from exc
        _barrier("checkpoint written")
        written: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(written, writer.written)
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
                "fingerprint": {name: list(shape) for name, shape in fingerprint.items()},
                "files": dict(sorted(files.items())),
            }
            _atomic_write(tmp / META_FILE, json.dumps(meta, indent=1, default=str))
            self._commit(tmp, final)
            self._prune()
        _barrier("checkpoint committed")
        logger.info("saved checkpoint %s in %.2f s", final, time.perf_counter() - start)
        return final

    def _local_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) for this rank's parameters and optimizer states."""
        specs = tensor_specs(self.parts)
        out: list[tuple[str, torch.Tensor]] = [
            (f"parameter {name}", local_tensor(p.detach())) for name, (p, _) in specs.items()
        ]
        names = {id(p): name for name, (p, _) in specs.items()}
        inner = _inner_optimizer(self.parts.optimizer)
        for p, values in inner.state.items():
            for key, value in values.items():
                if isinstance(value, torch.Tensor):
                    out.append((f"optimizer state {names.get(id(p), '?')}/{key}", local_tensor(value)))
        return out

    def _check_finite(self, step: int) -> None:
        """Refuse to save NaN/inf (see [Note: finite checkpoints]); one all-reduce of one number."""
        tensors = self._local_tensors()
        count = nonfinite_count([t for _, t in tensors], self.parts.device)
        dist.all_reduce(count)
        if float(count.item()) == 0:
            return
        bad: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(bad, nonfinite_names(tensors))
        named = [f"{name} (rank {rank})" for rank, names in enumerate(bad) for name in names]
        previous = latest_candidates(self.root)
        kept = (
            f"the previous checkpoint {previous[0].name} and the 'latest' pointer are unchanged"
            if previous
            else "no checkpoint was written"
        )
        raise NonFiniteCheckpointError(
            f"step {step}: refusing to save checkpoint step_{step} under {str(self.root)!r}: "
            f"{int(count.item())} tensors hold NaN or inf, first {named[:4]}{' ...' if len(named) > 4 else ''}; "
            f"a checkpoint with non-finite values is never committed, {kept}. Resume from an earlier checkpoint "
            "with a lower learning_rate or gradient clipping (max_grad_norm), or bf16 instead of float16"
        )

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
        limit = self.parts.args.save_total_limit
        if not limit:
            return
        dirs = self.checkpoints()
        for path in dirs[:-limit]:
            logger.info("removing old checkpoint %s (save_total_limit=%d)", path, limit)
            shutil.rmtree(path, ignore_errors=True)

    def _state_dict_to_save(self) -> dict[str, Any]:
        parts = self.parts
        state: dict[str, Any] = {}
        specs = tensor_specs(parts)
        for name, (p, spec) in specs.items():
            value = _to_checkpoint(parts, p, spec, p)
            if value is not None:
                state[f"model/{name}"] = value
        inner = _inner_optimizer(parts.optimizer)
        for p, name in _named_optimizer_params(inner, specs):
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

    # ------------------------------------------------------------------ load

    def _candidates(self, path: str | os.PathLike[str], *, warn: bool = False) -> tuple[list[Path], bool]:
        """(directories to try in order, whether ``path`` meant 'the latest good one'); ``warn``: about a dangling pointer."""
        text = str(path)
        if text in ("latest", "auto"):
            return _warn_if_dangling(self.root, latest_candidates(self.root), warn), True
        root = pointer_root(text)
        if root is None and not Path(text).exists() and (self.root / text).exists():
            root = pointer_root(self.root / text)
            if root is None:
                return [self.root / text], False
        if root is not None:
            return _warn_if_dangling(root, latest_candidates(root), warn), True
        return [Path(text)], False

    def resolve(self, path: str | os.PathLike[str] = "latest") -> Path | None:
        """The checkpoint directory for ``path`` as found on disk (no verification, no collectives).

        ``path``: ``latest`` or ``auto`` (in ``output_dir``; ``auto`` gives None when there is
        none), a ``.../checkpoints/latest`` pointer, a checkpoints directory, or a checkpoint
        directory. :meth:`load` verifies and falls back from a corrupt ``latest``.
        """
        candidates, is_latest = self._candidates(path)
        if not candidates:
            if str(path) == "auto":
                return None
            raise CheckpointError(
                f"no checkpoint to resume from: {str(self.root)!r} holds no committed step_<N> directory "
                "(set save_steps to write checkpoints, or pass a checkpoint directory)"
            )
        return candidates[0]

    def load(self, path: str | os.PathLike[str] = "latest") -> int:
        """Restore everything saved by :meth:`save` (any layout); returns the checkpoint's step.

        ``path``: see :meth:`resolve`. For ``latest`` (and ``auto``), a checkpoint whose files
        fail verification is skipped with a warning naming it and the next older one is
        tried; a named directory that fails raises :class:`CheckpointCorruptError`.
        """
        if self.resolve(path) is None:
            logger.info("resume=auto: no checkpoint under %s, starting from scratch", self.root)
            return self.parts.train.global_step
        candidates, is_latest = self._candidates(path, warn=True)
        skipped: list[str] = []
        for directory in candidates:
            try:
                return self._load_one(directory)
            except CheckpointCorruptError as exc:
                if not is_latest:
                    raise
                skipped.append(f"{directory.name}: {exc}")
                _warn_rank0(
                    "resume %s: skipping checkpoint %s, it fails verification: %s", path, directory, exc
                )
        raise CheckpointCorruptError(
            f"no checkpoint under {str(candidates[0].parent)!r} verifies; skipped: " + " | ".join(skipped)
        )

    def _load_one(self, directory: Path) -> int:
        meta = read_checkpoint_meta(directory)
        manifest = check_manifest(directory, meta)
        _check_fingerprint(directory, meta.get("fingerprint", {}), self.fingerprint())
        available = dcp_metadata(directory)
        parts = self.parts
        layout = parts.layout
        saved_layout = meta.get("layout", {})
        same_layout = (saved_layout.get("dp"), saved_layout.get("tp"), saved_layout.get("pp")) == (
            layout.dp,
            layout.tp,
            layout.pp,
        )
        request, receivers, owned, optim_keys = self._load_request(available)
        rng_key = f"rng/rank_{dist.get_rank()}"
        if "train_state" not in available:
            raise CheckpointError(f"checkpoint {str(directory)!r} is corrupt: it has no 'train_state' entry")
        request["train_state"] = b""
        if same_layout and rng_key in available:
            request[rng_key] = b""
        try:
            dcp.load(request, storage_reader=VerifyingReader(str(directory), manifest, meta.get("step")))
        except (Exception, dcp.CheckpointException) as exc:
            kind = CheckpointCorruptError if is_corruption(exc) else CheckpointError
            raise kind(
                f"rank {dist.get_rank()}: checkpoint {str(directory)!r} is corrupt or unreadable: "
                f"{describe_failure(exc)}"
            ) from exc
        train_state = pickle.loads(request["train_state"])  # noqa: S301 - our own checkpoint
        # Checks first: fails before any tensor is copied.
        restore_train_state(parts, directory, train_state, meta.get("training_arguments", {}))
        self._copy_loaded(receivers, owned, optim_keys, request)
        if rng_key in request:
            set_rng_state(request[rng_key], parts)
        else:
            logger.info(
                "checkpoint layout %s differs from dp=%d tp=%d pp=%d: RNG states not restored",
                saved_layout,
                layout.dp,
                layout.tp,
                layout.pp,
            )
        _barrier("checkpoint loaded")
        step = int(train_state["step"])
        parts.train.global_step = step
        logger.info("loaded checkpoint %s (step %d, saved under %s)", directory, step, saved_layout)
        return step

    def _load_request(
        self, available: dict[str, Any]
    ) -> tuple[
        dict[str, Any],
        dict[str, tuple[torch.Tensor, TensorSpec]],
        list[tuple[nn.Parameter, str]],
        dict[str, list[str]],
    ]:
        """What to ask DCP for: (request, receiving buffers with their specs, owned params, state keys by name)."""
        parts = self.parts
        specs = tensor_specs(parts)
        request: dict[str, Any] = {}
        receivers: dict[str, tuple[torch.Tensor, TensorSpec]] = {}
        for name, (p, spec) in specs.items():
            key = f"model/{name}"
            target, buf = _load_target(parts, spec, p, p.dtype)
            request[key], receivers[key] = target, (buf, spec)
        inner = _inner_optimizer(parts.optimizer)
        optim_keys: dict[str, list[str]] = {}
        for key in available:
            if key.startswith("optim/"):
                name, _, state_key = key[len("optim/") :].rpartition("/")
                optim_keys.setdefault(name, []).append(state_key)
        owned: list[tuple[nn.Parameter, str]] = []
        for p, name in _named_optimizer_params(inner, specs):
            owned.append((p, name))
            param_spec = specs[name][1]
            for state_key in optim_keys.get(name, []):
                key = f"optim/{name}/{state_key}"
                md = available[key]
                if not isinstance(md, TensorStorageMetadata):
                    request[key] = b""  # a pickled non-tensor state
                    continue
                dtype = md.properties.dtype
                if tuple(md.size) == param_spec.full_shape and len(md.size) > 0:
                    target, buf = _load_target(parts, param_spec, p, dtype)
                    request[key], receivers[key] = target, (buf, param_spec)
                else:  # e.g. AdamW's 0-d step: a plain tensor, stored as it is
                    buf = torch.empty(tuple(md.size), dtype=dtype, device="cpu")
                    request[key], receivers[key] = buf, (buf, TensorSpec.plain(buf))
        return request, receivers, owned, optim_keys

    def _copy_loaded(
        self,
        receivers: dict[str, tuple[torch.Tensor, TensorSpec]],
        owned: list[tuple[nn.Parameter, str]],
        optim_keys: dict[str, list[str]],
        request: dict[str, Any],
    ) -> None:
        parts = self.parts
        inner = _inner_optimizer(parts.optimizer)
        group_of = {id(q): group for group in inner.param_groups for q in group["params"]}
        with torch.no_grad():
            for name, (p, _) in tensor_specs(parts).items():
                buf, spec = receivers[f"model/{name}"]
                copy_into_shard_(p, _from_loaded(spec, buf))  # ZeRO-2/3: this DP rank's part
            for p, name in owned:
                state = {}
                for state_key in optim_keys.get(name, []):
                    key = f"optim/{name}/{state_key}"
                    if key in receivers:
                        buf, spec = receivers[key]
                        value = _from_loaded(spec, buf)
                        value = place_optimizer_state(value, state_key, p, group_of[id(p)])
                        state[state_key] = (
                            shard_like(p, value) if value.shape == p.shape and value.ndim else value
                        )
                    elif key in request:
                        state[state_key] = pickle.loads(request[key])  # noqa: S301 - our own checkpoint
                if state:
                    inner.state[p] = state


def _named_optimizer_params(
    inner: torch.optim.Optimizer, specs: Mapping[str, Any]
) -> list[tuple[nn.Parameter, str]]:
    """The optimizer's parameters that this rank's model names, in the optimizer's order (save and load)."""
    names = {id(p): name for name, (p, _) in specs.items()}
    return [(p, names[id(p)]) for group in inner.param_groups for p in group["params"] if id(p) in names]


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
