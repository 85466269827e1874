"""Validation and simulation of multi-step decode schedules ([Note: decode schedules] in
``merak_pipe.schedules.decode``); ``merak_pipe.validate`` and ``merak_pipe.simulate`` call them for a
schedule whose ``num_steps`` is set.

Dependencies of a decode schedule (one stage per rank, always lowered):
  F(s, m, t)      <- RECV_F(s, m, t) posted and SEND_F(s - 1, m, t) posted        (s > 0)
  F(0, m, t)      <- RECV_T(0, m, t - 1) posted and SEND_T(S - 1, m, t - 1) posted (t > 0, S > 1)
  F(0, m, t)      <- F(0, m, t - 1)                                                 (S == 1)
  SEND_F / SEND_T <- the F of the same stage, microbatch and step; RECV_* <- nothing.

Checked, each raising :class:`~merak_pipe.ir.ScheduleError` with the table and the bad step marked:
the actions are exactly those of the decode pattern for the schedule's ``last_steps`` (each once,
on the rank of its stage); each channel's receives follow its sends' order; executed in order
(posts without blocking, a compute action waiting for its data) nothing deadlocks; with
``nccl=True`` the units (runs of consecutive sends and receives) replay under NCCL's rules
(``merak_pipe.nccl_check.replay``). The simulator prices F per stage (``CostModel.forward``), a hidden-
state message like a training forward message, a token message as ``p2p_latency``; it models no memory.
"""

from __future__ import annotations

from collections import Counter, deque

from merak_pipe._schedule_errors import _fail
from merak_pipe._sim_model import CostModel, SimResult, TimedAction, _per_stage
from merak_pipe.ir import Action, ActionKind, Schedule
from merak_pipe.nccl_check import replay, stuck_at
from merak_pipe.p2p_order import P2POp

_F, _SEND_F, _RECV_F = ActionKind.FORWARD, ActionKind.SEND_F, ActionKind.RECV_F
_SEND_T, _RECV_T = ActionKind.SEND_T, ActionKind.RECV_T
_DECODE_KINDS = (_F, _SEND_F, _RECV_F, _SEND_T, _RECV_T)

# An event: (what finished, stage, microbatch, step); "F" = a forward, else the kind of a post.
_Event = tuple[str, int, int, int]


def decode_action_runs(action: Action, last_step: int) -> bool:
    """Whether ``action`` runs when its microbatch's last step is ``last_step``: every action up to that
    step, the end marker's ``F`` / ``SEND_F`` / ``RECV_F`` one step later, nothing after ([Note: decode
    schedules] in ``merak_pipe.schedules.decode``)."""
    if action.step <= last_step:
        return True
    return action.step == last_step + 1 and action.kind in (_F, _SEND_F, _RECV_F)


def _expected(schedule: Schedule, stage: int) -> Counter[Action]:
    """The actions stage ``stage`` must run, from the dependency pattern and ``last_steps``."""
    S, M, T = schedule.num_stages, schedule.num_microbatches, schedule.num_steps or 1
    given = schedule.options.get("last_steps")
    ends: tuple[int, ...] = tuple(given) if isinstance(given, (tuple, list)) else (T - 1,) * M
    want: Counter[Action] = Counter()
    for t in range(T):
        for m in range(M):
            kinds = [_F]
            kinds += [_RECV_F] if stage > 0 else []
            kinds += [_SEND_F] if stage < S - 1 else []
            kinds += [_SEND_T] if stage == S - 1 and S > 1 and t < T - 1 else []
            kinds += [_RECV_T] if stage == 0 and S > 1 and t < T - 1 else []
            for kind in kinds:
                a = Action(stage, kind, m, t)
                if m < len(ends) and decode_action_runs(a, ends[m]):
                    want[a] += 1
    return want


def _check_structure(schedule: Schedule) -> None:
    if schedule.stage_to_rank != tuple(range(schedule.num_stages)) or not schedule.lowered:
        raise _fail(
            schedule,
            f"decode schedule {schedule.name!r} must hold one stage per rank (stage_to_rank="
            f"{list(schedule.stage_to_rank)}) and be lowered (lowered={schedule.lowered}): build it with "
            "merak_pipe.decode_schedule",
        )
    for rank in range(schedule.num_ranks):
        want = _expected(schedule, rank)
        seen: Counter[Action] = Counter()
        for step, a in enumerate(schedule.actions[rank]):
            if a.kind not in _DECODE_KINDS:
                raise _fail(
                    schedule, f"{a}: a decode schedule holds only F, SEND/RECV_F and SEND/RECV_T", rank, step
                )
            seen[a] += 1
            if seen[a] > want[a]:
                what = (
                    "appears twice" if want[a] else "is not part of this decode schedule (stage, step or end)"
                )
                raise _fail(schedule, f"{a} {what}", rank, step)
        missing = sorted((want - seen).elements(), key=lambda a: (a.step, a.microbatch, a.kind.value))
        if missing:
            raise _fail(schedule, f"rank {rank} lacks {missing[0]} (and {len(missing) - 1} more)")


