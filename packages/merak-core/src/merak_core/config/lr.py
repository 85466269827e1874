"""Learning-rate schedules of a run: Hugging Face's formulas as a ``LambdaLR``."""

from __future__ import annotations

import math
import typing

import torch

from merak_core.config.arguments import TrainingArguments


def lr_lambda(
    args: TrainingArguments, num_training_steps: int | None = None
) -> typing.Callable[[int], float]:
    """The multiplier of ``learning_rate`` at each step (Hugging Face's formulas, warm-up for all types)."""
    warmup = args.warmup_steps
    kind = args.lr_scheduler_type
    total = (
        num_training_steps
        if num_training_steps is not None
        else (args.max_steps if args.max_steps > 0 else None)
    )
    if kind != "constant" and total is None:
        raise ValueError(
            f"lr_scheduler_type={kind!r} decays to 0 at the last step, but max_steps=-1: pass num_training_steps "
            "(the trainer computes it from num_train_epochs) or set max_steps"
        )
    if total is not None and total < 1:
        raise ValueError(f"num_training_steps must be >= 1, got {total}")

    def multiplier(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        if kind == "constant":
            return 1.0
        assert total is not None
        progress = (step - warmup) / max(1, total - warmup)
        if kind == "linear":
            return max(0.0, 1.0 - progress)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))

    return multiplier


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, args: TrainingArguments, num_training_steps: int | None = None
) -> torch.optim.lr_scheduler.LambdaLR:
    """``LambdaLR`` for ``args.lr_scheduler_type`` with ``args.warmup_steps`` linear warm-up.

    ``num_training_steps`` defaults to ``args.max_steps``; it is required for the decaying
    types when ``max_steps`` is -1. Works with :class:`merak_core.parallel.zero.ZeroOptimizer`.
    """
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args, num_training_steps))
