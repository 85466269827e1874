"""Recomputation plans: which fraction of each stage's layers recomputes its activations.

A :class:`RecomputePlan` (data, defined with the IR in :mod:`merak_pipe.ir` and re-exported
here) holds, per stage, a fraction in [0, 1]: 0.0 keeps every activation, 1.0 checkpoints
the whole stage (only its input is kept and the forward is run again before the backward).
The runtime checkpoints the first ``round(f * num_units)`` units of a stage (an
``nn.Sequential`` stage is a chain of units; any other module is one unit).

Plans are built by :meth:`RecomputePlan.none`, :meth:`RecomputePlan.full`,
:meth:`RecomputePlan.uniform`, :func:`closed_form_plan` (Merak's ``(1 - r_i)(S - 1 - i) = const``)
and :func:`stage_aware_plan` (the smallest fraction per stage that fits a memory budget).
This module does not measure anything: sizes are inputs.
"""

from __future__ import annotations

from collections.abc import Sequence

from merak_pipe.ir import ActionKind, RecomputePlan, Schedule, _check_stages

__all__ = ["RecomputePlan", "as_plan", "closed_form_plan", "in_flight_counts", "stage_aware_plan"]


def as_plan(recompute: RecomputePlan | str | float | None, num_stages: int) -> RecomputePlan | None:
    """Normalise the ``recompute=`` argument of :func:`merak_pipe.build_schedule`.

    Accepts None, a :class:`RecomputePlan`, ``"none"``, ``"full"``, or a float (uniform fraction).
    """
    if recompute is None or isinstance(recompute, RecomputePlan):
        if recompute is not None and recompute.num_stages != num_stages:
            raise ValueError(
                f"recompute plan covers {recompute.num_stages} stages but num_stages={num_stages}; "
                "build the plan for this pipeline"
            )
        return recompute
    if isinstance(recompute, str):
        if recompute == "none":
            return RecomputePlan.none(num_stages)
        if recompute == "full":
            return RecomputePlan.full(num_stages)
        raise ValueError(
            f"recompute={recompute!r}; expected 'none', 'full', a float in [0, 1] or a RecomputePlan"
        )
    if isinstance(recompute, (int, float)) and not isinstance(recompute, bool):
        return RecomputePlan.uniform(num_stages, float(recompute))
    raise ValueError(
        f"recompute={recompute!r}; expected None, 'none', 'full', a float in [0, 1] or a RecomputePlan"
    )


def closed_form_plan(num_stages: int, first_stage_fraction: float) -> RecomputePlan:
    """Merak's closed form: ``(1 - r_i) * (S - 1 - i)`` is the same for every stage, the last stage 0.

    ``r_i = 1 - (1 - r_0) * (S - 1) / (S - 1 - i)``, clipped at 0. It is what
    :func:`stage_aware_plan` gives for uniform layers, no static memory, an in-flight count of
    ``S - 1 - i`` and a budget of ``(1 - r_0) * (S - 1)`` microbatches of activations.
    """
    _check_stages(num_stages)
    if not 0.0 <= first_stage_fraction <= 1.0:
        raise ValueError(f"first_stage_fraction={first_stage_fraction}; expected a value in [0, 1]")
    S = num_stages
    fractions = []
    for i in range(S):
        if i == S - 1:
            fractions.append(0.0)
        else:
            fractions.append(max(0.0, 1.0 - (1.0 - first_stage_fraction) * (S - 1) / (S - 1 - i)))
    return RecomputePlan(tuple(fractions))


def in_flight_counts(schedule: Schedule) -> list[int]:
    """Per stage: the most microbatches whose forward ran and whose last backward (B or W) has not.

    This is the number of microbatches of activations a stage holds at once under ``schedule``.
    """
    live = [0] * schedule.num_stages
    peak = [0] * schedule.num_stages
    split = {(a.stage, a.microbatch) for _, a in schedule if a.kind is ActionKind.BACKWARD_WEIGHT}
    for rank in range(schedule.num_ranks):
        for a in schedule.actions[rank]:
            if a.kind is ActionKind.FORWARD:
                live[a.stage] += 1
                peak[a.stage] = max(peak[a.stage], live[a.stage])
            elif a.kind is ActionKind.BACKWARD_WEIGHT or (
                a.kind is ActionKind.FULL_BACKWARD and (a.stage, a.microbatch) not in split
            ):
                live[a.stage] -= 1
    return peak


