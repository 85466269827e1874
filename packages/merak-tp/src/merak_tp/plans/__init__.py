"""TP plans: which module gets which parallel style, and the built-in plans by transformers model type.

``_plan`` holds ``TPPlan``, the registry and the job-file form; ``hf`` registers the
plans for transformers families (importing it does not import transformers).
"""

from merak_tp.plans import hf as _hf  # noqa: F401  (registers the built-in plans)
from merak_tp.plans._plan import (
    MODULE_KINDS,
    STYLES,
    TPPlan,
    get_plan,
    list_plans,
    plan_for_model,
    plan_from_mapping,
    register_plan,
    resolve_sections,
    trace_leaf_names,
)

__all__ = [
    "MODULE_KINDS",
    "STYLES",
    "TPPlan",
    "get_plan",
    "list_plans",
    "plan_for_model",
    "plan_from_mapping",
    "register_plan",
    "resolve_sections",
    "trace_leaf_names",
]
