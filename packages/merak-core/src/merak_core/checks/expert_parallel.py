"""``training.ep > 1`` against the job's model, before torchrun (merak_core.parallel.expert_parallel)."""

from __future__ import annotations

from typing import Any

from torch import nn

from merak_core.checks.base import PreflightError


def check_ep_job(job: Any, model: nn.Module) -> list[str]:
    """What was checked (nothing at ep=1); :class:`PreflightError` for a model or LoRA that ep > 1 refuses."""
    from merak_core.parallel.expert_parallel import check_ep_model, moe_blocks
    from merak_core.parallel.fused_experts import fused_experts

    t = job.training
    if t.ep == 1:
        return _check_capacity_job(job, model)
    try:
        check_ep_model(model, t, lora=job.model.lora)
    except ValueError as exc:
        raise PreflightError(str(exc)) from None
    # protocol blocks and transformers' fused experts
    blocks = len(moe_blocks(model)) + len(fused_experts(model))
    return [f"ep={t.ep}: {blocks} MoE blocks, their experts split over {t.ep} ranks"]


def _check_capacity_job(job: Any, model: nn.Module) -> list[str]:
    """``training.moe_capacity_factor`` at ep=1: the model needs blocks that apply it (nothing to check without)."""
    from merak_core.parallel.expert_parallel import check_ep_model, moe_blocks

    capacity = getattr(job.training, "moe_capacity_factor", None)
    if capacity is None:
        return []
    try:
        check_ep_model(model, job.training, lora=job.model.lora)
    except ValueError as exc:
        raise PreflightError(str(exc)) from None
    from merak_core.parallel.fused_experts import fused_experts

    # protocol blocks and transformers' fused experts
    blocks = len(moe_blocks(model)) + len(fused_experts(model))
    return [f"moe_capacity_factor={capacity}: {blocks} MoE blocks drop beyond each expert's capacity"]
