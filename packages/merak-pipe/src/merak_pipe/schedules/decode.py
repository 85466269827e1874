"""Forward-only decode schedules: many decode steps, each microbatch's next step started on the first
stage as soon as its tokens of the step before are back from the last stage.

[Note: decode schedules]
Generation under pipeline parallelism runs ``T`` decode steps (the prompt's prefill is step 0) over
``M`` microbatches of rows on ``S`` stages, one stage per rank. Item ``k = t * M + m`` is microbatch
``m`` at step ``t``; every stage runs its forwards in item order. The dependencies are

    F(s, m, t)     <- F(s - 1, m, t)   the hidden states (SEND_F by stage s - 1, RECV_F by stage s)
    F(0, m, t + 1) <- F(S - 1, m, t)   the step's tokens (SEND_T by the last stage, RECV_T by the first)

so microbatch ``m`` of step ``t + 1`` starts while the other microbatches of step ``t`` are still in
the pipeline: with ``M >= S`` every stage is busy in the steady state (a stage's utilisation is
``T * M / (T * M + S - 1)`` with equal costs and free messages), where a GPipe round per step followed
by a broadcast of the tokens gives ``M / (M + S - 1)``. With ``M < S`` the token loop bounds it
(``M / S``: a microbatch needs ``S`` forwards to come back).

Issue order (NCCL: no tags, one in-order stream per rank; [Note: issue order] in ``p2p_order.py``).
A run of consecutive sends and receives of a rank is one unit (one ``batch_isend_irecv``):

- stage ``s > 0`` posts ``RECV_F(k)`` right before ``F(k)``, so its unit is ``[SEND_F(k - 1),
  RECV_F(k)]`` (the last stage: ``[SEND_T(k - 1), RECV_F(k)]``);
- the last stage sends ``SEND_T(k)`` right after ``F(k)``, for every step but the last;
- the first stage posts ``RECV_T(k)`` with ``SEND_F(k + d - 1)``, ``d = min(S, M)``: in the steady
  state, the moment the last stage sends it (it finishes item ``k`` while the first finishes item
  ``k + S - 1``); ``d <= M`` keeps it before ``F(0, k + M)``, which needs it.

Each channel (ordered pair of ranks) carries one kind of message in item order on both sides, and
``merak_pipe.validate(schedule, nccl=True)`` replays the units under NCCL's rules.

Ended microbatches (``last_steps``). A microbatch whose rows have all ended at step ``e`` (its
``last step``) needs no more forwards; every stage must agree on it, in an order valid under NCCL's
rules. The last stage knows it when it picks the tokens of step ``e``; its ``SEND_T`` of step ``e``
tells the first stage (the message carries the flag); step ``e + 1`` then runs only as an *end
marker*: ``F``, ``SEND_F`` and ``RECV_F`` of step ``e + 1`` pass the flag from stage to stage (an
``F`` that computes nothing), and no action of the microbatch follows (:func:`decode_action_runs`).
Every rank learns the end from a message it receives before any action it drops, and what it drops
are whole pairs (a send and its receive), so each channel keeps one order on both sides;
removing matched pairs from an order that completes under NCCL's rules leaves one that completes
(each remaining operation finishes no later). ``decode_schedule(..., last_steps=...)`` builds the
resulting schedule, which the validator checks like the full one.
"""

from __future__ import annotations

from collections.abc import Sequence

from merak_pipe._decode_rules import decode_action_runs, validate_decode
from merak_pipe.ir import Action, ActionKind, Schedule

__all__ = ["decode_action_runs", "decode_schedule"]

_F, _SEND_F, _RECV_F = ActionKind.FORWARD, ActionKind.SEND_F, ActionKind.RECV_F
_SEND_T, _RECV_T = ActionKind.SEND_T, ActionKind.RECV_T


def _check_sizes(num_stages: int, num_microbatches: int, num_steps: int) -> None:
    for name, value in (
        ("num_stages", num_stages),
        ("num_microbatches", num_microbatches),
        ("num_steps", num_steps),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r}; expected an int >= 1")


def _last_steps(last_steps: Sequence[int] | None, num_microbatches: int, num_steps: int) -> tuple[int, ...]:
    if last_steps is None:
        return (num_steps - 1,) * num_microbatches
    ends = tuple(int(e) for e in last_steps)
    if len(ends) != num_microbatches or any(not 0 <= e < num_steps for e in ends):
        raise ValueError(
            f"last_steps={list(last_steps)}: expected one step in 0..{num_steps - 1} per microbatch "
            f"({num_microbatches} microbatches)"
        )
    return ends


def _stage_actions(stage: int, num_stages: int, num_microbatches: int, num_steps: int) -> list[Action]:
    """Every action of ``stage`` for all steps, in issue order ([Note: decode schedules])."""
    S, M, T = num_stages, num_microbatches, num_steps
    last = S - 1
    lag = min(S, M) - 1  # the first stage posts RECV_T(k) with SEND_F(k + lag)
    out: list[Action] = []
    for k in range(T * M):
        t, m = divmod(k, M)
        if stage > 0:
            out.append(Action(stage, _RECV_F, m, t))
        out.append(Action(stage, _F, m, t))
        if stage < last:
            out.append(Action(stage, _SEND_F, m, t))
        if stage == last and last > 0 and t < T - 1:
            out.append(Action(stage, _SEND_T, m, t))
        token = k - lag  # item whose tokens the first stage receives now (lag < M: before F(0, token + M))
        if stage == 0 and last > 0 and 0 <= token < (T - 1) * M:
            out.append(Action(0, _RECV_T, token % M, token // M))
    return out


def decode_schedule(
    num_stages: int,
    num_microbatches: int,
    num_steps: int,
    *,
    last_steps: Sequence[int] | None = None,
    check: bool = True,
) -> Schedule:
    """The lowered multi-step decode schedule ([Note: decode schedules]); stage ``s`` on rank ``s``.

    ``last_steps[m]``: the step whose tokens end microbatch ``m`` (default: the last, ``num_steps - 1``);
    the actions after it are dropped by :func:`decode_action_runs`. With ``check=True`` the schedule is
    validated under NCCL's rules (``merak_pipe.validate(schedule, nccl=True)``).
    """
    _check_sizes(num_stages, num_microbatches, num_steps)
    ends = _last_steps(last_steps, num_microbatches, num_steps)
    actions = {
        s: [
            a
            for a in _stage_actions(s, num_stages, num_microbatches, num_steps)
            if decode_action_runs(a, ends[a.microbatch])
        ]
        for s in range(num_stages)
    }
    schedule = Schedule(
        "decode",
        num_stages,
        num_microbatches,
        tuple(range(num_stages)),
        actions,
        lowered=True,
        options={"last_steps": ends},
        num_steps=num_steps,
    )
    if check:
        validate_decode(schedule, nccl=True)
    return schedule
