"""Validation: a schedule runs every needed action exactly once, in an order that cannot deadlock.

Checks, in order, each raising :class:`~merak_pipe.ir.ScheduleError` with the per-rank table
and the bad step marked:

1. every action names a stage held by its rank and a microbatch in range;
2. send/recv actions appear only in lowered schedules;
3. every (stage, microbatch) has exactly one F and either one B, or one I and one W; at most
   one R, and only on a stage whose recompute fraction is > 0;
4. a lowered schedule has exactly one SEND and one RECV for each cross-rank edge and none else;
5. executed in order (sends and receives posted asynchronously, a compute action waiting for
   its received data: [Note: p2p semantics] in ``_engine.py``), every action runs: dependencies hold (F before R before B/I before W, a
   stage's F after the previous stage's F, a B/I after the next stage's B/I) and nothing deadlocks.

It does not check costs or memory; that is the simulator's job.
"""

from __future__ import annotations

from collections import Counter

from merak_pipe._engine import describe_event, execute
from merak_pipe.ir import Action, ActionKind, Schedule, ScheduleError, format_table

__all__ = ["validate"]

_CONTEXT_ROWS = 12


def _fail(schedule: Schedule, message: str, rank: int | None = None, step: int | None = None) -> ScheduleError:
    mark = (rank, step) if rank is not None and step is not None else None
    table = _table_excerpt(schedule, mark)
    where = f"rank {rank}, step {step}: " if mark is not None else ""
    return ScheduleError(f"{where}{message}\n\n{table}", rank=rank, step=step)


def _table_excerpt(schedule: Schedule, mark: tuple[int, int] | None) -> str:
    """The full table, or the rows around the marked step for long schedules."""
    text = format_table(schedule, mark=mark)
    lines = text.splitlines()
    head, body = lines[:3], lines[3:]
    if len(body) <= 4 * _CONTEXT_ROWS:
        return text
    center = mark[1] if mark is not None else 0
    lo = max(0, center - _CONTEXT_ROWS)
    hi = min(len(body), center + _CONTEXT_ROWS + 1)
    excerpt = body[lo:hi]
    if lo > 0:
        excerpt.insert(0, f"  ... ({lo} steps above)")
    if hi < len(body):
        excerpt.append(f"  ... ({len(body) - hi} steps below)")
    return "\n".join(head + excerpt)


def _check_structure(schedule: Schedule) -> None:
    S, M = schedule.num_stages, schedule.num_microbatches
    counts: Counter[tuple[int, ActionKind, int]] = Counter()
    where: dict[tuple[int, ActionKind, int], tuple[int, int]] = {}
    plan = schedule.recompute
    for rank in range(schedule.num_ranks):
        for step, a in enumerate(schedule.actions[rank]):
            if not isinstance(a, Action):
                raise _fail(schedule, f"{a!r} is not an Action", rank, step)
            if a.stage >= S:
                raise _fail(schedule, f"{a} names stage {a.stage} but the schedule has {S} stages (0..{S - 1})", rank, step)
            if a.microbatch >= M:
                raise _fail(
                    schedule, f"{a} names microbatch {a.microbatch} but the schedule has {M} (0..{M - 1})", rank, step
                )
            if schedule.stage_to_rank[a.stage] != rank:
                raise _fail(
                    schedule,
                    f"{a} runs on rank {rank} but stage {a.stage} is held by rank {schedule.stage_to_rank[a.stage]}",
                    rank,
                    step,
                )
            if a.kind.is_comm and not schedule.lowered:
                raise _fail(
                    schedule, f"{a} is a send/recv in a schedule with lowered=False; use merak_pipe.lower()", rank, step
                )
            if a.kind is ActionKind.RECOMPUTE and (plan is None or plan[a.stage] == 0.0):
                raise _fail(
                    schedule,
                    f"{a} recomputes stage {a.stage}, whose recompute fraction is 0 (plan: "
                    f"{None if plan is None else plan.fractions}); drop the R action or give the stage a fraction > 0",
                    rank,
                    step,
                )
            k = (a.stage, a.kind, a.microbatch)
            counts[k] += 1
            if counts[k] > 1:
                first = where[k]
                raise _fail(
                    schedule, f"{a} appears twice (first at rank {first[0]}, step {first[1]})", rank, step
                )
            where[k] = (rank, step)
    F, B, BI, W = (ActionKind.FORWARD, ActionKind.FULL_BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT)
    for s in range(S):
        for m in range(M):
            if counts[(s, F, m)] != 1:
                raise _fail(schedule, f"stage {s} microbatch {m} has no forward {Action(s, F, m)}")
            b, i, w = counts[(s, B, m)], counts[(s, BI, m)], counts[(s, W, m)]
            if b and (i or w):
                r, st = where[(s, BI, m)] if i else where[(s, W, m)]
                raise _fail(schedule, f"stage {s} microbatch {m} has both a full backward B and a split I/W", r, st)
            if not b and not (i and w):
                missing = Action(s, BI, m) if w else Action(s, W, m) if i else Action(s, B, m)
                raise _fail(schedule, f"stage {s} microbatch {m} has no {missing} (needs one B, or one I and one W)")
    if schedule.lowered:
        _check_comms(schedule, counts, where)


