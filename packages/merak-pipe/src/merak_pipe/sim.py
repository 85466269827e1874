"""A discrete-event simulator for schedules: time, bubbles, critical path and activation memory.

Each rank runs its actions in order; an action starts when its rank is free and every action it
depends on has finished (plus a point-to-point delay when the dependency crosses ranks). The
rules are those of the validator (``_dependencies.py``), so a schedule that validates simulates.

Costs (:class:`CostModel`, any consistent time unit) are per stage: F, B (without recompute),
I and W (default: half of B each), and the time to recompute the whole stage's forward, scaled by
the plan's fraction. A stage that recomputes without ``R`` actions recomputes inside its B/I.
The runtime's own cost per action (``per_action``, [Note: per-action cost]) is added on top.

Memory model ([Note: activation memory]): per stage and microbatch, ``activation_bytes`` is the
activation memory of the whole stage when nothing is recomputed. With recompute fraction f:
  after F:        keeps (1 - f) * A, plus ``input_bytes`` (the stage input) when f > 0;
  R, or B/I without R: allocates f * A at its start (the recomputed activations);
  after B:        frees everything of that microbatch;
  after I:        frees all but ``weight_grad_fraction`` * A (what W needs), freed after W.
Memory is counted at action starts and ends; transients inside one action (e.g. a checkpointed
segment's own forward) are not.
"""

from __future__ import annotations

from dataclasses import dataclass

from merak_pipe._dependencies import _GRAD, _SENT_B, execute, paused_gc
from merak_pipe._sim_model import CostModel, SimResult, TimedAction, _per_stage
from merak_pipe.ir import ActionKind, Schedule, ScheduleError
from merak_pipe.validate import _check_structure, validate

__all__ = ["CostModel", "SimResult", "TimedAction", "simulate"]


def simulate(schedule: Schedule, costs: CostModel | None = None, *, check: bool = True) -> SimResult:
    """Simulate ``schedule`` (compute-only or lowered) under ``costs``.

    With ``check=True`` the schedule's structure is validated first and a deadlock raises
    :class:`ScheduleError`; ``check=False`` skips the structural checks. A decode schedule
    (:func:`merak_pipe.decode_schedule`) runs under its own dependency rules (``_decode_rules.py``:
    forwards only, no memory model) and is always checked.
    """
    if schedule.is_decode:
        from merak_pipe._decode_rules import simulate_decode

        return simulate_decode(schedule, costs)
    with paused_gc():
        return _simulate(schedule, costs, check)


@dataclass
class _StageCosts:
    """The cost model resolved to one value per stage (the schedule's plan applied)."""

    forward: list[float]
    backward: list[float]
    backward_input: list[float]
    backward_weight: list[float]
    recompute: list[float]
    """Recompute time of each stage's planned fraction."""
    message: list[float]
    """Time of the message that carries stage s's output (and its gradient back)."""
    fractions: list[float]
    activation_bytes: list[float]
    input_bytes: list[float]


def _stage_costs(schedule: Schedule, costs: CostModel) -> _StageCosts:
    S = schedule.num_stages
    fwd = _per_stage("forward", costs.forward, S)
    bwd = _per_stage("backward", costs.backward, S)
    b_in = (
        _per_stage("backward_input", costs.backward_input, S)
        if costs.backward_input is not None
        else [b / 2 for b in bwd]
    )
    b_w = (
        _per_stage("backward_weight", costs.backward_weight, S)
        if costs.backward_weight is not None
        else [b - i for b, i in zip(bwd, b_in, strict=True)]
    )
    if any(w < 0 for w in b_w):
        raise ValueError(
            f"CostModel.backward_input={costs.backward_input!r} exceeds backward={costs.backward!r}, so the default "
            "backward_weight (backward - backward_input) is negative; give backward_weight explicitly"
        )
    rec_full = _per_stage("recompute", costs.recompute, S) if costs.recompute is not None else list(fwd)
    boundary = _per_stage("boundary_bytes", costs.boundary_bytes, S)
    frac = list(schedule.recompute.fractions) if schedule.recompute is not None else [0.0] * S
    return _StageCosts(
        forward=fwd,
        backward=bwd,
        backward_input=b_in,
        backward_weight=b_w,
        recompute=[rec_full[s] * frac[s] for s in range(S)],
        message=[costs.p2p_latency + boundary[s] / costs.p2p_bandwidth for s in range(S)],
        fractions=frac,
        activation_bytes=_per_stage("activation_bytes", costs.activation_bytes, S),
        input_bytes=_per_stage("input_bytes", costs.input_bytes, S),
    )


