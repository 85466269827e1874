"""``training.cp > 1`` against the job's model and first batch, before torchrun (merak_core.parallel.context_parallel)."""

from __future__ import annotations

from typing import Any

from torch import nn

from merak_core.checks.base import PreflightError


def check_cp_job(job: Any, model: nn.Module) -> list[str]:
    """What was checked (nothing at cp=1); :class:`PreflightError` for a model, LoRA dropout, loss or metrics
    cp > 1 refuses."""
    from merak_core.parallel.context_parallel import check_cp_model

    t = job.training
    if t.cp == 1:
        return []
    try:
        check_cp_model(
            model,
            t,
            lora=job.model.lora,
            loss_fn_given=job.loss is not None,
            compute_metrics_given=job.metrics is not None,
        )
    except ValueError as exc:
        raise PreflightError(str(exc)) from None
    return [f"cp={t.cp} ({t.cp_mode}): the model's attention can run over the cp group"]


def check_cp_first_batch(inputs: Any, labels: Any, training: Any, what: str) -> None:
    """:class:`PreflightError` for a first batch cp > 1 cannot split exactly (its length, padding, positions)."""
    from merak_core.parallel.context_parallel import check_cp_batch

    if training.cp == 1:
        return
    try:
        check_cp_batch(inputs, labels, training.cp, training.cp_mode)
    except ValueError as exc:
        raise PreflightError(f"the first {what} batch: {exc}") from None
