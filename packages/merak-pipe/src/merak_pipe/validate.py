"""Validation: a schedule runs every needed action exactly once, in an order that cannot deadlock.

Checks, in order, each raising :class:`~merak_pipe.ir.ScheduleError` with the per-rank table
and the bad step marked:

1. every action names a stage held by its rank and a microbatch in range;
2. send/recv actions appear only in lowered schedules;
3. every (stage, microbatch) has exactly one F and either one B, or one I and one W; at most
   one R, and only on a stage whose recompute fraction is > 0;
4. a lowered schedule has exactly one SEND and one RECV for each cross-rank edge and none else
   (and, with ``channel_order=True``, posts receives in the senders' order on each channel);
5. executed in order (sends and receives posted asynchronously, a compute action waiting for
   its received data: [Note: p2p semantics] in ``_dependencies.py``), every action runs: dependencies hold (F before R before B/I before W, a
   stage's F after the previous stage's F, a B/I after the next stage's B/I) and nothing deadlocks;
6. with ``nccl=True``, the runtime's issue order runs under NCCL's rules (``merak_pipe.nccl_check``).

It does not check costs or memory; that is the simulator's job.
"""

from __future__ import annotations

from merak_pipe._dependencies import describe_event, execute, paused_gc
from merak_pipe._schedule_errors import _fail
from merak_pipe.ir import Action, ActionKind, Schedule

__all__ = ["validate"]

_KINDS = list(ActionKind)
_KIND_INDEX = {kind: i for i, kind in enumerate(_KINDS)}


def _locate(schedule: Schedule, action: Action, nth: int = 0) -> tuple[int, int]:
    """Rank and step of the ``nth`` occurrence of ``action`` (error path only)."""
    seen = 0
    for rank in range(schedule.num_ranks):
        for step, a in enumerate(schedule.actions[rank]):
            if a == action:
                if seen == nth:
                    return rank, step
                seen += 1
    raise AssertionError(f"{action} not found")  # pragma: no cover


def _check_structure(schedule: Schedule) -> None:
    counts, kind_offset = _count_actions(schedule)
    _check_compute_counts(schedule, counts, kind_offset)
    if schedule.lowered:
        _check_comms(schedule, counts, kind_offset)


def _count_actions(schedule: Schedule) -> tuple[bytearray, dict[ActionKind, int]]:
    """Check every action alone and that none repeats; the counts per (kind, stage, microbatch)."""
    S, M = schedule.num_stages, schedule.num_microbatches
    SM = S * M
    # counts[kind_index * S * M + stage * M + microbatch], saturating at 2 (only 0, 1, "more" matter).
    counts = bytearray(len(_KINDS) * SM)
    plan = schedule.recompute
    stage_to_rank = schedule.stage_to_rank
    lowered = schedule.lowered
    kind_offset = {kind: i * SM for kind, i in _KIND_INDEX.items()}
    comm_kinds = {k for k in ActionKind if k.is_comm}
    recompute_kind = ActionKind.RECOMPUTE
    for rank in range(schedule.num_ranks):
        for step, a in enumerate(schedule.actions[rank]):
            try:
                stage, kind, mb = a.stage, a.kind, a.microbatch
            except AttributeError:
                raise _fail(schedule, f"{a!r} is not an Action", rank, step) from None
            if stage >= S:
                raise _fail(
                    schedule,
                    f"{a} names stage {stage} but the schedule has {S} stages (0..{S - 1})",
                    rank,
                    step,
                )
            if mb >= M:
                raise _fail(
                    schedule, f"{a} names microbatch {mb} but the schedule has {M} (0..{M - 1})", rank, step
                )
            if stage_to_rank[stage] != rank:
                raise _fail(
                    schedule,
                    f"{a} runs on rank {rank} but stage {stage} is held by rank {stage_to_rank[stage]}",
                    rank,
                    step,
                )
            if kind in comm_kinds and not lowered:
                raise _fail(
                    schedule,
                    f"{a} is a send/recv in a schedule with lowered=False; use merak_pipe.lower()",
                    rank,
                    step,
                )
            if kind is recompute_kind and (plan is None or plan[stage] == 0.0):
                raise _fail(
                    schedule,
                    f"{a} recomputes stage {stage}, whose recompute fraction is 0 (plan: "
                    f"{None if plan is None else plan.fractions}); drop the R action or give the stage a fraction > 0",
                    rank,
                    step,
                )
            index = kind_offset[kind] + stage * M + mb
            if counts[index]:
                first = _locate(schedule, a)
                raise _fail(
                    schedule, f"{a} appears twice (first at rank {first[0]}, step {first[1]})", rank, step
                )
            counts[index] = 1
    return counts, kind_offset


def _check_compute_counts(schedule: Schedule, counts: bytearray, kind_offset: dict[ActionKind, int]) -> None:
    """One F per (stage, microbatch), and one B or one I and one W."""
    M = schedule.num_microbatches
    SM = schedule.num_stages * M

    def block(kind: ActionKind) -> bytes:
        offset = kind_offset[kind]
        return bytes(counts[offset : offset + SM])

    ones, zeros = b"\x01" * SM, bytes(SM)
    F, B, BI, W = (
        ActionKind.FORWARD,
        ActionKind.FULL_BACKWARD,
        ActionKind.BACKWARD_INPUT,
        ActionKind.BACKWARD_WEIGHT,
    )
    f, b, i, w = block(F), block(B), block(BI), block(W)
    if f != ones:
        missing = f.index(0)
        s, m = divmod(missing, M)
        raise _fail(schedule, f"stage {s} microbatch {m} has no forward {Action(s, F, m)}")
    if not ((b == ones and i == zeros and w == zeros) or (b == zeros and i == ones and w == ones)):
        for index in range(SM):
            s, m = divmod(index, M)
            if b[index] and (i[index] or w[index]):
                r, st = _locate(schedule, Action(s, BI if i[index] else W, m))
                raise _fail(
                    schedule, f"stage {s} microbatch {m} has both a full backward B and a split I/W", r, st
                )
            if not b[index] and not (i[index] and w[index]):
                missing_action = (
                    Action(s, BI, m) if w[index] else Action(s, W, m) if i[index] else Action(s, B, m)
                )
                raise _fail(
                    schedule,
                    f"stage {s} microbatch {m} has no {missing_action} (needs one B, or one I and one W)",
                )