def _per_stage_values(name: str, value: float | Sequence[float], num_stages: int) -> list[float]:
    if isinstance(value, (int, float)):
        return [float(value)] * num_stages
    values = [float(v) for v in value]
    if len(values) != num_stages:
        raise ValueError(
            f"{name} has {len(values)} values but there are {num_stages} stages; give one per stage"
        )
    return values


def stage_aware_plan(
    *,
    layer_activation_bytes: Sequence[Sequence[float]],
    memory_budget: float | Sequence[float],
    static_bytes: float | Sequence[float] = 0.0,
    in_flight: Sequence[int] | None = None,
    schedule: Schedule | None = None,
    input_bytes: float | Sequence[float] = 0.0,
    count_recompute_buffer: bool = True,
    stage_to_rank: Sequence[int] | None = None,
) -> RecomputePlan:
    """For each stage, the smallest recompute fraction whose memory fits its device's budget.

    ``layer_activation_bytes[s][j]`` is the activation memory of layer j of stage s for one
    microbatch; ``static_bytes`` is a stage's parameters + gradients + optimizer state;
    ``memory_budget`` is the memory of one device (a number, or one per device);
    ``in_flight[s]`` is how many microbatches stage s holds at once (or pass ``schedule`` to count
    it, see :func:`in_flight_counts`). Checkpointing the first k of L layers (fraction k / L) keeps,
    per microbatch, the activations of layers k.. plus the stage input (``input_bytes``) when
    k > 0; with ``count_recompute_buffer`` one microbatch's recomputed layers are counted on top.

    Stages share a device according to ``stage_to_rank`` (default: the schedule's, else one stage
    per device). A device with one stage gets the smallest fraction that fits. A device with
    several stages (interleaved schedules) must fit the sum of its stages' peaks (a conservative
    bound: their peaks need not coincide) plus one recompute buffer; layers are checkpointed
    on the stage where they save the most memory per layer until the sum fits, then any layer
    whose recomputation is no longer needed is given back.

    Raises ValueError naming the stage (or device) when even full recomputation does not fit.
    """
    num_stages = len(layer_activation_bytes)
    _check_stages(num_stages)
    in_flight, stage_to_rank = _counts_and_placement(num_stages, in_flight, schedule, stage_to_rank)
    num_devices = len(set(stage_to_rank))
    budget = _per_stage_values("memory_budget", memory_budget, num_devices)
    static = _per_stage_values("static_bytes", static_bytes, num_stages)
    inputs = _per_stage_values("input_bytes", input_bytes, num_stages)
    tables: list[_StageMemory] = []
    for s, layers in enumerate(layer_activation_bytes):
        acts = [float(a) for a in layers]
        if not acts or any(a < 0 for a in acts):
            raise ValueError(f"layer_activation_bytes[{s}]={list(layers)!r}: expected one or more sizes >= 0")
        tables.append(_StageMemory(acts, static[s], int(in_flight[s]), inputs[s], count_recompute_buffer))
    chosen = [0] * num_stages
    for device in range(num_devices):
        stages = [s for s in range(num_stages) if stage_to_rank[s] == device]
        if len(stages) == 1:
            chosen[stages[0]] = _single_stage_layers(stages[0], tables[stages[0]], budget[device])
        else:
            for s, k in _shared_device_layers(device, stages, tables, budget[device]).items():
                chosen[s] = k
    return RecomputePlan(tuple(chosen[s] / tables[s].num_layers for s in range(num_stages)))


