"""Multi-step decode schedules ([Note: decode schedules] in merak_pipe.schedules.decode): built, validated
under NCCL's rules (with microbatches ending early too), broken orders refused, and simulated: overlapping
steps keep the stages busy where a GPipe round per step pays the fill and drain every step."""

from __future__ import annotations

import dataclasses
import random

import pytest

import merak_pipe
from merak_pipe import Action, ActionKind, CostModel, ScheduleError, decode_action_runs, decode_schedule

F, SEND_F, RECV_F = ActionKind.FORWARD, ActionKind.SEND_F, ActionKind.RECV_F
SEND_T, RECV_T = ActionKind.SEND_T, ActionKind.RECV_T


def test_action_carries_its_step() -> None:
    a = Action(0, RECV_T, 3, 2)
    assert str(a) == "0RECV_T3@2" and Action.parse("0RECV_T3@2") == a
    assert str(Action(1, F, 0)) == "1F0" and Action.parse("1F0").step == 0
    with pytest.raises(ValueError, match="step=-1"):
        Action(0, F, 0, -1)


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 5])
def test_decode_schedule_validates_under_nccl_rules(stages: int, microbatches: int) -> None:
    steps = 4
    schedule = decode_schedule(stages, microbatches, steps)  # validate(nccl=True) inside
    merak_pipe.validate(schedule, nccl=True)
    assert schedule.is_decode and schedule.num_steps == steps and schedule.lowered
    for stage in range(stages):
        forwards = [(a.step, a.microbatch) for a in schedule.actions[stage] if a.kind is F]
        assert forwards == [(t, m) for t in range(steps) for m in range(microbatches)]
    tokens_sent = [a for a in schedule.actions[stages - 1] if a.kind is SEND_T]
    tokens_received = [a for a in schedule.actions[0] if a.kind is RECV_T]
    expected = [(t, m) for t in range(steps - 1) for m in range(microbatches)] if stages > 1 else []
    assert [(a.step, a.microbatch) for a in tokens_sent] == expected
    assert [(a.step, a.microbatch) for a in tokens_received] == expected


def test_first_stage_receives_tokens_when_the_last_stage_sends_them() -> None:
    """S=2, M=3: the first stage posts RECV_T(k) with SEND_F(k + 1), the last stage's unit after F(k) is
    [SEND_T(k), RECV_F(k + 1)]: both sides meet in one unit each."""
    schedule = decode_schedule(2, 3, 2)
    assert [str(a) for a in schedule.actions[0]] == (
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_T0 0F2 0SEND_F2 0RECV_T1 "
        "0F0@1 0SEND_F0@1 0RECV_T2 0F1@1 0SEND_F1@1 0F2@1 0SEND_F2@1"
    ).split()
    assert [str(a) for a in schedule.actions[1]] == (
        "1RECV_F0 1F0 1SEND_T0 1RECV_F1 1F1 1SEND_T1 1RECV_F2 1F2 1SEND_T2 "
        "1RECV_F0@1 1F0@1 1RECV_F1@1 1F1@1 1RECV_F2@1 1F2@1"
    ).split()


def test_microbatches_ending_early_still_validate() -> None:
    """Every combination of ends (the decoder drops the actions after a microbatch's end marker): the
    orders that remain run under NCCL's rules, on every stage count."""
    rng = random.Random(0)
    for _ in range(60):
        stages, microbatches, steps = rng.randint(1, 4), rng.randint(1, 5), rng.randint(1, 5)
        ends = [rng.randrange(steps) for _ in range(microbatches)]
        schedule = decode_schedule(stages, microbatches, steps, last_steps=ends)
        for stage in range(stages):
            for m, end in enumerate(ends):
                forwards = [a.step for a in schedule.actions[stage] if a.kind is F and a.microbatch == m]
                assert forwards == list(range(min(end + 2, steps)))  # its steps, then the end marker
        for m, end in enumerate(ends):
            sent = [a.step for a in schedule.actions[stages - 1] if a.kind is SEND_T and a.microbatch == m]
            assert sent == (list(range(min(end + 1, steps - 1))) if stages > 1 else [])


def test_decode_action_runs() -> None:
    assert decode_action_runs(Action(0, RECV_T, 1, 2), last_step=2)  # carries the end flag
    assert not decode_action_runs(Action(1, SEND_T, 1, 3), last_step=2)
    assert decode_action_runs(Action(1, RECV_F, 1, 3), last_step=2)  # the end marker
    assert decode_action_runs(Action(1, F, 1, 3), last_step=2)
    assert not decode_action_runs(Action(0, F, 1, 4), last_step=2)


def _with_actions(schedule, rank: int, actions: list[Action]):
    return dataclasses.replace(schedule, actions={**schedule.actions, rank: actions})


