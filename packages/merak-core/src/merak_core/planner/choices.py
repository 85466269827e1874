"""What the planners choose among: layouts, schedules (from merak-pipe's registry) and recomputation modes.

Every schedule list of the planner (the profiled search in :mod:`.search`, the cluster search in
:mod:`.cluster_search`, the dry run) is derived here from :func:`merak_pipe.schedule_infos` and its
capabilities (stages per rank, whether the simulator predicts it), in the registry's order and
with the config spelling (``ScheduleInfo.key``). A schedule registered later with those
capabilities joins the searches without an edit here.

Not done here: pricing a schedule (:mod:`.pricing`, :mod:`.cluster_cost`) or choosing one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from merak_pipe import ScheduleInfo, build_schedule, in_flight_counts, schedule_info, schedule_infos

__all__ = [
    "AUTO_VIRTUAL_STAGES",
    "CLUSTER_SCHEDULES",
    "PLANNER_SCHEDULES",
    "PREDICTABLE_SCHEDULES",
    "RECOMPUTE_MODES",
    "VIRTUAL_STAGE_SCHEDULES",
    "check_counts",
    "divisors",
    "layouts",
    "schedule_order",
    "searched_virtual_stages",
    "virtual_stage_schedules",
]

PLANNER_SCHEDULES = tuple(info.key for info in schedule_infos() if info.one_stage_per_rank and info.simulated)
"""Schedules the Trainer runs with one stage per rank and the simulator predicts (config spelling)."""
VIRTUAL_STAGE_SCHEDULES = tuple(
    info.key for info in schedule_infos() if not info.one_stage_per_rank and info.simulated
)
"""Schedules with several stages per rank (``virtual_stages``), planned when the search is given v > 1."""
RECOMPUTE_MODES = ("none", "full", "stage_aware")
AUTO_VIRTUAL_STAGES = (1, 2)
"""Stages per pipeline rank that ``layout: auto`` and the plan check's re-plan try when every rank has
a device of its own (:func:`searched_virtual_stages`): one, and two (interleaved-1F1B, ZB-V) where the
layers divide (see [Note: virtual stages in the search] in :mod:`.search`). More per rank would halve
the bubble again but double the point-to-point messages."""
PREDICTABLE_SCHEDULES = PLANNER_SCHEDULES + VIRTUAL_STAGE_SCHEDULES
"""Every schedule the planners can price (the simulator predicts it), one stage per rank first."""


def check_counts(where: str, named: Iterable[tuple[str, object]]) -> None:
    """ValueError ``"{where}: {name}={value!r}; expected an int >= 1"`` for the first of ``named`` (pairs of
    name and value) that is not an int >= 1 (a bool is not an int here): the planners' argument check."""
    for name, v in named:
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{where}: {name}={v!r}; expected an int >= 1")


def _bounded_in_flight(info: ScheduleInfo) -> bool:
    """Whether no stage holds every microbatch at once (two stages, eight microbatches): GPipe's
    memory grows with the microbatches, 1F1B-like schedules' does not."""
    num_microbatches = 8
    sched = build_schedule(info.name, num_stages=2, num_ranks=2, num_microbatches=num_microbatches)
    return max(in_flight_counts(sched)) < num_microbatches


CLUSTER_SCHEDULES = tuple(
    info.key
    for info in schedule_infos()
    if info.one_stage_per_rank and info.simulated and not info.split_backward and _bounded_in_flight(info)
)
"""Schedules the cluster search tries by default: one stage per rank, one backward action per
microbatch (the cluster cost model prices a stage's backward whole) and activations that do not
grow with the microbatch count (GPipe's do: never better than 1F1B there, only larger)."""


def schedule_order(schedule: str) -> int:
    """Position of ``schedule`` (any spelling) among :data:`PREDICTABLE_SCHEDULES`, for stable ranking."""
    return PREDICTABLE_SCHEDULES.index(schedule_info(schedule).key)


def searched_virtual_stages(compute_slots: float | None) -> tuple[int, ...]:
    """The ``virtual_stages`` that ``layout: auto`` searches: :data:`AUTO_VIRTUAL_STAGES` with a device
    per rank (``compute_slots`` None), one stage per rank when ranks share a host's cores.

    [Note: virtual stages on shared cores] CPU ranks sharing cores run interleaved-1F1B and ZB-V
    slower than 1F1B in the Trainer: on the 2-core machine, quiet, interleaved 1.02x / 1.12x and ZB-V
    1.16x / 1.29x 1F1B's step at pp = 2 / 4 (``benchmarks/bench_virtual_stages.py``; the dated runs,
    loaded ones too, are in docs/virtual_stages.md, "Predicting virtual stages before running them").
    The planner now prices two of the causes, the runtime's cost per action
    (``CommModel.per_action_s``) and the split backward (``CommModel.split_backward_scale``), both
    measured by ``layout: auto``; not the third, that with more ranks than cores a smaller bubble
    keeps more ranks computing at once, each slower (the benchmark's ``pred+ cores`` term), which
    makes up most of the error at pp = 4. Until the planner prices that, the search does not offer
    more than one stage per rank there.
    """
    return AUTO_VIRTUAL_STAGES if compute_slots is None else (1,)


def virtual_stage_schedules(virtual_stages: int) -> tuple[str, ...]:
    """The schedules of :data:`VIRTUAL_STAGE_SCHEDULES` that run ``virtual_stages`` stages per rank
    (the registry's ``runs_stages_per_rank``)."""
    return tuple(
        key for key in VIRTUAL_STAGE_SCHEDULES if schedule_info(key).runs_stages_per_rank(virtual_stages)
    )


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(
    world_size: int, *, num_layers: int, global_batch_size: int, tp_allowed: Callable[[int], bool]
) -> list[tuple[int, int, int]]:
    """Every (dp, tp, pp) with dp * tp * pp = ``world_size`` that a model allows: ``tp_allowed(tp)``
    (it divides heads, kv heads, vocabulary; on a cluster, the devices per node), pp <= ``num_layers``,
    dp divides ``global_batch_size``. Ordered by tp, then pp."""
    out = []
    for tp in divisors(world_size):
        if not tp_allowed(tp):
            continue
        for pp in divisors(world_size // tp):
            dp = world_size // (tp * pp)
            if pp <= num_layers and global_batch_size % dp == 0:
                out.append((dp, tp, pp))
    return out