def _dependencies(schedule: Schedule, a: Action) -> tuple[_Event, ...]:
    S, s, m, t = schedule.num_stages, a.stage, a.microbatch, a.step
    if a.kind is not _F:
        return (("F", s, m, t),) if a.kind in (_SEND_F, _SEND_T) else ()
    if s > 0:
        return ((_RECV_F.value, s, m, t), (_SEND_F.value, s - 1, m, t))
    if t == 0:
        return ()
    if S == 1:
        return (("F", 0, m, t - 1),)
    return ((_RECV_T.value, 0, m, t - 1), (_SEND_T.value, S - 1, m, t - 1))


def _produces(a: Action) -> _Event:
    return ("F" if a.kind is _F else a.kind.value, a.stage, a.microbatch, a.step)


def execute_decode(schedule: Schedule) -> tuple[list[tuple[int, int]], dict[int, tuple[int, _Event]]]:
    """Run every rank's list in order under the rules above: the order of ``(rank, step)`` and, per
    blocked rank, ``(step, event it waits for)`` (empty unless the schedule deadlocks)."""
    lists = schedule.actions
    pos = dict.fromkeys(lists, 0)
    done: set[_Event] = set()
    waiting: dict[_Event, list[int]] = {}
    ready = deque(sorted(lists))
    order: list[tuple[int, int]] = []
    while ready:
        rank = ready.popleft()
        acts, step = lists[rank], pos[rank]
        while step < len(acts):
            missing = next((e for e in _dependencies(schedule, acts[step]) if e not in done), None)
            if missing is not None:
                waiting.setdefault(missing, []).append(rank)
                break
            event = _produces(acts[step])
            done.add(event)
            order.append((rank, step))
            step += 1
            ready.extend(waiting.pop(event, []))
        pos[rank] = step
    blocked = {}
    for rank, acts in lists.items():
        if pos[rank] < len(acts):
            needed = next(e for e in _dependencies(schedule, acts[pos[rank]]) if e not in done)
            blocked[rank] = (pos[rank], needed)
    return order, blocked


def _message(schedule: Schedule, a: Action) -> tuple[tuple[int, int], tuple[str, int, int, int]] | None:
    """(channel, message) of a send or receive: the channel is (sending rank, receiving rank)."""
    last = schedule.num_stages - 1
    s, m, t = a.stage, a.microbatch, a.step
    if a.kind is _SEND_F:
        return (s, s + 1), ("F", s, m, t)
    if a.kind is _RECV_F:
        return (s - 1, s), ("F", s - 1, m, t)
    if a.kind is _SEND_T:
        return (last, 0), ("T", last, m, t)
    if a.kind is _RECV_T:
        return (last, 0), ("T", last, m, t)
    return None


def _check_channel_order(schedule: Schedule) -> None:
    sent: dict[tuple[int, int], list[tuple[str, int, int, int]]] = {}
    for rank in range(schedule.num_ranks):
        for a in schedule.actions[rank]:
            found = _message(schedule, a)
            if found is not None and a.kind in (_SEND_F, _SEND_T):
                sent.setdefault(found[0], []).append(found[1])
    index: Counter[tuple[int, int]] = Counter()
    for rank in range(schedule.num_ranks):
        for step, a in enumerate(schedule.actions[rank]):
            found = _message(schedule, a)
            if found is None or a.kind in (_SEND_F, _SEND_T):
                continue
            channel, message = found
            i = index[channel]
            expected = sent.get(channel, [])[i] if i < len(sent.get(channel, [])) else None
            if message != expected:
                raise _fail(
                    schedule,
                    f"{a} is receive #{i} on channel rank {channel[0]} -> rank {channel[1]}, but send #{i} there "
                    f"carries {expected}: receives must follow the senders' order (NCCL matches in issue order)",
                    rank,
                    step,
                )
            index[channel] = i + 1