def _recomputed_by_r(schedule: Schedule) -> bytearray:
    """Flags per ``stage * M + microbatch``: 1 where an explicit ``R`` action recomputes it."""
    M = schedule.num_microbatches
    flags = bytearray(schedule.num_stages * M)
    for acts in schedule.actions.values():
        for a in acts:
            if a.kind is ActionKind.RECOMPUTE:
                flags[a.stage * M + a.microbatch] = 1
    return flags


def _durations(schedule: Schedule, c: _StageCosts, per_action: float = 0.0) -> list[list[float]]:
    """Duration of each action, per rank and step: the one kind -> duration map.

    A ``B``/``I`` recomputes inside itself unless an ``R`` action did it first.
    """
    S, M = schedule.num_stages, schedule.num_microbatches
    plain = {
        ActionKind.FORWARD: c.forward,
        ActionKind.FULL_BACKWARD: c.backward,
        ActionKind.BACKWARD_INPUT: c.backward_input,
        ActionKind.BACKWARD_WEIGHT: c.backward_weight,
        ActionKind.RECOMPUTE: c.recompute,
    }
    implicit = dict(plain)
    for kind in (ActionKind.FULL_BACKWARD, ActionKind.BACKWARD_INPUT):
        implicit[kind] = [plain[kind][st] + c.recompute[st] for st in range(S)]
    by_r = _recomputed_by_r(schedule)
    zeros = [0.0] * S
    durations: list[list[float]] = []
    overhead = _action_overheads(schedule, per_action)
    for rank in range(schedule.num_ranks):
        durations.append(
            [
                (plain if by_r[a.stage * M + a.microbatch] else implicit).get(a.kind, zeros)[a.stage]
                + overhead.get(a.kind, zeros)[a.stage]
                for a in schedule.actions[rank]
            ]
        )
    return durations


def _action_overheads(schedule: Schedule, per_action: float) -> dict[ActionKind, list[float]]:
    """Per kind and stage: the runtime's own time an action costs ([Note: per-action cost]).

    [Note: per-action cost]
    The runtime spends host time on every action besides the math: issuing sends and receives,
    the bookkeeping around each compute action, waking up when a message arrives. Measured per
    action (``bench_pipe_runtime.py --section actions``: the step on tiny stages divided by the
    busiest rank's lowered actions), it is priced as ``per_action`` on every action: each compute
    action, each SEND/RECV of a lowered schedule; a compute-only schedule has no SEND/RECV, so its
    compute actions carry one more ``per_action`` per message lowering would add for them (F:
    receive of its input, send of its output; B/I: receive of the output gradient, send of the
    input gradient; only across ranks). A lowered and a compute-only schedule therefore cost the
    same, and schedules with more actions per step (virtual stages, split backward) pay for them.
    """
    S = schedule.num_stages
    if per_action == 0.0:
        return {}
    out = {kind: [per_action] * S for kind in ActionKind}
    if schedule.lowered:
        return out
    rank_of = schedule.stage_to_rank
    crossings = [
        int(s > 0 and rank_of[s - 1] != rank_of[s]) + int(s < S - 1 and rank_of[s + 1] != rank_of[s])
        for s in range(S)
    ]
    for kind in (ActionKind.FORWARD, ActionKind.FULL_BACKWARD, ActionKind.BACKWARD_INPUT):
        out[kind] = [per_action * (1 + crossings[s]) for s in range(S)]
    return out


@dataclass
class _Times:
    """Start and end of every action, and its predecessor on the critical path."""

    starts: list[list[float]]
    ends: list[list[float]]
    binding: list[list[int]]
    """Predecessor encoded as ``rank * stride + step`` (-1: none)."""
    stride: int
    rank_free: list[float]


