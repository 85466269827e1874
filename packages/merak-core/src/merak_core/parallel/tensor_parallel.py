"""Tensor parallelism of a whole model before it is cut: the job's TP plan as ``merak_tp`` takes it, the
shard over the TP group, and the modules the pipeline tracer keeps whole.

Not done here: the cut into stages and their placement (``compose.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from merak_core.parallel.layout import ParallelLayout

__all__ = ["apply_tensor_parallel", "ep_tp_plan", "trace_leaves"]


def _tp_plan(plan: Any) -> Any:
    """A job's ``tp_plan`` as ``merak_tp.parallelize`` takes it (None: the model's built-in plan)."""
    if plan in (None, "auto"):
        return None
    if isinstance(plan, Mapping):
        import merak_tp

        return merak_tp.plan_from_mapping(plan)
    return plan


def ep_tp_plan(model: nn.Module, layout: ParallelLayout, plan: Any) -> Any:
    """At ep > 1 and tp > 1 the plan without its fused-experts entries (experts whole per EP rank)."""
    if layout.ep == 1 or layout.tp == 1:
        return plan
    from merak_core.parallel.expert_hf import tp_plan_without_experts

    return tp_plan_without_experts(model, _tp_plan(plan))


def apply_tensor_parallel(
    model: nn.Module,
    layout: ParallelLayout,
    *,
    plan: Any = None,
    overlap_chunks: int = 1,
    rng_tracker: Any = None,
    sequence_parallel: bool = False,
) -> nn.Module:
    """Shard ``model`` over ``layout.tp_group`` (no-op when ``tp == 1``).

    ``plan``: None/"auto", a registered plan name, a ``TPPlan`` or a job-file mapping
    (``merak_tp.plan_from_mapping``). ``rng_tracker``: the TP random stream for the plan's
    regions of sharded dropout; ``sequence_parallel``: the plan's sequence-parallel regions
    (``merak_tp.parallelize``).
    """
    if layout.tp == 1:
        return model
    import merak_graph
    import merak_tp

    # A meta model's TP layers copy the buffers of the modules they replace still on meta (e.g. Gemma's
    # embedding scale): they take the constructor values remembered for the originals
    # ([Note: replaced modules] in merak_graph.empty), else materialisation has none to give them.
    remembered = merak_graph.constructor_buffers(model)
    model = merak_tp.parallelize(
        model,
        _tp_plan(plan),
        group=layout.tp_group,
        overlap_chunks=overlap_chunks,
        rng_tracker=rng_tracker,
        sequence_parallel=sequence_parallel,
    )
    merak_graph.adopt_constructor_buffers(model, remembered)
    return model


def trace_leaves(model: nn.Module, layout: ParallelLayout, plan: Any) -> tuple[Any, ...]:
    """Modules the pipeline tracer keeps opaque: TP's modules, or without TP the plan's ``trace_leaves``
    (mixture-of-experts blocks, whose data-dependent routing torch.export cannot trace)."""
    import merak_tp

    if layout.tp > 1:
        return merak_tp.TP_LEAF_MODULES
    try:  # without TP the plan shards nothing: one that does not resolve falls back to the built-in one
        plan = _tp_plan(plan)
        plan = merak_tp.get_plan(plan) if isinstance(plan, str) else plan
    except ValueError:
        plan = None
    return tuple(merak_tp.trace_leaf_names(model, plan))
