"""The schedule registry: every schedule's name, spellings and capabilities, read by everyone.

A :class:`ScheduleInfo` says what a schedule is (its generator) and what a caller needs to know
before building it: the names it answers to, how many stages it places on one rank, whether
its backward is split into input- and weight-gradient parts, and whether the simulator predicts
it. Job files, the planner and the CLI look schedules up here (:func:`schedule_info`) instead
of keeping lists of their own.

[Note: schedule spellings] A schedule has one canonical ``name`` (hyphens, as merak-pipe prints
it: ``shifted-critical-path``) and one ``key``, the identifier spelling job files and the planner
store (``shifted_critical_path``); both, and any ``aliases``, find it. No caller translates one
spelling into the other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from merak_pipe.ir import Schedule

__all__ = [
    "ScheduleGenerator",
    "ScheduleInfo",
    "available_schedules",
    "register_schedule",
    "schedule_info",
    "schedule_infos",
]

ScheduleGenerator = Callable[..., Schedule]


@dataclass(frozen=True)
class ScheduleInfo:
    """One registered schedule and its capabilities."""

    name: str
    """The canonical name (``build_schedule(name, ...)``)."""
    generator: ScheduleGenerator
    """``fn(*, num_stages, num_microbatches, num_ranks, recompute, **options) -> Schedule``."""
    key: str = ""
    """The identifier spelling stored in job files and plans (default: ``name``)."""
    aliases: tuple[str, ...] = ()
    """Further names that find this schedule."""
    stages_per_rank: int | None = 1
    """Pipeline stages on one rank; None when an option chooses it (``virtual_stages``)."""
    split_backward: bool = False
    """The backward runs as separate input-gradient and weight-gradient actions (I and W)."""
    simulated: bool = True
    """:func:`merak_pipe.simulate` predicts its step time and memory (planners rank only these)."""
    spellings: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"schedule name {self.name!r} must be a non-empty string")
        if not callable(self.generator):
            raise ValueError(
                f"schedule generator for {self.name!r} must be callable, got {type(self.generator).__name__}"
            )
        if not self.key:
            object.__setattr__(self, "key", self.name)
        object.__setattr__(self, "spellings", frozenset({self.name, self.key, *self.aliases}))

    @property
    def one_stage_per_rank(self) -> bool:
        """Exactly one stage per rank (what a rank holding one model part can run)."""
        return self.stages_per_rank == 1

    def runs_stages_per_rank(self, count: int) -> bool:
        """Whether the schedule can place ``count`` stages on every rank (any count when an option chooses it)."""
        return self.stages_per_rank is None or self.stages_per_rank == count


_REGISTRY: dict[str, ScheduleInfo] = {}


def register_schedule(
    name: str,
    fn: ScheduleGenerator,
    *,
    key: str = "",
    aliases: tuple[str, ...] = (),
    stages_per_rank: int | None = 1,
    split_backward: bool = False,
    simulated: bool = True,
    overwrite: bool = False,
) -> ScheduleInfo:
    """Register ``fn`` under ``name`` (and ``key``, ``aliases``) so ``build_schedule(name, ...)`` calls it.

    ``fn`` is called as ``fn(num_stages=..., num_microbatches=..., num_ranks=..., recompute=..., **options)``
    (``num_ranks`` may be None, ``recompute`` is a :class:`RecomputePlan` or None) and must return a
    compute-only :class:`Schedule`. A spelling already taken by another schedule is an error unless
    ``overwrite`` (then that schedule is replaced).
    """
    info = ScheduleInfo(
        name=name,
        generator=fn,
        key=key,
        aliases=tuple(aliases),
        stages_per_rank=stages_per_rank,
        split_backward=split_backward,
        simulated=simulated,
    )
    clashes = sorted({other.name for other in _REGISTRY.values() if other.spellings & info.spellings})
    if clashes and not overwrite:
        raise ValueError(
            f"a schedule named {name!r} (or one of {sorted(info.spellings)}) is already registered as {clashes}; "
            f"pass overwrite=True to replace it or choose another name (registered: {available_schedules()})"
        )
    for other in clashes:
        del _REGISTRY[other]
    _REGISTRY[name] = info
    return info


def schedule_info(name: str) -> ScheduleInfo:
    """The schedule registered under ``name``, its key or an alias; ValueError naming the choices otherwise."""
    if isinstance(name, str):
        for info in _REGISTRY.values():
            if name in info.spellings:
                return info
    raise ValueError(
        f"unknown schedule {name!r}; expected one of {available_schedules()} "
        "or register your own with merak_pipe.register_schedule"
    )


def schedule_infos() -> list[ScheduleInfo]:
    """Every registered schedule, in registration order (the built-ins first)."""
    return list(_REGISTRY.values())


def available_schedules() -> list[str]:
    """Canonical names accepted by :func:`build_schedule`, sorted."""
    return sorted(_REGISTRY)
