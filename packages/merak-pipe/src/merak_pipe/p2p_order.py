"""The point-to-point issue order of one rank: what the runtime issues, in which units, in which order.

:func:`issue_orders` turns every rank's lowered action list into *steps*: a compute action,
or a *unit* of p2p operations issued together (one ``batch_isend_irecv``). The runtime
(``merak_pipe.runner``) walks exactly these steps, and the NCCL replay checker
(``merak_pipe.nccl_check``) replays exactly these units, so what is checked is what runs.

[Note: issue order]
- A run of consecutive SEND/RECV actions of the lowered schedule is one unit, issued when the
  walk reaches it. Where messages match by tag (gloo without NCCL's rules) the runtime then posts
  data receives ``EARLY_RECEIVE_UNITS`` units early ([Note: early receives]); under NCCL's rules, which this order is
  checked against, nothing is posted ahead of its place: on NCCL a rank's p2p operations run in
  issue order on one stream, so a receive moved ahead of a send that its peer waits for
  deadlocks, whatever the message size.
- Every message of a pair of ranks is matched by issue order alone. Lowering posts the receives
  of each channel (ordered pair of ranks) in the order the peer sends them ([Note: channel
  order] in ``lowering.py``), so both sides issue a pair's messages in the same order.
- The first forward message of a stage in a round is preceded by its control messages
  ([Note: boundary values] in ``comm.py``): a header, then the pickled boundary spec (sent
  only when the header says the spec changed, and then received, by both sides alike). The
  sender puts both into the unit of that first ``SEND_F``, right before it. The receiver
  splits the unit of the matching ``RECV_F``: the operations before it plus the header form one
  unit, the spec one more, and the ``RECV_F`` starts the next; it waits for each before going
  on (it needs the header to size the spec, and the spec to size the data).
- Where this order needs NCCL's eager buffer (a send waits for a receive that its peer issues
  only after a message this rank issues later: the rendezvous deadlocks once a message exceeds
  the eager size), :func:`issue_orders` moves that send into its rank's next unit and repeats
  until the replay of :mod:`merak_pipe._p2p_replay` finishes: a send may go later, never
  earlier, and never changes its place in its channel's order. 1F1B, GPipe and ZB-H1 need no
  move; some sends of shifted-critical-path (warm-up) and of interleaved-1f1b do.
- ``forward_only=True`` gives the order of an evaluation round: only F, SEND_F and RECV_F
  actions, with units formed the same way from what is left.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from merak_pipe._p2p_replay import Replay
from merak_pipe.ir import Action, ActionKind, Schedule

__all__ = [
    "P2POp",
    "Step",
    "Unit",
    "early_receives",
    "issue_order",
    "issue_orders",
    "round_actions",
    "runner_orders",
    "settled_sends",
]

# How many units ahead of its place a data receive is posted where messages match by tag
# ([Note: early receives]); 0 posts every receive where lowering put it.
EARLY_RECEIVE_UNITS = 2

# Message kinds: forward data, backward data, shape header, pickled spec.
DATA_F, DATA_B, HEADER, SPEC = "F", "B", "H", "S"


@dataclass(frozen=True)
class P2POp:
    """One send or receive. ``stage`` is the *sending* stage; ``microbatch`` is -1 for control messages."""

    send: bool
    peer: int
    """The other pipeline rank."""
    kind: str
    """``"F"`` (activations), ``"B"`` (gradients), ``"H"`` (header) or ``"S"`` (spec)."""
    stage: int
    microbatch: int
    action: Action
    """The schedule action this operation serves (a control message: the SEND_F / RECV_F it precedes)."""

    @property
    def message(self) -> tuple[str, int, int]:
        """What travels: equal on the send and on the receive of one message."""
        return (self.kind, self.stage, self.microbatch)

    def __str__(self) -> str:
        if self.kind in (HEADER, SPEC):
            word = "header" if self.kind == HEADER else "spec"
            return f"{'send' if self.send else 'recv'} {word} of stage {self.stage} for {self.action}"
        return str(self.action)


Unit = tuple[P2POp, ...]
Step = Action | Unit


def describe_step(step: Step | None) -> str:
    """Where a rank is in its round, for a message: stage, action and microbatch of ``step``."""
    if step is None:
        return "no pipeline action yet this round"
    if isinstance(step, Action):
        return f"stage {step.stage}, action {step}, microbatch {step.microbatch}"
    action = step[0].action
    ops = "; ".join(str(op) for op in step)
    return f"stage {action.stage}, action {action}, microbatch {action.microbatch} (p2p unit: {ops})"


def round_actions(actions: Sequence[Action], *, forward_only: bool) -> list[Action]:
    """The actions a round runs: all of them, or (evaluation) only F, SEND_F and RECV_F."""
    if not forward_only:
        return list(actions)
    keep = (ActionKind.FORWARD, ActionKind.SEND_F, ActionKind.RECV_F)
    return [a for a in actions if a.kind in keep]


def _op(action: Action, rank_of: tuple[int, ...]) -> P2POp:
    s, m, kind = action.stage, action.microbatch, action.kind
    if kind is ActionKind.SEND_F:
        return P2POp(True, rank_of[s + 1], DATA_F, s, m, action)
    if kind is ActionKind.RECV_F:
        return P2POp(False, rank_of[s - 1], DATA_F, s - 1, m, action)
    if kind is ActionKind.SEND_B:
        return P2POp(True, rank_of[s - 1], DATA_B, s, m, action)
    if kind is ActionKind.RECV_B:
        return P2POp(False, rank_of[s + 1], DATA_B, s + 1, m, action)
    raise AssertionError(f"{action} is not a send/recv")  # pragma: no cover


def _flush(batch: list[P2POp], headed: set[int], steps: list[Step]) -> None:
    """Append the batch with the control messages it needs (see [Note: issue order])."""
    unit: list[P2POp] = []
    for op in batch:
        if op.kind == DATA_F and op.stage not in headed:
            headed.add(op.stage)
            header = P2POp(op.send, op.peer, HEADER, op.stage, -1, op.action)
            spec = P2POp(op.send, op.peer, SPEC, op.stage, -1, op.action)
            if op.send:
                unit += [header, spec]
            else:
                steps.append(tuple([*unit, header]))
                steps.append((spec,))
                unit = []
        unit.append(op)
    steps.append(tuple(unit))


def _base_order(schedule: Schedule, rank: int, forward_only: bool) -> list[Step]:
    rank_of = schedule.stage_to_rank
    steps: list[Step] = []
    batch: list[P2POp] = []
    headed: set[int] = set()
    for action in round_actions(schedule.actions[rank], forward_only=forward_only):
        if action.kind.is_comm:
            batch.append(_op(action, rank_of))
            continue
        if batch:
            _flush(batch, headed, steps)
            batch = []
        steps.append(action)
    if batch:
        _flush(batch, headed, steps)
    return steps


def _defer_sends(units: dict[int, list[list[P2POp]]]) -> dict[int, list[list[P2POp]]]:
    """Break the deadlocks of the plain order by moving sends into later units ([Note: issue order])."""
    replay: Replay[P2POp] = Replay(units)
    while True:
        replay.run()
        stuck = replay.stuck()
        if not stuck:
            break
        candidates = [i for rank in sorted(stuck) for i in replay.waiting_sends(rank)]
        if not any(replay.defer(i) for i in candidates):
            break  # nothing to move: the checker reports the deadlock
    return {rank: replay.unit_ops(rank) for rank in units}


def issue_orders(schedule: Schedule, *, forward_only: bool = False) -> dict[int, list[Step]]:
    """The steps every rank runs for one round of the lowered ``schedule`` ([Note: issue order])."""
    if not schedule.lowered:
        raise ValueError(f"schedule {schedule.name!r} is not lowered; pass merak_pipe.lower(schedule)")
    base = {rank: _base_order(schedule, rank, forward_only) for rank in range(schedule.num_ranks)}
    units = {rank: [list(step) for step in steps if isinstance(step, tuple)] for rank, steps in base.items()}
    fixed = _defer_sends(units)
    out: dict[int, list[Step]] = {}
    for rank, steps in base.items():
        queue = iter(fixed[rank])
        rank_steps: list[Step] = []
        for step in steps:
            if isinstance(step, tuple):
                unit = tuple(next(queue))
                if unit:
                    rank_steps.append(unit)
            else:
                rank_steps.append(step)
        out[rank] = rank_steps
    return out


def early_receives(steps: Sequence[Step], lookahead: int) -> list[Step]:
    """``steps`` with every data receive posted up to ``lookahead`` units earlier, for a transport
    that matches messages by tag ([Note: early receives]).

    [Note: early receives]
    gloo writes a message from the sending thread at once only when the receiver has already
    posted its receive; otherwise the send only announces itself, and the data goes out later from
    the sender's communication thread, once the receiver's "ready" notice has crossed back: a round
    trip plus a wake-up of a thread that competes with the sender's compute for a core, on the
    critical path of every message whose receive is posted right before it is consumed (as lowering
    and torch.distributed.pipelining both post them). Where messages are matched by tag, where they
    are posted does not matter for matching and a posted receive never blocks the host, so the
    runtime posts each data receive ``lookahead`` units before its place. Limits:

    - a receive needs its buffers' shapes: the first forward message a stage receives in a round
      stays in its place (its header and spec come first); later ones move no earlier than its
      unit. A gradient receive moves no earlier than the first forward of the stage whose outputs
      it matches (that forward records the output spec);
    - each receive moved adds at most ``lookahead`` posted buffers per stage and direction: the
      memory stays bounded by the schedule, not by the number of microbatches.

    Not under NCCL's rules: there one batch is one Work and ops run in issue order on one stream,
    so a receive posted early would make the message before it wait for it (and may deadlock).
    """
    if lookahead <= 0:
        return list(steps)
    units = {i: step for i, step in enumerate(steps) if isinstance(step, tuple)}
    unit_at = list(units)
    rank_of_unit = {i: k for k, i in enumerate(unit_at)}
    bounds = _receive_bounds(steps)
    moved: dict[int, list[P2POp]] = {i: list(unit) for i, unit in units.items()}
    for j, unit in units.items():
        for op in unit:
            bound = bounds(op, j)
            if bound is None:
                continue
            k = max(rank_of_unit[j] - lookahead, 0)
            while k < rank_of_unit[j] and unit_at[k] < bound:
                k += 1
            if unit_at[k] < j:
                moved[j].remove(op)
                moved[unit_at[k]].append(op)
    return [
        step if not isinstance(step, tuple) else tuple(moved[i])
        for i, step in enumerate(steps)
        if not isinstance(step, tuple) or moved[i]
    ]


def runner_orders(schedule: Schedule, forward_only: bool, lookahead: int) -> dict[int, list[Step]]:
    """Every rank's issue order as the runner runs it: :func:`issue_orders` with data receives posted
    ``lookahead`` units early ([Note: early receives]; 0 under NCCL's rules)."""
    orders = issue_orders(schedule, forward_only=forward_only)
    return {rank: early_receives(steps, lookahead) for rank, steps in orders.items()}


def _receive_bounds(steps: Sequence[Step]) -> Callable[[P2POp, int], int | None]:
    """For a data receive at step ``j``: the earliest step index it may be posted at (its buffers'
    shapes known, [Note: early receives]); None for what does not move."""
    first_recv_f: dict[int, int] = {}  # receiving stage -> step index of its first forward data receive
    first_forward: dict[int, int] = {}  # stage -> step index of its first F
    for i, step in enumerate(steps):
        if isinstance(step, tuple):
            for op in step:
                if not op.send and op.kind == DATA_F:
                    first_recv_f.setdefault(op.stage + 1, i)
        elif step.kind is ActionKind.FORWARD:
            first_forward.setdefault(step.stage, i)

    def bound(op: P2POp, j: int) -> int | None:
        if op.send or op.kind not in (DATA_F, DATA_B):
            return None
        if op.kind == DATA_F:
            first = first_recv_f[op.stage + 1]
            return None if first == j else first
        forward = first_forward.get(op.stage - 1)
        return None if forward is None else forward + 1

    return bound


def issue_order(schedule: Schedule, rank: int, *, forward_only: bool = False) -> list[Step]:
    """The steps ``rank`` runs for one round of the lowered ``schedule``."""
    return issue_orders(schedule, forward_only=forward_only)[rank]


Message = tuple[str, int, int]


def settled_sends(orders: dict[int, list[Step]], rank: int) -> dict[Message, tuple[Message, ...]]:
    """For each message ``rank`` receives: which of its own sends to that peer it proves matched.

    [Note: settled sends]
    A peer sends a message only after it has issued every unit before it, so once that message
    has arrived, every send of ``rank`` whose receive the peer posted in that unit or earlier is
    matched, and waiting on it cannot block. The runtime waits on those sends then and lets their
    tensors go ([Note: buffer lifetime] in ``_p2p_books.py``): on gloo a Work learns that it completed
    only when it is waited. A send is named once, by the first message that proves it (messages
    are keyed by :attr:`P2POp.message`).
    """
    out: dict[Message, tuple[Message, ...]] = {}
    for peer, steps in orders.items():
        if peer == rank:
            continue
        posted: list[Message] = []
        for step in steps:
            if not isinstance(step, tuple):
                continue
            posted += [op.message for op in step if not op.send and op.peer == rank]
            for op in step:
                if op.send and op.peer == rank:
                    out[op.message] = tuple(posted)
                    posted = []
    return out