def _run_times(
    schedule: Schedule,
    order: list[tuple[int, int]],
    deps: list[list[tuple[int, ...]]],
    produces: list[list[int]],
    durations: list[list[float]],
    message: list[float],
) -> _Times:
    """Each action starts when its rank is free and its inputs have arrived (ranks in ``order``)."""
    S, M = schedule.num_stages, schedule.num_microbatches
    num_ranks = schedule.num_ranks
    has_comm_delay = any(t > 0 for t in message)
    size = 8 * S * M
    finish = [0.0] * size
    src_rank = [0] * size
    src_step = [0] * size
    rank_free = [0.0] * num_ranks
    starts: list[list[float]] = [[0.0] * len(schedule.actions[r]) for r in range(num_ranks)]
    ends: list[list[float]] = [[0.0] * len(schedule.actions[r]) for r in range(num_ranks)]
    stride = max((len(a) for a in schedule.actions.values()), default=0) + 1
    binding: list[list[int]] = [[-1] * len(schedule.actions[r]) for r in range(num_ranks)]
    grad_codes = (_GRAD, _SENT_B)
    for rank, step in order:
        start = rank_free[rank]
        bind = rank * stride + step - 1 if step > 0 else -1
        for k in deps[rank][step]:
            t = finish[k]
            sr = src_rank[k]
            if has_comm_delay and sr != rank:
                code, ks = divmod(k // M, S)
                # F-type messages carry stage ks's output; gradients carry the output of stage ks - 1.
                t += message[ks - 1] if code in grad_codes else message[ks]
            if t > start:
                start = t
                bind = sr * stride + src_step[k]
        end = start + durations[rank][step]
        rank_free[rank] = end
        starts[rank][step] = start
        ends[rank][step] = end
        binding[rank][step] = bind
        key = produces[rank][step]
        finish[key] = end
        src_rank[key] = rank
        src_step[key] = step
    return _Times(starts, ends, binding, stride, rank_free)


def _critical_path(schedule: Schedule, times: _Times) -> list[TimedAction]:
    """Walk back from the action that finishes last along each action's binding predecessor."""
    path: list[TimedAction] = []
    num_ranks = schedule.num_ranks
    last_rank = max(range(num_ranks), key=lambda r: times.rank_free[r])
    if schedule.actions[last_rank]:
        stride = times.stride
        cur = last_rank * stride + len(schedule.actions[last_rank]) - 1
        while cur >= 0:
            r, st = divmod(cur, stride)
            path.append(TimedAction(r, schedule.actions[r][st], times.starts[r][st], times.ends[r][st]))
            cur = times.binding[r][st]
        path.reverse()
    return path


def _simulate(schedule: Schedule, costs: CostModel | None, check: bool) -> SimResult:
    costs = costs or CostModel()
    if check:
        _check_structure(schedule)  # the deadlock check is the execution below
    c = _stage_costs(schedule, costs)
    order, blocked, _keys, deps, produces = execute(schedule)
    if blocked:
        validate(schedule)  # raises with the table and the blocked steps
        raise ScheduleError(f"schedule {schedule.name!r} deadlocks")  # pragma: no cover
    durations = _durations(schedule, c, costs.per_action)
    times = _run_times(schedule, order, deps, produces, durations, c.message)
    busy = [sum(d) for d in durations]
    makespan = max(times.rank_free, default=0.0)
    memory, peak, peak_rank = _memory(schedule, times.starts, times.ends, c, costs.weight_grad_fraction)
    return SimResult(
        schedule=schedule,
        makespan=makespan,
        busy=busy,
        bubble_fraction=[1.0 - b / makespan if makespan > 0 else 0.0 for b in busy],
        critical_path=_critical_path(schedule, times),
        memory=memory,
        peak_memory=peak,
        peak_memory_per_rank=peak_rank,
        costs=costs,
        _order=order,
        _starts=times.starts,
        _ends=times.ends,
    )


def _memory_deltas(
    schedule: Schedule, c: _StageCosts, wgrad_fraction: float
) -> tuple[dict[ActionKind, list[tuple[float, float]]], dict[ActionKind, list[tuple[float, float]]]]:
    """Per kind and stage: (bytes added at the start, bytes added at the end) of an action.

    Two tables: for a microbatch recomputed by an ``R`` action, and for one whose ``B``/``I``
    recomputes inside itself (it allocates the recomputed activations at its start).
    """
    S = schedule.num_stages
    frac, act_bytes, in_bytes = c.fractions, c.activation_bytes, c.input_bytes
    kept_after_f = [(1.0 - frac[s]) * act_bytes[s] + (in_bytes[s] if frac[s] > 0 else 0.0) for s in range(S)]
    recomputed = [frac[s] * act_bytes[s] for s in range(S)]
    keep_for_w = [wgrad_fraction * act_bytes[s] for s in range(S)]
    total = [kept_after_f[s] + recomputed[s] for s in range(S)]
    by_r = {
        ActionKind.FORWARD: [(0.0, kept_after_f[s]) for s in range(S)],
        ActionKind.FULL_BACKWARD: [(0.0, -total[s]) for s in range(S)],
        ActionKind.BACKWARD_INPUT: [(0.0, keep_for_w[s] - total[s]) for s in range(S)],
        ActionKind.BACKWARD_WEIGHT: [(0.0, -keep_for_w[s]) for s in range(S)],
        ActionKind.RECOMPUTE: [(recomputed[s], 0.0) for s in range(S)],
    }
    inside = dict(by_r)
    for kind in (ActionKind.FULL_BACKWARD, ActionKind.BACKWARD_INPUT):
        inside[kind] = [(recomputed[s], end) for s, (_, end) in enumerate(by_r[kind])]
    return by_r, inside


def _dedupe(curve: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Several changes at one instant: keep the last value (peaks are tracked separately)."""
    deduped: list[tuple[float, float]] = []
    for point in curve:
        if deduped and deduped[-1][0] == point[0]:
            deduped[-1] = point
        else:
            deduped.append(point)
    return deduped


def _memory(
    schedule: Schedule,
    starts: list[list[float]],
    ends: list[list[float]],
    c: _StageCosts,
    wgrad_fraction: float,
) -> tuple[dict[int, list[tuple[float, float]]], list[float], list[float]]:
    """Activation memory per stage; see [Note: activation memory] in the module docstring.

    A validated schedule runs F, then R if any, then B (or I then W) for each (stage, microbatch),
    so what a backward frees is known without bookkeeping per microbatch: the F's kept bytes plus
    the recomputed ``f * A``.
    """
    S, M = schedule.num_stages, schedule.num_microbatches
    by_r_table, inside_table = _memory_deltas(schedule, c, wgrad_fraction)
    by_r = _recomputed_by_r(schedule)
    memory: dict[int, list[tuple[float, float]]] = {s: [(0.0, 0.0)] for s in range(S)}
    peak = [0.0] * S
    peak_rank = [0.0] * schedule.num_ranks
    current = [0.0] * S
    for rank in range(schedule.num_ranks):
        rank_total = 0.0
        rank_peak = 0.0
        rank_starts, rank_ends = starts[rank], ends[rank]
        for step, a in enumerate(schedule.actions[rank]):
            s = a.stage
            row = (by_r_table if by_r[s * M + a.microbatch] else inside_table).get(a.kind)
            if row is None:
                continue
            delta_start, delta_end = row[s]
            cur = current[s]
            points = memory[s]
            if delta_start:
                cur += delta_start
                rank_total += delta_start
                points.append((rank_starts[step], cur))
                peak[s] = max(peak[s], cur)
                rank_peak = max(rank_peak, rank_total)
            if delta_end:
                cur = max(cur + delta_end, 0.0)  # rounding
                rank_total += delta_end
                points.append((rank_ends[step], cur))
                peak[s] = max(peak[s], cur)
                rank_peak = max(rank_peak, rank_total)
            current[s] = cur
        peak_rank[rank] = rank_peak
    # A stage's points were appended in its rank's order, which is chronological.
    return {s: _dedupe(memory[s]) for s in range(S)}, peak, peak_rank
