"""Dependency rules of the IR and the in-order executor shared by the validator and the simulator.

Each rank runs its list in order; an action starts once every action it depends on has finished
(on any rank). Sends and receives are posted without blocking; a compute action waits for the
data of its receive ([Note: p2p semantics]). Executing a schedule under these rules either
finishes every action, giving a topological order, or stops with some ranks blocked: a deadlock.

[Note: p2p semantics]
As in torch.distributed.pipelining's runtime, SEND_* and RECV_* post an ``isend`` / ``irecv``
and return; the compute action that consumes a received value waits until the matching send has
been posted (and, in the simulator, until the message has arrived). A receive must be posted on
its rank before the action that consumes it. A lowered schedule is therefore deadlock-free when
its compute dependencies are acyclic along each rank's order. A runtime whose sends block until
the peer's receive is posted (plain ``dist.send``) can deadlock on schedules that validate here.

Dependencies of a compute action ``(s, kind, m)`` (``grad`` = B or I, whichever the schedule uses):
  F(s, m)      <- F(s-1, m)           (lowered, cross-rank: RECV_F(s, m) posted and SEND_F(s-1, m) posted)
  R(s, m)      <- F(s, m)
  B/I(s, m)    <- F(s, m), grad(s+1, m), R(s, m) if the schedule has it
                             (lowered, cross-rank: RECV_B(s, m) posted and SEND_B(s+1, m) posted)
  W(s, m)      <- I(s, m)
  SEND_F(s, m) <- F(s, m);    SEND_B(s, m) <- grad(s, m);    RECV_F / RECV_B <- nothing
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from merak_pipe.ir import Action, ActionKind, Schedule

# Event codes: what finishing an action makes available.
_F, _GRAD, _W, _R, _SENT_F, _RECVD_F, _SENT_B, _RECVD_B = range(8)

_PRODUCES = {
    ActionKind.FORWARD: _F,
    ActionKind.FULL_BACKWARD: _GRAD,
    ActionKind.BACKWARD_INPUT: _GRAD,
    ActionKind.BACKWARD_WEIGHT: _W,
    ActionKind.RECOMPUTE: _R,
    ActionKind.SEND_F: _SENT_F,
    ActionKind.RECV_F: _RECVD_F,
    ActionKind.SEND_B: _SENT_B,
    ActionKind.RECV_B: _RECVD_B,
}


@dataclass
class Blocked:
    """A rank that cannot progress: its step and the event key it waits for."""

    rank: int
    step: int
    waits_for: int


class Keys:
    """Integer keys for events ``(code, stage, microbatch)`` of one schedule."""

    def __init__(self, schedule: Schedule) -> None:
        self.S = schedule.num_stages
        self.M = schedule.num_microbatches

    def key(self, code: int, stage: int, microbatch: int) -> int:
        return (code * self.S + stage) * self.M + microbatch

    def decode(self, key: int) -> tuple[int, int, int]:
        rest, m = divmod(key, self.M)
        code, s = divmod(rest, self.S)
        return code, s, m


def describe_event(keys: Keys, key: int, schedule: Schedule) -> Action:
    """The action whose completion produces event ``key`` (B for a grad event of a B-schedule)."""
    code, s, m = keys.decode(key)
    if code == _GRAD:
        uses_i = any(a.kind is ActionKind.BACKWARD_INPUT and a.stage == s for a in schedule.actions[schedule.rank_of(s)])
        kind = ActionKind.BACKWARD_INPUT if uses_i else ActionKind.FULL_BACKWARD
    else:
        kind = next(k for k, c in _PRODUCES.items() if c == code and k is not ActionKind.BACKWARD_INPUT)
    return Action(s, kind, m)


def dependency_table(schedule: Schedule) -> tuple[Keys, list[list[tuple[int, ...]]], list[list[int]]]:
    """Per rank and step: the event keys the action waits for, and the key it produces."""
    keys = Keys(schedule)
    S, M = keys.S, keys.M
    key = keys.key
    rank_of = schedule.stage_to_rank
    lowered = schedule.lowered
    has_r = set()
    for acts in schedule.actions.values():
        for a in acts:
            if a.kind is ActionKind.RECOMPUTE:
                has_r.add((a.stage, a.microbatch))
    deps: list[list[tuple[int, ...]]] = []
    produces: list[list[int]] = []
    for rank in range(schedule.num_ranks):
        rank_deps: list[tuple[int, ...]] = []
        rank_prod: list[int] = []
        for a in schedule.actions[rank]:
            s, kind, m = a.stage, a.kind, a.microbatch
            d: tuple[int, ...]
            if kind is ActionKind.FORWARD:
                if s == 0:
                    d = ()
                elif lowered and rank_of[s - 1] != rank_of[s]:
                    d = (key(_RECVD_F, s, m), key(_SENT_F, s - 1, m))
                else:
                    d = (key(_F, s - 1, m),)
            elif kind is ActionKind.FULL_BACKWARD or kind is ActionKind.BACKWARD_INPUT:
                dl = [key(_F, s, m)]
                if (s, m) in has_r:
                    dl.append(key(_R, s, m))
                if s < S - 1:
                    if lowered and rank_of[s + 1] != rank_of[s]:
                        dl.append(key(_RECVD_B, s, m))
                        dl.append(key(_SENT_B, s + 1, m))
                    else:
                        dl.append(key(_GRAD, s + 1, m))
                d = tuple(dl)
            elif kind is ActionKind.BACKWARD_WEIGHT:
                d = (key(_GRAD, s, m),)
            elif kind is ActionKind.RECOMPUTE:
                d = (key(_F, s, m),)
            elif kind is ActionKind.SEND_F:
                d = (key(_F, s, m),)
            elif kind is ActionKind.SEND_B:
                d = (key(_GRAD, s, m),)
            else:  # RECV_F, RECV_B: posted without waiting
                d = ()
            rank_deps.append(d)
            rank_prod.append(key(_PRODUCES[kind], s, m))
        deps.append(rank_deps)
        produces.append(rank_prod)
    del M
    return keys, deps, produces


def execute(
    schedule: Schedule,
) -> tuple[list[tuple[int, int]], list[Blocked], Keys, list[list[tuple[int, ...]]], list[list[int]]]:
    """Run the schedule in order under the dependency rules.

    Returns ``(order, blocked, keys, deps, produces)``: ``order`` lists ``(rank, step)`` in an
    order that respects every dependency; ``blocked`` is empty unless the schedule deadlocks.
    """
    keys, deps, produces = dependency_table(schedule)
    num_ranks = schedule.num_ranks
    lengths = [len(schedule.actions[r]) for r in range(num_ranks)]
    pos = [0] * num_ranks
    done: set[int] = set()
    waiting: dict[int, list[int]] = {}
    ready = deque(range(num_ranks))
    order: list[tuple[int, int]] = []
    append = order.append
    while ready:
        rank = ready.popleft()
        rank_deps = deps[rank]
        rank_prod = produces[rank]
        step = pos[rank]
        n = lengths[rank]
        while step < n:
            missing = -1
            for k in rank_deps[step]:
                if k not in done:
                    missing = k
                    break
            if missing >= 0:
                waiting.setdefault(missing, []).append(rank)
                break
            produced = rank_prod[step]
            done.add(produced)
            append((rank, step))
            step += 1
            woken = waiting.pop(produced, None)
            if woken:
                ready.extend(woken)
        pos[rank] = step
    blocked: list[Blocked] = []
    for rank in range(num_ranks):
        if pos[rank] < lengths[rank]:
            missing = next(k for k in deps[rank][pos[rank]] if k not in done)
            blocked.append(Blocked(rank, pos[rank], missing))
    return order, blocked, keys, deps, produces