def decode_units(schedule: Schedule) -> dict[int, list[tuple[P2POp, ...]]]:
    """Every rank's p2p units: each run of consecutive sends and receives is one ``batch_isend_irecv``."""
    M = schedule.num_microbatches
    units: dict[int, list[tuple[P2POp, ...]]] = {}
    for rank in range(schedule.num_ranks):
        rank_units: list[tuple[P2POp, ...]] = []
        unit: list[P2POp] = []
        for a in schedule.actions[rank]:
            found = _message(schedule, a)
            if found is None:
                if unit:
                    rank_units.append(tuple(unit))
                unit = []
                continue
            (src, dst), (kind, stage, m, t) = found
            send = a.kind in (_SEND_F, _SEND_T)
            unit.append(P2POp(send, dst if send else src, kind, stage, t * M + m, a))
        if unit:
            rank_units.append(tuple(unit))
        units[rank] = rank_units
    return units


def _check_nccl(schedule: Schedule) -> None:
    units = decode_units(schedule)
    result = replay(units)
    if result.ok:
        return
    rank, step = stuck_at(schedule, units, result)
    raise _fail(
        schedule,
        f"decode schedule {schedule.name!r} breaks NCCL's point-to-point rules (one in-order stream per rank; "
        "messages of a pair matched in issue order; a send and its receive complete together):\n"
        + result.summary(),
        rank,
        step,
    )


def validate_decode(schedule: Schedule, *, nccl: bool = False) -> Schedule:
    """Check a decode schedule (see the module docstring); return it unchanged or raise ScheduleError."""
    _check_structure(schedule)
    _check_channel_order(schedule)
    _order, blocked = execute_decode(schedule)
    if blocked:
        lines = [
            f"  rank {rank} step {step} ({schedule.actions[rank][step]}) waits for {event[0]} of stage {event[1]}, "
            f"microbatch {event[2]}, step {event[3]}, which is never done before it"
            for rank, (step, event) in sorted(blocked.items())
        ]
        rank = min(blocked)
        raise _fail(
            schedule,
            f"decode schedule {schedule.name!r} deadlocks:\n" + "\n".join(lines),
            rank,
            blocked[rank][0],
        )
    if nccl:
        _check_nccl(schedule)
    return schedule


def simulate_decode(schedule: Schedule, costs: CostModel | None = None) -> SimResult:
    """Times of a decode schedule: each action starts when its rank is free and its inputs have arrived."""
    costs = costs or CostModel()
    validate_decode(schedule)
    S = schedule.num_stages
    forward = _per_stage("forward", costs.forward, S)
    boundary = _per_stage("boundary_bytes", costs.boundary_bytes, S)
    hidden = [costs.p2p_latency + boundary[s] / costs.p2p_bandwidth for s in range(S)]
    order, _blocked = execute_decode(schedule)
    finish: dict[_Event, tuple[float, int, int]] = {}
    free = [0.0] * schedule.num_ranks
    starts = [[0.0] * len(schedule.actions[r]) for r in range(schedule.num_ranks)]
    ends = [[0.0] * len(schedule.actions[r]) for r in range(schedule.num_ranks)]
    binding: dict[tuple[int, int], tuple[int, int]] = {}
    busy = [0.0] * schedule.num_ranks
    for rank, step in order:
        a = schedule.actions[rank][step]
        start, bind = free[rank], (rank, step - 1)
        for event in _dependencies(schedule, a):
            at, src_rank, src_step = finish[event]
            if src_rank != rank:
                at += hidden[event[1]] if event[0] == _SEND_F.value else costs.p2p_latency
            if at > start:
                start, bind = at, (src_rank, src_step)
        duration = (forward[a.stage] if a.kind is _F else 0.0) + costs.per_action
        free[rank] = ends[rank][step] = start + duration
        starts[rank][step] = start
        busy[rank] += duration
        binding[(rank, step)] = bind
        finish[_produces(a)] = (start + duration, rank, step)
    makespan = max(free, default=0.0)
    path: list[TimedAction] = []
    cur = (max(range(schedule.num_ranks), key=lambda r: free[r]), 0)
    cur = (cur[0], len(schedule.actions[cur[0]]) - 1)
    while cur[1] >= 0:
        r, st = cur
        path.append(TimedAction(r, schedule.actions[r][st], starts[r][st], ends[r][st]))
        cur = binding[cur]
    path.reverse()
    return SimResult(
        schedule=schedule,
        makespan=makespan,
        busy=busy,
        bubble_fraction=[1.0 - b / makespan if makespan > 0 else 0.0 for b in busy],
        critical_path=path,
        memory={s: [(0.0, 0.0)] for s in range(S)},
        peak_memory=[0.0] * S,
        peak_memory_per_rank=[0.0] * schedule.num_ranks,
        costs=costs,
        _order=order,
        _starts=starts,
        _ends=ends,
    )