def test_late_token_receive_is_refused_under_nccl_rules() -> None:
    """Posting RECV_T(k) only right before the forward that needs it is fine with non-blocking posts, but
    with M > S the last stage's SEND_T waits in a unit the first stage reaches only after sends of its
    own that the last stage receives later: a deadlock on NCCL, refused."""
    schedule = decode_schedule(2, 4, 3)
    late: list[Action] = []
    for a in schedule.actions[0]:
        if a.kind is RECV_T:
            continue
        if a.kind is F and a.step > 0:
            late.append(Action(0, RECV_T, a.microbatch, a.step - 1))
        late.append(a)
    broken = _with_actions(schedule, 0, late)
    merak_pipe.validate(broken)  # the dependency order alone holds
    with pytest.raises(ScheduleError, match=r"breaks NCCL's point-to-point rules[\s\S]*rank 1 is stuck"):
        merak_pipe.validate(broken, nccl=True)


def test_swapped_receives_are_refused() -> None:
    schedule = decode_schedule(2, 2, 3)
    acts = list(schedule.actions[0])
    i, j = acts.index(Action(0, RECV_T, 0, 0)), acts.index(Action(0, RECV_T, 1, 0))
    acts[i], acts[j] = acts[j], acts[i]
    with pytest.raises(ScheduleError, match=r"0RECV_T1 is receive #0 on channel rank 1 -> rank 0"):
        merak_pipe.validate(_with_actions(schedule, 0, acts))


def test_forward_before_its_tokens_deadlocks() -> None:
    schedule = decode_schedule(2, 1, 2)
    acts = [a for a in schedule.actions[0] if a != Action(0, RECV_T, 0, 0)] + [Action(0, RECV_T, 0, 0)]
    with pytest.raises(ScheduleError, match=r"deadlocks:\n  rank 0 step \d+ \(0F0@1\) waits for RECV_T"):
        merak_pipe.validate(_with_actions(schedule, 0, acts))


def test_missing_or_foreign_actions_are_refused() -> None:
    schedule = decode_schedule(3, 2, 2)
    with pytest.raises(ScheduleError, match=r"rank 2 lacks 2SEND_T0"):
        merak_pipe.validate(
            _with_actions(schedule, 2, [a for a in schedule.actions[2] if a.kind is not SEND_T])
        )
    with pytest.raises(ScheduleError, match=r"1SEND_T0 is not part of this decode schedule"):
        merak_pipe.validate(_with_actions(schedule, 1, [*schedule.actions[1], Action(1, SEND_T, 0, 0)]))
    with pytest.raises(ValueError, match=r"last_steps=\[0, 5\]"):
        decode_schedule(2, 2, 3, last_steps=[0, 5])


@pytest.mark.parametrize(("stages", "microbatches"), [(2, 2), (2, 4), (4, 4), (4, 8)])
def test_overlapped_steps_approach_full_utilisation(stages: int, microbatches: int) -> None:
    """M >= S: over many steps every stage is busy nearly all the time (T·M / (T·M + S - 1)); a GPipe round
    per step is busy M / (M + S - 1) of the time, whatever the number of steps."""
    steps = 32
    costs = CostModel(forward=1.0, backward=0.0)
    sim = merak_pipe.simulate(decode_schedule(stages, microbatches, steps), costs)
    items = steps * microbatches
    assert sim.makespan == pytest.approx(items + stages - 1)
    for busy in sim.busy:
        assert busy / sim.makespan == pytest.approx(items / (items + stages - 1))
        assert busy / sim.makespan > 0.97
    round_ = merak_pipe.simulate(
        merak_pipe.build_schedule("gpipe", num_stages=stages, num_microbatches=microbatches), costs
    )
    for busy in round_.busy:
        assert busy / round_.makespan == pytest.approx(microbatches / (microbatches + stages - 1))
    assert sim.critical_path[0].start == 0.0 and sim.critical_path[-1].end == sim.makespan


def test_fewer_microbatches_than_stages_are_bounded_by_the_token_loop() -> None:
    """M < S: a microbatch needs S forwards to come back, so each stage is busy M / S of the steady state."""
    stages, microbatches, steps = 4, 2, 40
    sim = merak_pipe.simulate(decode_schedule(stages, microbatches, steps), CostModel(forward=1.0))
    assert sim.makespan == pytest.approx(stages * (steps - 1) + microbatches + stages - 1)
    assert sim.busy[0] / sim.makespan == pytest.approx(microbatches / stages, rel=0.05)


def test_token_messages_are_priced() -> None:
    fast = merak_pipe.simulate(decode_schedule(2, 1, 3), CostModel(forward=1.0))
    slow = merak_pipe.simulate(decode_schedule(2, 1, 3), CostModel(forward=1.0, p2p_latency=0.5))
    # each step: F0, message, F1, token back: 2 forwards and 2 latencies, the last step without the token
    assert fast.makespan == pytest.approx(6.0) and slow.makespan == pytest.approx(6.0 + 0.5 * 5)


def test_decode_schedules_have_no_csv_form() -> None:
    with pytest.raises(ValueError, match="multi-step decode schedule"):
        merak_pipe.to_csv(decode_schedule(2, 2, 2))
