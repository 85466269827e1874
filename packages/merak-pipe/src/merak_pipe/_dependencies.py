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

import gc
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
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


@contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector while building or walking large schedules.

    These steps allocate 10^5-10^6 small acyclic objects (actions, tuples); generation-0
    collections triggered by them cost more than the work itself. Restores the previous state.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


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
        uses_i = any(
            a.kind is ActionKind.BACKWARD_INPUT and a.stage == s
            for a in schedule.actions[schedule.rank_of(s)]
        )
        kind = ActionKind.BACKWARD_INPUT if uses_i else ActionKind.FULL_BACKWARD
    else:
        kind = next(k for k, c in _PRODUCES.items() if c == code and k is not ActionKind.BACKWARD_INPUT)
    return Action(s, kind, m)


def dependency_table(schedule: Schedule) -> tuple[Keys, list[list[tuple[int, ...]]], list[list[int]]]:
    """Per rank and step: the event keys the action waits for, and the key it produces.

    A key is ``code * S * M + stage * M + microbatch`` (see :class:`Keys`); written out inline
    because this loop runs once per action of schedules with 10^5 actions.
    """
    keys = Keys(schedule)
    S, M = keys.S, keys.M
    SM = S * M
    rank_of = schedule.stage_to_rank
    lowered = schedule.lowered
    FWD, FULL, BIN, BW, REC = (
        ActionKind.FORWARD,
        ActionKind.FULL_BACKWARD,
        ActionKind.BACKWARD_INPUT,
        ActionKind.BACKWARD_WEIGHT,
        ActionKind.RECOMPUTE,
    )
    SENDF, SENDB = ActionKind.SEND_F, ActionKind.SEND_B
    has_r = bytearray(SM)
    for acts in schedule.actions.values():
        for a in acts:
            if a.kind is REC:
                has_r[a.stage * M + a.microbatch] = 1
    produce_offset = {kind: code * SM for kind, code in _PRODUCES.items()}
    k_grad, k_r, k_sent_f, k_recvd_f, k_sent_b, k_recvd_b = (
        c * SM for c in (_GRAD, _R, _SENT_F, _RECVD_F, _SENT_B, _RECVD_B)
    )
    deps: list[list[tuple[int, ...]]] = []
    produces: list[list[int]] = []
    for rank in range(schedule.num_ranks):
        rank_deps: list[tuple[int, ...]] = []
        rank_prod: list[int] = []
        dep_append = rank_deps.append
        prod_append = rank_prod.append
        for a in schedule.actions[rank]:
            s, kind, m = a.stage, a.kind, a.microbatch
            base = s * M + m
            d: tuple[int, ...]
            if kind is FWD:
                if s == 0:
                    d = ()
                elif lowered and rank_of[s - 1] != rank_of[s]:
                    d = (k_recvd_f + base, k_sent_f + base - M)
                else:
                    d = (base - M,)
            elif kind is FULL or kind is BIN:
                if s < S - 1:
                    if lowered and rank_of[s + 1] != rank_of[s]:
                        d = (base, k_recvd_b + base, k_sent_b + base + M)
                    else:
                        d = (base, k_grad + base + M)
                else:
                    d = (base,)
                if has_r[base]:
                    d = (*d, k_r + base)
            elif kind is BW or kind is SENDB:
                d = (k_grad + base,)
            elif kind is REC or kind is SENDF:
                d = (base,)
            else:  # RECV_F, RECV_B: posted without waiting
                d = ()
            dep_append(d)
            prod_append(produce_offset[kind] + base)
        deps.append(rank_deps)
        produces.append(rank_prod)
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
    done = bytearray(8 * keys.S * keys.M)
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
                if not done[k]:
                    missing = k
                    break
            if missing >= 0:
                waiting.setdefault(missing, []).append(rank)
                break
            produced = rank_prod[step]
            done[produced] = 1
            append((rank, step))
            step += 1
            woken = waiting.pop(produced, None)
            if woken:
                ready.extend(woken)
        pos[rank] = step
    blocked: list[Blocked] = []
    for rank in range(num_ranks):
        if pos[rank] < lengths[rank]:
            missing = next(k for k in deps[rank][pos[rank]] if not done[k])
            blocked.append(Blocked(rank, pos[rank], missing))
    return order, blocked, keys, deps, produces