def _check_comms(
    schedule: Schedule,
    counts: Counter[tuple[int, ActionKind, int]],
    where: dict[tuple[int, ActionKind, int], tuple[int, int]],
) -> None:
    S, M = schedule.num_stages, schedule.num_microbatches
    expected: set[tuple[int, ActionKind, int]] = set()
    for s in range(S - 1):
        if schedule.stage_to_rank[s] != schedule.stage_to_rank[s + 1]:
            for m in range(M):
                expected.add((s, ActionKind.SEND_F, m))
                expected.add((s + 1, ActionKind.RECV_F, m))
                expected.add((s + 1, ActionKind.SEND_B, m))
                expected.add((s, ActionKind.RECV_B, m))
    present = {k for k, c in counts.items() if c and k[1].is_comm}
    for k in sorted(present - expected, key=lambda k: where[k]):
        rank, step = where[k]
        raise _fail(
            schedule, f"{Action(*k)} has no cross-rank edge to serve (its peer stage is on the same rank or absent)", rank, step
        )
    for k in sorted(expected - present, key=lambda k: (k[0], k[2], k[1].value)):
        raise _fail(schedule, f"lowered schedule lacks {Action(*k)} (stages on different ranks need a send and a recv)")


def validate(schedule: Schedule) -> Schedule:
    """Check ``schedule`` (compute-only or lowered); return it unchanged or raise ScheduleError."""
    _check_structure(schedule)
    _order, blocked, keys, _deps, _prod = execute(schedule)
    if blocked:
        locations: dict[Action, tuple[int, int]] = {}
        for rank in range(schedule.num_ranks):
            for step, a in enumerate(schedule.actions[rank]):
                locations[a] = (rank, step)
        first = min(blocked, key=lambda b: (b.step, b.rank))
        lines = []
        for b in blocked:
            needed = describe_event(keys, b.waits_for, schedule)
            at = locations.get(needed)
            later = (
                f"which rank {at[0]} runs at step {at[1]}, itself blocked or after a blocked step"
                if at is not None
                else "which no rank runs"
            )
            if at is not None and at[0] == b.rank:
                later = f"which this rank only runs later, at step {at[1]}"
            lines.append(f"  rank {b.rank} step {b.step} ({schedule.actions[b.rank][b.step]}) waits for {needed}, {later}")
        raise _fail(
            schedule,
            f"schedule {schedule.name!r} deadlocks or breaks a dependency:\n" + "\n".join(lines),
            first.rank,
            first.step,
        )
    return schedule