def _check_comms(schedule: Schedule, counts: bytearray, kind_offset: dict[ActionKind, int]) -> None:
    S, M = schedule.num_stages, schedule.num_microbatches
    expected: dict[ActionKind, set[int]] = {k: set() for k in ActionKind if k.is_comm}
    for s in range(S - 1):
        if schedule.stage_to_rank[s] != schedule.stage_to_rank[s + 1]:
            expected[ActionKind.SEND_F].add(s)
            expected[ActionKind.RECV_F].add(s + 1)
            expected[ActionKind.SEND_B].add(s + 1)
            expected[ActionKind.RECV_B].add(s)
    ones, zeros = b"\x01" * M, bytes(M)
    for kind, stages in expected.items():
        for s in range(S):
            offset = kind_offset[kind] + s * M
            row = bytes(counts[offset : offset + M])
            if s in stages and row != ones:
                m = row.index(0)
                raise _fail(
                    schedule,
                    f"lowered schedule lacks {Action(s, kind, m)} (stages on different ranks need a send and a recv)",
                )
            if s not in stages and row != zeros:
                m = next(j for j, c in enumerate(row) if c)
                rank, step = _locate(schedule, Action(s, kind, m))
                raise _fail(
                    schedule,
                    f"{Action(s, kind, m)} has no cross-rank edge to serve (its peer stage is on the same rank or absent)",
                    rank,
                    step,
                )


def _check_channel_order(schedule: Schedule) -> None:
    """Receives on each channel are posted in the order the sends are issued ([Note: channel order])."""
    rank_of = schedule.stage_to_rank
    sends: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    sent_by: dict[tuple[str, int, int], Action] = {}
    for rank in range(schedule.num_ranks):
        for a in schedule.actions[rank]:
            if a.kind is ActionKind.SEND_F:
                msg = ("F", a.stage, a.microbatch)
                sends.setdefault((rank, rank_of[a.stage + 1]), []).append(msg)
                sent_by[msg] = a
            elif a.kind is ActionKind.SEND_B:
                msg = ("B", a.stage, a.microbatch)
                sends.setdefault((rank, rank_of[a.stage - 1]), []).append(msg)
                sent_by[msg] = a
    for rank in range(schedule.num_ranks):
        index: dict[tuple[int, int], int] = {}
        for step, a in enumerate(schedule.actions[rank]):
            if a.kind is ActionKind.RECV_F:
                msg, src = ("F", a.stage - 1, a.microbatch), rank_of[a.stage - 1]
            elif a.kind is ActionKind.RECV_B:
                msg, src = ("B", a.stage + 1, a.microbatch), rank_of[a.stage + 1]
            else:
                continue
            key = (src, rank)
            i = index.get(key, 0)
            expected = sends.get(key, [])[i] if i < len(sends.get(key, [])) else None
            if msg != expected:
                raise _fail(
                    schedule,
                    f"{a} is receive #{i} on channel rank {src} -> rank {rank}, but send #{i} on that channel is "
                    f"{sent_by[expected] if expected else 'missing'}; receives must follow the senders' order on "
                    "backends that match in issue order (NCCL); merak_pipe.lower() orders them so",
                    rank,
                    step,
                )
            index[key] = i + 1


def validate(schedule: Schedule, *, channel_order: bool = False, nccl: bool = False) -> Schedule:
    """Check ``schedule`` (compute-only or lowered); return it unchanged or raise ScheduleError.

    With ``channel_order=True`` a lowered schedule must also post its receives on each channel
    (ordered pair of ranks) in the order the peer sends them, as NCCL requires. With
    ``nccl=True`` the runtime's p2p issue order of the schedule (lowered here if it is
    compute-only) is also replayed under NCCL's rules (:func:`merak_pipe.nccl_check.check_nccl`:
    one in-order stream per rank, messages of a pair matched in issue order, a send and its
    receive completing together), for a training step and an evaluation round.

    A decode schedule (``schedule.num_steps`` set, :func:`merak_pipe.decode_schedule`) is checked by its
    own rules (``_decode_rules.py``): channel order always, the NCCL replay with ``nccl=True``.
    """
    if schedule.is_decode:
        from merak_pipe._decode_rules import validate_decode

        return validate_decode(schedule, nccl=nccl)
    with paused_gc():
        _check_structure(schedule)
        if channel_order and schedule.lowered:
            _check_channel_order(schedule)
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
            lines.append(
                f"  rank {b.rank} step {b.step} ({schedule.actions[b.rank][b.step]}) waits for {needed}, {later}"
            )
        raise _fail(
            schedule,
            f"schedule {schedule.name!r} deadlocks or breaks a dependency:\n" + "\n".join(lines),
            first.rank,
            first.step,
        )
    if nccl:
        from merak_pipe.lowering import lower
        from merak_pipe.nccl_check import check_nccl

        check_nccl(schedule if schedule.lowered else lower(schedule))
    return schedule
