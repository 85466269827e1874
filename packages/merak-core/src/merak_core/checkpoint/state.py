"""The non-tensor state of a run: random streams, data position, optimizer and schedule settings.

[Note: random streams] Each rank saves its own streams (``rng/rank_<r>``): torch's
CPU generator, every CUDA generator once CUDA is initialised, Python's and NumPy's
generators and, when the run has a ``rng_tracker`` (a
``merak_tp.RNGTracker``), the tracker's stored states. The run's own TP stream
is a *derived* one (each fork seeds from a draw of the default generator), so the
default generator's state covers it. They are restored only under the same
(dp, tp, pp) layout, where ranks correspond. The data order needs no stream: it
is a function of the seed, the epoch and the position (see ``merak_core.data.loader``).

[Note: changed job file] On resume the job file wins for every optimizer and
schedule setting: the optimizer groups keep the values the run was built with
(learning rate, weight decay, betas, eps, any other group option), the LR schedule
keeps its new multiplier function and base rates and takes only its position (the
step) from the checkpoint, and the current rate is recomputed from them. Each
setting that differs from the checkpoint's is logged once on rank 0
(``resume: learning_rate 0.003 -> 3e-05 (job file)``). Changes that cannot apply
(model shapes, the vocabulary, the data order) are refused before anything is
changed, by the fingerprint and data-position checks.

Not done here: tensors (``save.py``, ``load.py``).
"""

from __future__ import annotations

import logging
import pickle
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from merak_core.checkpoint.files import CheckpointError

if TYPE_CHECKING:
    from merak_core.checkpoint.parts import CheckpointParts

logger = logging.getLogger(__name__)

# TrainingArguments whose new values a resumed run uses (optimizer, LR schedule, length, clipping,
# the non-finite policy).
RESUMABLE_SETTINGS = (
    "learning_rate",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "lr_scheduler_type",
    "warmup_steps",
    "max_steps",
    "num_train_epochs",
    "max_grad_norm",
    "nonfinite",
    "nonfinite_max_consecutive_skips",
)
# Optimizer group options that follow from those settings (logged through the setting, not twice).
_GROUP_KEYS_FROM_SETTINGS = {"lr", "initial_lr", "weight_decay", "betas", "eps"}


def _inner_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds state (ZeRO-1 wraps one over the owned shard)."""
    return getattr(optimizer, "inner", optimizer)


def rng_state(parts: CheckpointParts | None = None) -> bytes:
    """This rank's random streams (see [Note: random streams])."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy is optional
        pass
    tracker = getattr(parts, "rng_tracker", None)
    if tracker is not None:
        state["tp_tracker"] = tracker.get_states()
    return pickle.dumps(state)


def set_rng_state(blob: bytes, parts: CheckpointParts | None = None) -> None:
    state = pickle.loads(blob)  # noqa: S301 - our own checkpoint (see the merak-core README, "Limits": trust)
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    tracker = getattr(parts, "rng_tracker", None)
    if tracker is not None and "tp_tracker" in state:
        tracker.set_states(state["tp_tracker"])


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_fmt(v) for v in value) + ")"
    return repr(value) if isinstance(value, str) else str(value)


def setting_changes(saved_args: Mapping[str, Any], args: Any) -> list[str]:
    """``"name old -> new"`` for every resumable setting whose value differs from the checkpoint's."""
    out = []
    for key in RESUMABLE_SETTINGS:
        if key not in saved_args or not hasattr(args, key):
            continue
        old, new = saved_args[key], getattr(args, key)
        if old != new:
            out.append(f"{key} {_fmt(old)} -> {_fmt(new)} (job file)")
    return out


def _group_changes(
    saved_groups: Sequence[Mapping[str, Any]], groups: Sequence[Mapping[str, Any]]
) -> list[str]:
    out = []
    for i, (saved, group) in enumerate(zip(saved_groups, groups, strict=True)):
        for key in sorted(set(saved) & set(group) - _GROUP_KEYS_FROM_SETTINGS - {"params"}):
            if saved[key] != group[key]:
                out.append(f"optimizer group {i} {key} {_fmt(saved[key])} -> {_fmt(group[key])} (optimizer)")
    return out


def restore_train_state(
    parts: CheckpointParts, directory: Path, state: Mapping[str, Any], saved_args: Mapping[str, Any]
) -> None:
    """Data position and LR-schedule position; settings from the job file (see [Note: changed job file]).

    Raises before changing anything when the checkpoint cannot apply to this run.
    """
    groups = state["param_groups"]
    if len(groups) != len(parts.optimizer.param_groups):
        raise CheckpointError(
            f"checkpoint {str(directory)!r} has {len(groups)} optimizer parameter groups, this trainer "
            f"{len(parts.optimizer.param_groups)}: resume with the same optimizer set-up"
        )
    if state.get("data") is not None and parts.train_loader is not None:
        try:
            parts.train_loader.load_state_dict(state["data"])  # checks everything before assigning
        except ValueError as exc:
            raise CheckpointError(f"checkpoint {str(directory)!r}: {exc}") from exc
    changes = setting_changes(saved_args, parts.args) + _group_changes(groups, parts.optimizer.param_groups)
    if dist.get_rank() == 0:
        for change in changes:
            logger.info("resume: %s", change)
    _restore_schedule(parts, state["scheduler"])


def _restore_schedule(parts: CheckpointParts, saved: Mapping[str, Any]) -> None:
    """The schedule's position from the checkpoint, its function and base rates from this run."""
    scheduler = parts.lr_scheduler
    lambdas = list(getattr(scheduler, "lr_lambdas", []))
    if not lambdas:  # not the run's LambdaLR: its own state as saved
        scheduler.load_state_dict(dict(saved))
        return
    base_lrs = list(scheduler.base_lrs)
    scheduler.__dict__.update(
        {k: v for k, v in saved.items() if k not in ("base_lrs", "lr_lambdas", "_last_lr")}
    )
    lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(base_lrs, lambdas, strict=True)]
    optimizers = [parts.optimizer]
    inner = _inner_optimizer(parts.optimizer)
    if inner is not parts.optimizer:
        optimizers.append(inner)
    for optimizer in optimizers:
        for group, lr in zip(optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
    scheduler._last_lr = lrs  # type: ignore[attr-defined]
