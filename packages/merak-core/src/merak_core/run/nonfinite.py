"""Non-finite losses and gradients: what a step found, the error that names it, JSON without NaN.

[Note: step flags] Every training step ends with one all-reduce over all ranks that the step
needs anyway (the loss, which only the last stage holds, averaged over DP). Two flags ride in
the same float64 vector: "this rank saw a non-finite gradient" and "this rank was asked to stop"
(a signal, see :mod:`merak_core.run.signals`). So every rank learns, from the same collective and
without another synchronisation, whether the step's loss or gradients are finite anywhere and
whether anyone must stop; all ranks then take the same decision. With gradient clipping the
global gradient norm (already reduced over TP and PP, and equal on DP replicas because the
gradients are DP-averaged) decides for the gradients; without clipping each rank checks its own
gradients.

Only when a step is non-finite does any more communication happen: under the ``stop`` policy
the ranks gather the name of each one's first non-finite gradient, so the error names it on
every rank.

[Note: device-side skip] The step vector stays on the device: the engine never reads it in the step
under ``nonfinite: stop`` when the optimizer can drop an update on the device (torch's fused optimizers,
the default on CUDA, take a ``found_inf`` flag: :func:`device_skip_target`). There a non-finite step's
update is dropped by the optimizer kernel itself (and every later one until the host has seen it), the
step's vector is copied to pinned host memory without blocking, and the host reads it at the end of the
next step (when the device is done with it: no stall) or at once on a step that logs, saves or evaluates.
So ``stop`` raises one step later than the bad step, naming it, with the parameters of the step before
it. Each rank also keeps the index of its first non-finite local gradient of every step on the device
(:func:`first_nonfinite_code`), so the error still names the bad gradient of the bad step. ``skip``
(the learning-rate schedule must not advance, the count is on the host) and optimizers without
``found_inf`` read the vector in the step, one host transfer.

Not done here: loss scaling (float16 training is refused by ``TrainingArguments``; bfloat16
needs none) and keeping non-finite values out of checkpoints (the checkpoint manager's job).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from merak_core.parallel import _compat
from merak_core.parallel.fsdp import local_tensor

STOP = "stop"
SKIP = "skip"

# Positions in the per-step vector (see [Note: step flags]).
LOSS, NONFINITE, STOP_REQUESTED = 0, 1, 2
STEP_VECTOR_SIZE = 3


class NonFiniteError(FloatingPointError):
    """A training step produced a NaN or infinite loss or gradient norm (policy ``nonfinite: stop``).

    ``step``: the bad step (under [Note: device-side skip] it is found one step later).
    """

    def __init__(self, message: str, *, step: int | None = None) -> None:
        super().__init__(message)
        self.step = step


_FUSED_FOUND_INF = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)


def device_skip_target(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer that drops its update on the device when its ``found_inf`` is 1, or None.

    torch's fused Adam, AdamW, SGD and Adagrad read ``found_inf`` (the flag ``GradScaler`` sets) in the
    kernel; a ZeRO-1 optimizer steps its inner one (its all-gather then gathers unchanged shards).
    Any other optimizer (foreach, a user's) cannot: the step reads the flag on the host.
    """
    inner = getattr(optimizer, "inner", None)
    if isinstance(inner, torch.optim.Optimizer):
        optimizer = inner
    if isinstance(optimizer, _FUSED_FOUND_INF) and optimizer.defaults.get("fused"):
        return optimizer
    return None


