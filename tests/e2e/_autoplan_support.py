"""``layout: auto`` with fixed planning inputs, so that the plan, not this machine's load, decides.

:func:`fixed_planning_inputs` replaces what ``merak_core.autoplan.auto`` measures on the ranks (the
model's profile, the CPU compute slots, the communication model) by a given profile, a device per
rank and the default ``CommModel()``; the planning, the broadcast and the choice stay real.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


def bubble_profile() -> Any:
    """Four equal layers whose weights fit a device only split in two, one head: the pipeline's bubble
    dominates, which two stages per rank shrink (tests/core/test_planner_virtual_stages.py)."""
    from merak_core.planner import ModelProfile

    return ModelProfile(
        layer_forward_s=[1e-2] * 4,
        layer_backward_s=[2e-2] * 4,
        layer_activation_bytes=[1e7] * 4,
        layer_param_bytes=[1e8] * 4,
        boundary_bytes=1e3,
        num_heads=1,
    )


def bubble_args() -> Any:
    """The job of :func:`bubble_profile`: 2 rows per device, 1.6 GB per device, one step, no probes."""
    from merak_core.config import TrainingArguments

    return TrainingArguments(
        layout="auto",
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        memory_per_device=int(1.6e9),
        plan_probe_tp=False,
        plan_check_steps=0,
        max_steps=1,
    )


@contextmanager
def fixed_planning_inputs(profile: Any, **more: Callable[..., Any]) -> Iterator[Any]:
    """``merak_core.autoplan.auto`` with its profile, compute slots and communication model fixed
    (``more``: further functions of the module to replace, by name); the module, restored on exit."""
    from merak_core.autoplan import auto
    from merak_core.planner import CommModel

    replace: dict[str, Callable[..., Any]] = {
        "profile_for_plan": lambda *a, **k: profile,
        "_cpu_compute_slots": lambda *a, **k: None,  # a device per rank: virtual stages are searched
        "measure_comm": lambda *a, **k: CommModel(),
        **more,
    }
    saved = {name: getattr(auto, name) for name in replace}
    for name, fn in replace.items():
        setattr(auto, name, fn)
    try:
        yield auto
    finally:
        for name, fn in saved.items():
            setattr(auto, name, fn)
