"""A model's router aux loss against the job's layout, before torchrun (merak_core.parallel.router_aux)."""

from __future__ import annotations

from typing import Any

from torch import nn

from merak_core.checks.base import PreflightError


def check_router_aux_job(job: Any, model: nn.Module) -> list[str]:
    """What was checked (nothing for a model without one); :class:`PreflightError` where the run refuses it:
    a transformers family's at pp > 1 or cp > 1, a protocol block's there and with recomputation."""
    from merak_core.parallel.router_aux import aux_loss_blocks, check_router_aux, router_aux_settings

    settings = router_aux_settings(model)
    blocks = aux_loss_blocks(model)
    if settings is None and not blocks:
        return []
    t = job.training
    try:
        check_router_aux(model, t.pp, t.cp, t.recompute_mode[0])
    except ValueError as exc:
        raise PreflightError(str(exc)) from None
    done = []
    if settings is not None:
        done.append(
            f"router aux loss (coef {settings[0]}) over the global batch: choice counts summed over DP"
        )
    if blocks:
        done.append(
            f"router aux loss of {len(blocks)} MoE block(s) over the global microbatch: counts summed over DP"
        )
    return done
