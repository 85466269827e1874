"""Schedule generators behind one entry point, and the registry that names them.

``build_schedule(name, num_stages=..., num_microbatches=...)`` returns a compute-only
:class:`~merak_pipe.ir.Schedule` (no send/recv; :func:`merak_pipe.lower` adds them), validated
unless ``check=False``. Built-in names: ``gpipe``, ``1f1b``, ``interleaved-1f1b``,
``shifted-critical-path``, ``zb-h1``, ``zb-v``. One schedule family per module.

A generator is any callable ``fn(*, num_stages, num_microbatches, num_ranks, recompute, **options)``
returning a :class:`Schedule`; :func:`register_schedule` adds it under a name.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from merak_pipe._engine import paused_gc
from merak_pipe.ir import Schedule
from merak_pipe.recompute import RecomputePlan, as_plan
from merak_pipe.schedules.gpipe import gpipe
from merak_pipe.schedules.interleaved import interleaved_1f1b
from merak_pipe.schedules.one_f_one_b import one_f_one_b
from merak_pipe.schedules.shifted import shifted_critical_path
from merak_pipe.schedules.zero_bubble import zb_h1
from merak_pipe.schedules.zero_bubble_v import zb_v

__all__ = ["ScheduleGenerator", "available_schedules", "build_schedule", "register_schedule"]

logger = logging.getLogger(__name__)

ScheduleGenerator = Callable[..., Schedule]

_REGISTRY: dict[str, ScheduleGenerator] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_1f1b,
    "shifted-critical-path": shifted_critical_path,
    "zb-h1": zb_h1,
    "zb-v": zb_v,
}


def register_schedule(name: str, fn: ScheduleGenerator, *, overwrite: bool = False) -> None:
    """Register ``fn`` under ``name`` so ``build_schedule(name, ...)`` calls it.

    ``fn`` is called as ``fn(num_stages=..., num_microbatches=..., num_ranks=..., recompute=..., **options)``
    (``num_ranks`` may be None, ``recompute`` is a :class:`RecomputePlan` or None) and must return a
    compute-only :class:`Schedule`.
    """
    if not name or not isinstance(name, str):
        raise ValueError(f"schedule name {name!r} must be a non-empty string")
    if name in _REGISTRY and not overwrite:
        raise ValueError(
            f"a schedule named {name!r} is already registered; pass overwrite=True to replace it "
            f"or choose another name (registered: {sorted(_REGISTRY)})"
        )
    if not callable(fn):
        raise ValueError(f"schedule generator for {name!r} must be callable, got {type(fn).__name__}")
    _REGISTRY[name] = fn


def available_schedules() -> list[str]:
    """Names accepted by :func:`build_schedule`, sorted."""
    return sorted(_REGISTRY)


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
    try:
        fn = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown schedule {name!r}; expected one of {available_schedules()} "
            "or register your own with merak_pipe.register_schedule"
        ) from None
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
            takers = [n for n, g in sorted(_REGISTRY.items()) if set(unknown) <= set(inspect.signature(g).parameters)]
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
