"""Lowering: add the send/recv actions a compute-only schedule needs between ranks.

Each cross-rank edge gets a send right after the producing action and a receive before the
consuming one, in torch.distributed.pipelining's labelling (``SEND_F`` by the producing stage,
``RECV_F`` by the consuming stage; ``SEND_B`` by the stage whose input gradient it is, ``RECV_B``
by the stage before it). Edges between stages on the same rank need nothing. Compute actions
are not reordered.

[Note: channel order]
Receives are posted in the order their messages are sent on each channel (ordered pair of ranks):
when a compute action needs a message, every earlier message of that channel that is not yet
posted is posted first. With tagged messages (gloo) order does not matter, but NCCL matches
sends and receives in issue order and ignores tags, so this keeps lowered schedules correct
there too. Receives are non-blocking posts ([Note: p2p semantics] in ``_dependencies.py``), so posting
one early cannot deadlock; for one stage per rank it never happens (messages are consumed in
the order they are sent). ``validate(schedule, channel_order=True)`` checks the property.
"""

from __future__ import annotations

import dataclasses

from merak_pipe._dependencies import paused_gc
from merak_pipe.ir import Action, ActionKind, Schedule

__all__ = ["lower", "strip_comms"]

# A message: (direction "F" or "B", producing stage, microbatch).
_Message = tuple[str, int, int]


def _recv_action(message: _Message) -> Action:
    direction, producer, m = message
    if direction == "F":
        return Action(producer + 1, ActionKind.RECV_F, m)
    return Action(producer - 1, ActionKind.RECV_B, m)


def _consumed(a: Action, rank: int, rank_of: tuple[int, ...], last: int) -> _Message | None:
    """The cross-rank message compute action ``a`` on ``rank`` needs, if any."""
    s = a.stage
    if a.kind is ActionKind.FORWARD and s > 0 and rank_of[s - 1] != rank:
        return ("F", s - 1, a.microbatch)
    if a.kind.is_backward and s < last and rank_of[s + 1] != rank:
        return ("B", s + 1, a.microbatch)
    return None


def lower(schedule: Schedule) -> Schedule:
    """Return a copy of ``schedule`` with SEND/RECV actions and ``lowered=True``."""
    with paused_gc():
        return _lower(schedule)


def _lower(schedule: Schedule) -> Schedule:
    if schedule.lowered:
        raise ValueError(
            f"schedule {schedule.name!r} is already lowered; lower() takes a compute-only schedule"
        )
    rank_of = schedule.stage_to_rank
    last = schedule.num_stages - 1
    # Pass 1: the order in which each channel (src rank, dst rank) carries its messages.
    channel: dict[tuple[int, int], list[_Message]] = {}
    for rank, acts in schedule.actions.items():
        for a in acts:
            if a.kind.is_comm:
                raise ValueError(
                    f"{a} on rank {rank}: a schedule with lowered=False must not hold send/recv actions"
                )
            s = a.stage
            if a.kind is ActionKind.FORWARD and s < last and rank_of[s + 1] != rank:
                channel.setdefault((rank, rank_of[s + 1]), []).append(("F", s, a.microbatch))
            elif a.kind.is_backward and s > 0 and rank_of[s - 1] != rank:
                channel.setdefault((rank, rank_of[s - 1]), []).append(("B", s, a.microbatch))
    position = {(key, msg): i for key, msgs in channel.items() for i, msg in enumerate(msgs)}
    # Pass 2: receives (in channel order, see [Note: channel order]), compute, sends.
    actions: dict[int, list[Action]] = {}
    for rank, acts in schedule.actions.items():
        posted: dict[tuple[int, int], int] = {}
        out: list[Action] = []
        for a in acts:
            s, m = a.stage, a.microbatch
            message = _consumed(a, rank, rank_of, last)
            if message is not None:
                key = (rank_of[message[1]], rank)
                pos = position.get((key, message))
                if pos is None:
                    raise ValueError(
                        f"{a} on rank {rank} needs {message[0]} of stage {message[1]} microbatch {m}, which no rank "
                        "produces; validate() the compute-only schedule first"
                    )
                start = posted.get(key, 0)
                if pos >= start:
                    out.extend(_recv_action(msg) for msg in channel[key][start : pos + 1])
                    posted[key] = pos + 1
            out.append(a)
            if a.kind is ActionKind.FORWARD and s < last and rank_of[s + 1] != rank:
                out.append(Action(s, ActionKind.SEND_F, m))
            elif a.kind.is_backward and s > 0 and rank_of[s - 1] != rank:
                out.append(Action(s, ActionKind.SEND_B, m))
        actions[rank] = out
    return dataclasses.replace(schedule, actions=actions, lowered=True)


def strip_comms(schedule: Schedule) -> Schedule:
    """The compute-only schedule under a lowered one."""
    actions = {rank: [a for a in acts if a.kind.is_compute] for rank, acts in schedule.actions.items()}
    return dataclasses.replace(schedule, actions=actions, lowered=False)
