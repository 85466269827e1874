"""Replay each rank's p2p issue order under NCCL's rules, without a process group.

NCCL's model, as replayed here:

- each rank has one in-order stream per communicator: its p2p units (one ``batch_isend_irecv``
  or one single op) run one after another in issue order; a unit starts only once the one
  before it has finished;
- within a unit every operation runs at once; the unit finishes when all of them have;
- the k-th send from rank a to rank b is matched with the k-th receive on b from a (issue order
  alone, tags are ignored);
- a send and its matching receive complete only together, each while its unit is running (a
  rendezvous: no eager buffer is assumed, so a pass holds for any message size).

An order that finishes under these rules is also deadlock-free on gloo, whose sends never block
and whose receives block only where their data is consumed. :func:`check_nccl` replays what the
runtime issues (:func:`merak_pipe.p2p_order.issue_order`) for a training round and for an
evaluation round; :func:`replay` takes any per-rank unit lists, e.g. a hand-made order.

What it reports: operations without a partner (more sends than receives on a channel or the
reverse), pairings of a send with a receive of another message, and a deadlock, with every
blocked rank, the unit it is stuck in and the partner it waits for. It does not check compute
dependencies (``merak_pipe.validate`` does) and sizes only through message identity.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from merak_pipe._p2p_replay import Replay
from merak_pipe._schedule_errors import _fail
from merak_pipe.ir import Schedule
from merak_pipe.p2p_order import P2POp, Unit, issue_orders

__all__ = ["NcclReplay", "check_nccl", "replay", "round_units"]


@dataclass
class NcclReplay:
    """The outcome of a replay: empty lists mean the order runs under NCCL's rules."""

    unmatched: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    blocked: list[str] = field(default_factory=list)
    """One line per rank that never finishes: its unit and what it waits for."""
    stuck: dict[int, int] = field(default_factory=dict)
    """Blocked rank -> index of the unit it never finishes."""

    @property
    def ok(self) -> bool:
        """True when every unit of every rank finished and every pairing is right."""
        return not (self.unmatched or self.mismatched or self.blocked)

    def summary(self) -> str:
        """The problems, one per line."""
        return "\n".join(self.unmatched + self.mismatched + self.blocked)


def _describe_unit(unit: Sequence[P2POp]) -> str:
    return "[" + ", ".join(str(op) for op in unit) + "]"


def _report_pairing(engine: Replay[P2POp], result: NcclReplay) -> None:
    for i, op in enumerate(engine.ops):
        rank = engine.rank_of[i]
        other = engine.partner[i]
        if other < 0:
            src, dst = (rank, op.peer) if op.send else (op.peer, rank)
            verb = f"sends {op} to" if op.send else f"receives {op} from"
            result.unmatched.append(
                f"rank {rank} {verb} rank {op.peer} (unit {engine.unit_of[i]}), but rank {op.peer} posts no "
                f"matching {'receive' if op.send else 'send'} (channel rank {src} -> rank {dst})"
            )
        elif op.send and op.message != engine.ops[other].message:
            result.mismatched.append(
                f"channel rank {rank} -> rank {op.peer}, message #{engine.channel_index[i]}: rank {rank} sends "
                f"{op} (unit {engine.unit_of[i]}) but rank {op.peer} receives it as {engine.ops[other]} "
                f"(unit {engine.unit_of[other]})"
            )


def replay(units: Mapping[int, Sequence[Unit]]) -> NcclReplay:
    """Replay per-rank unit lists (issue order) under NCCL's model; see the module docstring."""
    result = NcclReplay()
    engine: Replay[P2POp] = Replay(
        {rank: [list(u) for u in rank_units] for rank, rank_units in units.items()}
    )
    _report_pairing(engine, result)
    engine.run()
    for rank, u in engine.stuck().items():
        result.stuck[rank] = u
        waits = []
        for i in engine.units[rank][u]:
            other = engine.partner[i]
            if engine.done[i] or other < 0:
                continue
            peer = engine.rank_of[other]
            peer_head = engine.head[peer]
            where = (
                f"rank {peer} is stuck at unit {peer_head} {_describe_unit(engine.unit_ops(peer)[peer_head])}"
                if peer_head < len(engine.units[peer])
                else f"rank {peer} finished"
            )
            waits.append(
                f"{engine.ops[i]} needs its partner in rank {peer}'s unit {engine.unit_of[other]}, but {where}"
            )
        result.blocked.append(
            f"rank {rank} is stuck at unit {u} {_describe_unit(engine.unit_ops(rank)[u])}: "
            + "; ".join(waits)
        )
    return result


def round_units(schedule: Schedule, *, forward_only: bool = False) -> dict[int, list[Unit]]:
    """Every rank's p2p units for one round, as the runtime issues them."""
    return {
        rank: [step for step in steps if isinstance(step, tuple)]
        for rank, steps in issue_orders(schedule, forward_only=forward_only).items()
    }


def stuck_at(
    schedule: Schedule, units: Mapping[int, Sequence[Unit]], result: NcclReplay
) -> tuple[int | None, int | None]:
    """(rank, index in its action list) of the first rank a failed :func:`replay` left stuck; (None, None)
    when no rank is stuck (the order broke a rule without deadlocking)."""
    if not result.stuck:
        return None, None
    rank = min(result.stuck)
    return rank, schedule.actions[rank].index(units[rank][result.stuck[rank]][0].action)


def check_nccl(schedule: Schedule) -> Schedule:
    """Raise :class:`ScheduleError` unless the runtime's issue order of the lowered ``schedule`` runs
    under NCCL's rules, for a training round and for an evaluation round; return it otherwise."""
    for forward_only, what in ((False, "training step"), (True, "evaluation (forward-only) round")):
        units = round_units(schedule, forward_only=forward_only)
        result = replay(units)
        if result.ok:
            continue
        rank, step = stuck_at(schedule, units, result)
        problem = "can deadlock under" if rank is not None else "breaks"
        raise _fail(
            schedule,
            f"schedule {schedule.name!r} {problem} NCCL's point-to-point rules in a {what} (one in-order "
            "stream per rank; messages of a pair matched in issue order; a send and its receive complete "
            "together):\n" + result.summary(),
            rank,
            step,
        )
    return schedule