def local_grads_nonfinite_flag(params: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Whether any local gradient holds a NaN or an infinity: a 0-d bool tensor on ``device`` (no host read)."""
    grads = [local_tensor(p.grad) for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.bool, device=device)
    return torch.stack([torch.isfinite(g).all() for g in grads]).logical_not().any()


def first_nonfinite_code(grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``2 * i + (1 if nan else 0)`` for the first of ``grads`` (local tensors) whose norm is not finite,
    ``-1`` if none: a float64 0-d tensor on ``device``, computed there (one multi-tensor norm)."""
    if not grads:
        return torch.full((), -1.0, dtype=torch.float64, device=device)
    by_kind: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, g in enumerate(grads):
        by_kind.setdefault((g.device, g.dtype), []).append(i)
    found: list[torch.Tensor] = [torch.empty(0)] * len(grads)
    for (_, dtype), indices in by_kind.items():
        group = [grads[i] for i in indices]
        for i, n in zip(
            indices, _compat.foreach_norm(group, 2.0, torch.promote_types(dtype, torch.float32)), strict=True
        ):
            found[i] = n
    norms = torch.stack([n.to(device=device, dtype=torch.float64) for n in found])
    codes = torch.arange(len(grads), device=device, dtype=torch.float64) * 2 + torch.isnan(norms)
    first = torch.where(torch.isfinite(norms), torch.full_like(codes, 2.0 * len(grads)), codes).min()
    return torch.where(first >= 2 * len(grads), torch.full_like(first, -1.0), first)


def decode_first_nonfinite(code: float, names: Sequence[str]) -> tuple[str, str] | None:
    """The (name, ``nan``/``inf``) that :func:`first_nonfinite_code` encoded, or None."""
    if code < 0:
        return None
    return names[int(code) // 2], "nan" if int(code) % 2 else "inf"


def local_grads_nonfinite(params: Iterable[torch.Tensor]) -> bool:
    """Whether any local gradient holds a NaN or an infinity (no communication)."""
    grads = [local_tensor(p.grad) for p in params if p.grad is not None]  # a ZeRO-2/3 gradient: its shard
    if not grads:
        return False
    return bool(torch.stack([torch.isfinite(g).all() for g in grads]).logical_not().any())


def first_nonfinite_gradient(named: Sequence[tuple[str, nn.Parameter]]) -> tuple[str, str] | None:
    """(logical name, what: ``nan``/``inf``) of the first parameter whose gradient is not finite, or None."""
    for name, p in named:
        g = p.grad
        if g is None:
            continue
        g = local_tensor(g)
        finite = torch.isfinite(g)
        if not bool(finite.all()):
            return name, "nan" if bool(torch.isnan(g).any()) else "inf"
    return None


class StepNumbers(Protocol):
    """What the error of a step reads of it (:class:`merak_core.run.step_values.StepValues`)."""

    @property
    def loss(self) -> float:
        """The global mean loss."""
        ...

    @property
    def grad_norm(self) -> float | None:
        """The global gradient norm before clipping (None when not computed)."""
        ...


def nonfinite_error(
    step: int,
    values: StepNumbers,
    named: Sequence[tuple[str, nn.Parameter]],
    layout: Any,
    *,
    skip_limit: int | None = None,
    mine: tuple[str, str] | None | str = "from the gradients",
) -> NonFiniteError:
    """The ``stop`` policy's error, identical on every rank (collective: gathers each rank's first bad gradient).

    The first non-finite gradient is the one of the lowest pipeline stage that has one, in that
    stage's parameter order (the model's order), found on its TP rank 0 when possible.
    ``skip_limit``: the ``skip`` policy stops here because the ``skip_limit`` steps before this one
    were skipped already (``nonfinite_max_consecutive_skips``); the message says so.
    ``mine``: this rank's first bad gradient as found on the device in the bad step (see [Note:
    device-side skip]); by default it is read from the gradients now.
    """
    loss, grad_norm = values.loss, values.grad_norm
    if isinstance(mine, str):
        mine = first_nonfinite_gradient(named)
    entry = None if mine is None else (layout.pp_rank, layout.tp_rank, layout.dp_rank, layout.rank, *mine)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, entry)
    found = sorted(e for e in gathered if e is not None)
    norm = "not computed (max_grad_norm=0)" if grad_norm is None else f"{grad_norm!r}"
    if found:
        pp_rank, tp_rank, dp_rank, rank, name, what = found[0]
        where = (
            f"the first non-finite gradient is {name!r} ({what}, on rank {rank}: pp_rank {pp_rank}, "
            f"dp_rank {dp_rank}, tp_rank {tp_rank})"
        )
    elif not math.isfinite(loss):
        where = "every gradient is finite (the loss alone is not)"
    else:
        where = "every gradient is finite, but the sum of their squares overflowed"
    fixes = "Lower learning_rate, clip gradients (max_grad_norm), train in float32 or bf16"
    if skip_limit is None:
        tail = f"The step was not applied and no checkpoint was written for it. {fixes}, or set nonfinite: skip to drop such steps"
    else:
        tail = (
            f"The {skip_limit} steps before it were skipped already (nonfinite: skip), the most "
            f"training.nonfinite_max_consecutive_skips={skip_limit} allows in a row, so the run stops as "
            f"nonfinite: stop would: the step was not applied and no checkpoint was written for it. {fixes}, check "
            "the data, or raise nonfinite_max_consecutive_skips (0: no limit)"
        )
    return NonFiniteError(
        f"step {step}: non-finite training step (loss {loss!r}, gradient norm {norm}); {where}. {tail}",
        step=step,
    )


def all_skipped_error(*, first_step: int, last_step: int, limit: int) -> NonFiniteError:
    """The ``skip`` policy's error when every step of a run segment was skipped (no update was applied)."""
    count = last_step - first_step + 1
    return NonFiniteError(
        f"steps {first_step}..{last_step}: every one of the {count} steps of this run was non-finite and skipped "
        "(nonfinite: skip), so no update was applied; the run fails instead of ending as if it had trained, and "
        "nothing of this run is saved or exported at its end. Lower learning_rate, clip gradients (max_grad_norm), "
        f"train in float32 or bf16, or check the model and the data (training.nonfinite_max_consecutive_skips="
        f"{limit} stops a longer run at the first step past that many skips in a row)"
    )


def eval_error(*, step: int, loss: float) -> NonFiniteError:
    """A training run's evaluation gave a NaN or infinite loss: the run fails before it saves that state."""
    return NonFiniteError(
        f"step {step}: the evaluation loss is {loss!r}: the model's outputs on the eval set are not finite (or no "
        "eval label is counted: every one is -100), so this state is not a good one; the run stops here and no "
        "checkpoint of it is committed (the earlier ones are kept). Resume from an earlier checkpoint with a lower "
        "learning_rate or gradient clipping (max_grad_norm), or fix the eval data"
    )


def json_safe(value: Any) -> Any:
    """``value`` with every NaN or infinite float replaced by None, so ``json.dumps`` writes valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


__all__ = [
    "SKIP",
    "STOP",
    "NonFiniteError",
    "all_skipped_error",
    "decode_first_nonfinite",
    "device_skip_target",
    "eval_error",
    "first_nonfinite_code",
    "first_nonfinite_gradient",
    "json_safe",
    "local_grads_nonfinite",
    "local_grads_nonfinite_flag",
    "nonfinite_error",
]
