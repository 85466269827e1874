"""Schedule generators behind one entry point, and the registry that names them.

``build_schedule(name, num_stages=..., num_microbatches=...)`` returns a compute-only
:class:`~merak_pipe.ir.Schedule` (no send/recv; :func:`merak_pipe.lower` adds them), validated
unless ``check=False``. Built-in names: ``gpipe``, ``1f1b``, ``interleaved-1f1b``,
``shifted-critical-path``, ``zb-h1``, ``zb-v``. One schedule family per module.

A generator is any callable ``fn(*, num_stages, num_microbatches, num_ranks, recompute, **options)``
returning a :class:`Schedule`; :func:`register_schedule` adds it under a name, with its
capabilities (:class:`~merak_pipe.schedules.registry.ScheduleInfo`: spellings, stages per rank,
split backward). Every name, key or alias of :func:`schedule_info` builds (see [Note: schedule
spellings] in :mod:`merak_pipe.schedules.registry`).
"""

from __future__ import annotations

import logging

from merak_pipe._dependencies import paused_gc
from merak_pipe.ir import Schedule
from merak_pipe.recompute import RecomputePlan, as_plan
from merak_pipe.schedules.gpipe import gpipe
from merak_pipe.schedules.interleaved import interleaved_1f1b
from merak_pipe.schedules.one_f_one_b import one_f_one_b
from merak_pipe.schedules.registry import _REGISTRY as _REGISTRY  # registered entries by name
from merak_pipe.schedules.registry import (
    ScheduleGenerator,
    ScheduleInfo,
    available_schedules,
    register_schedule,
    schedule_info,
    schedule_infos,
)
from merak_pipe.schedules.shifted import shifted_critical_path
from merak_pipe.schedules.zero_bubble import zb_h1
from merak_pipe.schedules.zero_bubble_v import zb_v

__all__ = [
    "ScheduleGenerator",
    "ScheduleInfo",
    "available_schedules",
    "build_schedule",
    "register_schedule",
    "schedule_info",
    "schedule_infos",
]

logger = logging.getLogger(__name__)

# The built-ins, in the order the planner ranks ties (one stage per rank first).
register_schedule("gpipe", gpipe)
register_schedule("1f1b", one_f_one_b)
register_schedule("zb-h1", zb_h1, key="zb_h1", split_backward=True)
register_schedule("shifted-critical-path", shifted_critical_path, key="shifted_critical_path")
register_schedule("interleaved-1f1b", interleaved_1f1b, key="interleaved_1f1b", stages_per_rank=None)
register_schedule("zb-v", zb_v, key="zb_v", stages_per_rank=2, split_backward=True)


def build_schedule(
    name: str,
    *,
    num_stages: int,
    num_microbatches: int,
    num_ranks: int | None = None,
    recompute: RecomputePlan | str | float | None = None,
    check: bool = True,
    **options: object,
) -> Schedule:
    """Build the compute-only schedule ``name``.

    ``recompute`` is a :class:`RecomputePlan`, ``"none"``, ``"full"``, or a float (the same fraction
    on every stage). ``options`` are passed to the generator (e.g. ``virtual_stages=2`` for
    ``interleaved-1f1b``). With ``check=True`` the result is validated (:func:`merak_pipe.validate`).
    """
    fn = schedule_info(name).generator
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages={num_stages!r}; expected an int >= 1")
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches={num_microbatches!r}; expected an int >= 1")
    if num_ranks is not None and (not isinstance(num_ranks, int) or num_ranks < 1):
        raise ValueError(f"num_ranks={num_ranks!r}; expected an int >= 1 or None")
    plan = as_plan(recompute, num_stages)
    if options:
        import inspect

        params = inspect.signature(fn).parameters
        unknown = sorted(set(options) - set(params))
        if unknown and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            own = [p for p in params if p not in ("num_stages", "num_microbatches", "num_ranks", "recompute")]
            takers = [
                i.name
                for i in sorted(schedule_infos(), key=lambda i: i.name)
                if set(unknown) <= set(inspect.signature(i.generator).parameters)
            ]
            raise TypeError(
                f"schedule {name!r} takes no option {', '.join(map(repr, unknown))} (its options: {own}): "
                + (f"use a schedule that does, {takers}, or drop it" if takers else "drop it")
            )
    with paused_gc():
        schedule = fn(
            num_stages=num_stages,
            num_microbatches=num_microbatches,
            num_ranks=num_ranks,
            recompute=plan,
            **options,
        )
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule generator {name!r} returned {type(schedule).__name__}, expected Schedule")
    if check:
        from merak_pipe.validate import validate

        validate(schedule)
    logger.debug("built schedule %s: %d stages, %d microbatches", name, num_stages, num_microbatches)
    return schedule
