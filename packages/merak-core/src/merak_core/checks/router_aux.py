"""A transformers MoE model's router aux loss against the job's layout, before torchrun (merak_core.parallel.router_aux)."""

from __future__ import annotations

from typing import Any

from torch import nn

from merak_core.checks.base import PreflightError


def check_router_aux_job(job: Any, model: nn.Module) -> list[str]:
    """What was checked (nothing for a model without one); :class:`PreflightError` at pp > 1 or cp > 1."""
    from merak_core.parallel.router_aux import check_router_aux, router_aux_settings

    settings = router_aux_settings(model)
    if settings is None:
        return []
    t = job.training
    try:
        check_router_aux(model, t.pp, t.cp)
    except ValueError as exc:
        raise PreflightError(str(exc)) from None
    return [f"router aux loss (coef {settings[0]}) over the global batch: choice counts summed over DP"]