def _counts_and_placement(
    num_stages: int,
    in_flight: Sequence[int] | None,
    schedule: Schedule | None,
    stage_to_rank: Sequence[int] | None,
) -> tuple[Sequence[int], Sequence[int]]:
    """The in-flight counts and the stage-to-device map of :func:`stage_aware_plan`, checked."""
    if in_flight is None:
        if schedule is None:
            raise ValueError(
                "stage_aware_plan needs in_flight (one count per stage) or a schedule to count them"
            )
        in_flight = in_flight_counts(schedule)
    if len(in_flight) != num_stages:
        raise ValueError(
            f"in_flight has {len(in_flight)} counts but layer_activation_bytes has {num_stages} stages"
        )
    if stage_to_rank is None:
        stage_to_rank = schedule.stage_to_rank if schedule is not None else tuple(range(num_stages))
    if len(stage_to_rank) != num_stages or set(stage_to_rank) != set(range(len(set(stage_to_rank)))):
        raise ValueError(
            f"stage_to_rank={tuple(stage_to_rank)} must give a rank 0..R-1 to each of the {num_stages} stages"
        )
    return in_flight, stage_to_rank


def _single_stage_layers(s: int, table: _StageMemory, budget: float) -> int:
    """The fewest checkpointed layers with which a device's only stage fits ``budget``."""
    limit = budget * (1 + 1e-12)
    fits = [k for k in range(table.num_layers + 1) if table.need(k) <= limit]
    if not fits:
        raise ValueError(
            f"stage {s} does not fit its memory budget even with full recomputation: it needs at least "
            f"{table.least():.6g} bytes ({table.static:.6g} static + {table.in_flight} in-flight microbatches) "
            f"but the budget is {budget:.6g}; use more pipeline stages, smaller microbatches, fewer "
            "in-flight microbatches or a larger budget"
        )
    return fits[0]


def _shared_device_layers(
    device: int, stages: list[int], tables: list[_StageMemory], budget: float
) -> dict[int, int]:
    """Checkpointed layers per stage for a device holding several stages (see :func:`stage_aware_plan`)."""
    limit = budget * (1 + 1e-12)
    ks = {s: 0 for s in stages}

    def device_need(ks: dict[int, int]) -> float:
        return sum(tables[s].need(k, with_buffer=False) for s, k in ks.items()) + max(
            tables[s].buffer(k) for s, k in ks.items()
        )

    need = device_need(ks)
    while need > limit:
        # Best memory saved per fraction of a stage recomputed, looking past steps that save
        # nothing (the first checkpointed layer adds the kept stage input).
        best: tuple[float, int, int] | None = None
        for s in stages:
            for k in range(ks[s] + 1, tables[s].num_layers + 1):
                trial = dict(ks)
                trial[s] = k
                gain = (need - device_need(trial)) * tables[s].num_layers / (k - ks[s])
                if best is None or gain > best[0]:
                    best = (gain, s, k)
        if best is None or best[0] <= 0:
            raise ValueError(
                f"device {device} (stages {stages}) does not fit its memory budget {budget:.6g}: "
                f"it still needs {need:.6g} bytes with fractions "
                f"{[round(ks[s] / tables[s].num_layers, 4) for s in stages]}; use more devices, smaller "
                "microbatches or a larger budget"
            )
        ks[best[1]] = best[2]
        need = device_need(ks)
    # Give back any layer that is no longer needed (a jump may overshoot).
    trimmed = True
    while trimmed:
        trimmed = False
        for s in sorted(stages, key=lambda t: -ks[t] / tables[t].num_layers):
            if ks[s] > 0:
                trial = dict(ks)
                trial[s] -= 1
                if device_need(trial) <= limit:
                    ks = trial
                    trimmed = True
    return ks


class _StageMemory:
    """Memory of one stage when its first k layers are checkpointed (see stage_aware_plan)."""

    def __init__(
        self, acts: list[float], static: float, in_flight: int, input_bytes: float, with_buffer: bool
    ):
        self.num_layers = len(acts)
        self.static = static
        self.in_flight = in_flight
        self.input_bytes = input_bytes
        self.with_buffer = with_buffer
        self.suffix = [0.0] * (len(acts) + 1)
        for j in range(len(acts) - 1, -1, -1):
            self.suffix[j] = self.suffix[j + 1] + acts[j]

    def buffer(self, k: int) -> float:
        return (self.suffix[0] - self.suffix[k]) if self.with_buffer else 0.0

    def need(self, k: int, *, with_buffer: bool = True) -> float:
        kept = self.suffix[k] + (self.input_bytes if k > 0 else 0.0)
        return self.static + self.in_flight * kept + (self.buffer(k) if with_buffer else 0.0)

    def least(self) -> float:
        return min(self.need(k) for k in range(self.num_layers + 1))
