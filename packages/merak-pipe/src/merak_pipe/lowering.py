"""Lowering: add the send/recv actions a compute-only schedule needs between ranks.

Each cross-rank edge gets a send right after the producing action and a receive right before
the consuming one, in torch.distributed.pipelining's labelling (``SEND_F`` by the producing
stage, ``RECV_F`` by the consuming stage; ``SEND_B`` by the stage whose input gradient it is,
``RECV_B`` by the stage before it). Edges between stages on the same rank need nothing. The
result is deadlock-free whenever the compute-only schedule is
([Note: p2p semantics] in ``_engine.py``). It does not reorder compute actions.
"""

from __future__ import annotations

import dataclasses

from merak_pipe.ir import Action, ActionKind, Schedule

__all__ = ["lower", "strip_comms"]


def lower(schedule: Schedule) -> Schedule:
    """Return a copy of ``schedule`` with SEND/RECV actions and ``lowered=True``."""
    if schedule.lowered:
        raise ValueError(f"schedule {schedule.name!r} is already lowered; lower() takes a compute-only schedule")
    rank_of = schedule.stage_to_rank
    last = schedule.num_stages - 1
    actions: dict[int, list[Action]] = {}
    for rank, acts in schedule.actions.items():
        out: list[Action] = []
        for a in acts:
            if a.kind.is_comm:
                raise ValueError(f"{a} on rank {rank}: a schedule with lowered=False must not hold send/recv actions")
            s, m = a.stage, a.microbatch
            if a.kind is ActionKind.FORWARD:
                if s > 0 and rank_of[s - 1] != rank:
                    out.append(Action(s, ActionKind.RECV_F, m))
                out.append(a)
                if s < last and rank_of[s + 1] != rank:
                    out.append(Action(s, ActionKind.SEND_F, m))
            elif a.kind.is_backward:
                if s < last and rank_of[s + 1] != rank:
                    out.append(Action(s, ActionKind.RECV_B, m))
                out.append(a)
                if s > 0 and rank_of[s - 1] != rank:
                    out.append(Action(s, ActionKind.SEND_B, m))
            else:
                out.append(a)
        actions[rank] = out
    return dataclasses.replace(schedule, actions=actions, lowered=True)


def strip_comms(schedule: Schedule) -> Schedule:
    """The compute-only schedule under a lowered one."""
    actions = {rank: [a for a in acts if a.kind.is_compute] for rank, acts in schedule.actions.items()}
    return dataclasses.replace(schedule, actions=actions, lowered=False)
