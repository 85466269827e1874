"""Where ``layout: auto`` and the plan check used to live: :mod:`merak_core.planner.auto` and
:mod:`merak_core.planner.check` (this module re-exports them under their old names)."""

from merak_core.planner.auto import (
    DEFAULT_PLAN_CHECK_STEPS,
    AutoLayout,
    auto_layout,
    build_plan_context,
    compute_slots,
    default_memory_per_device,
    plan_for_job,
    profile_inputs,
)
from merak_core.planner.check import PlanCheck

__all__ = [
    "DEFAULT_PLAN_CHECK_STEPS",
    "AutoLayout",
    "PlanCheck",
    "auto_layout",
    "build_plan_context",
    "compute_slots",
    "default_memory_per_device",
    "plan_for_job",
    "profile_inputs",
]
