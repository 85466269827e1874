"""The loop's cadence: after which steps the Trainer logs, checkpoints and evaluates, and what a step record holds.

Pure: no process group, no files. :class:`Cadence` answers "is it due?" from the step number and
``TrainingArguments``' ``logging_steps``, ``save_steps`` and ``eval_steps``; :func:`step_record`
is one step's metrics record and :func:`count_tokens` counts what a batch feeds the model (for
tokens per second).

Every rank asks the same questions with the same step, so every rank checkpoints and evaluates
after the same steps (both are collective).

:func:`training_steps` is how many optimizer steps the run takes.

Not done here: writing the metrics (``metrics.py``), saving (``checkpoint/``), evaluating
(``evaluation.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Cadence", "StepRecords", "count_tokens", "step_record", "training_steps"]


@dataclass(frozen=True, kw_only=True)
class Cadence:
    """When the loop logs, saves and evaluates (``TrainingArguments`` fields of the same names)."""

    logging_steps: int
    """Log every this many steps (and the first, the last and every skipped step)."""
    save_steps: int | None
    """Checkpoint every this many steps; None or 0: never periodically."""
    eval_steps: int | None
    """Evaluate every this many steps; None: only at the end."""
    evaluates: bool
    """The run has an eval dataset."""

    @classmethod
    def of(cls, args: Any, *, evaluates: bool) -> Cadence:
        """The cadence of ``args`` (a :class:`~merak_core.config.TrainingArguments`)."""
        return cls(
            logging_steps=args.logging_steps,
            save_steps=args.save_steps,
            eval_steps=args.eval_steps,
            evaluates=evaluates,
        )

    def log_due(self, step: int, *, first: int, total: int, skipped: bool) -> bool:
        """Log after ``step``: every ``logging_steps``, the run's first and last step, and a skipped step."""
        return step % self.logging_steps == 0 or step in (total, first) or skipped

    def save_due(self, step: int) -> bool:
        """A periodic checkpoint after ``step``."""
        return _every(step, self.save_steps)

    def eval_due(self, step: int) -> bool:
        """A periodic evaluation after ``step``."""
        return self.evaluates and _every(step, self.eval_steps)

    def reads_due(self, step: int, *, total: int) -> bool:
        """The host reads the step's numbers after ``step`` (besides the logged steps): before a save, an
        evaluation and the end, so that a non-finite step is found before its state is kept."""
        return self.save_due(step) or self.eval_due(step) or step >= total

    def final_eval_due(self, step: int) -> bool:
        """Evaluate at the end of training, unless the last step (``step``) just did."""
        return self.evaluates and not _every(step, self.eval_steps)

    def final_save_due(self, step: int) -> bool:
        """Checkpoint the final state, unless the last step (``step``) just saved it."""
        return bool(self.save_steps) and not _every(step, self.save_steps)


def _every(step: int, period: int | None) -> bool:
    """``step`` is a multiple of ``period`` (never, when ``period`` is None or 0)."""
    return period is not None and period != 0 and step % period == 0


def count_tokens(inputs: Any) -> int:
    """What one rank's batch feeds the model: tokens of integer inputs, else samples (rows); 0 without inputs."""
    if inputs is None:
        return 0
    if isinstance(inputs, Mapping):
        inputs = next(iter(inputs.values()))
    if isinstance(inputs, (tuple, list)):
        inputs = inputs[0]
    return (
        int(inputs.numel())
        if isinstance(inputs, torch.Tensor) and not inputs.is_floating_point()
        else int(inputs.shape[0])
    )


def step_record(
    *,
    step: int,
    loss: float,
    lr: float,
    step_time_s: float,
    grad_norm: float | None,
    skipped_steps: int | None,
) -> dict[str, Any]:
    """One step's metrics record; ``grad_norm`` (before clipping) when computed (``max_grad_norm > 0``),
    ``skipped_steps`` (the count so far) only for a skipped step."""
    record: dict[str, Any] = {"step": step, "loss": loss, "lr": lr, "step_time_s": step_time_s}
    if grad_norm is not None:
        record["grad_norm"] = grad_norm
    if skipped_steps is not None:
        record.update(skipped=True, skipped_steps=skipped_steps)
    return record


class StepRecords:
    """Step records completed as each step's loss and gradient norm reach the host, appended in step order.

    ``add`` keeps a step's result (a :class:`~merak_core.run.step_values.StepResult`) and its other fields;
    ``flush`` appends every record whose numbers the host has read already (reading nothing) or, with
    ``force``, all of them (reading the rest: one transfer per step not read yet).
    """

    def __init__(self, history: list[dict[str, Any]]) -> None:
        self.history = history
        self._pending: list[tuple[Any, dict[str, Any]]] = []

    def add(self, result: Any, **fields: Any) -> None:
        """Keep ``result``'s record (``step``, ``lr``, ``step_time_s``, ``skipped_steps``) until it is read."""
        self._pending.append((result, fields))

    def flush(self, *, force: bool) -> dict[str, Any] | None:
        """Append the records that are ready (all with ``force``); the last one appended, or None."""
        last = None
        while self._pending and (force or self._pending[0][0].values.is_read):
            result, fields = self._pending.pop(0)
            last = step_record(loss=result.loss, grad_norm=result.grad_norm, **fields)
            self.history.append(last)
        return last


def training_steps(args: Any, train_loader: Any) -> int:
    """Optimizer steps of the run: ``max_steps``, else ``num_train_epochs`` of the training loader."""
    if args.max_steps > 0:
        return args.max_steps
    if train_loader is None:
        return 0
    try:
        per_epoch = len(train_loader)
    except TypeError:
        raise ValueError("an iterable train_dataset has no length: set max_steps") from None
    return max(1, math.ceil(per_epoch * args.num_train_epochs))
