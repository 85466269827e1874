"""The validator catches each kind of broken schedule and prints the table with the bad step marked."""

from __future__ import annotations

import dataclasses

import pytest

from merak_pipe import (
    Action,
    ActionKind,
    RecomputePlan,
    Schedule,
    ScheduleError,
    build_schedule,
    lower,
    strip_comms,
    validate,
)


def _schedule(
    rows: dict[int, str],
    *,
    num_stages: int,
    num_microbatches: int,
    stage_to_rank: tuple[int, ...] | None = None,
    lowered: bool = False,
    recompute: RecomputePlan | None = None,
) -> Schedule:
    actions = {rank: [Action.parse(t) for t in row.split()] for rank, row in rows.items()}
    return Schedule(
        "hand",
        num_stages,
        num_microbatches,
        stage_to_rank or tuple(range(num_stages)),
        actions,
        lowered=lowered,
        recompute=recompute,
    )


def _marked(err: pytest.ExceptionInfo[ScheduleError]) -> str:
    marked = [line for line in str(err.value).splitlines() if ">>" in line]
    assert len(marked) == 1, str(err.value)
    return marked[0]


def test_a_valid_hand_written_schedule_passes() -> None:
    s = _schedule({0: "0F0 0F1 0B0 0B1", 1: "1F0 1B0 1F1 1B1"}, num_stages=2, num_microbatches=2)
    assert validate(s) is s
    validate(lower(s))


def test_backward_before_forward_is_caught_and_marked() -> None:
    s = _schedule({0: "0B0 0F0", 1: "1F0 1B0"}, num_stages=2, num_microbatches=1)
    with pytest.raises(ScheduleError) as err:
        validate(s)
    assert err.value.rank == 0 and err.value.step == 0
    assert ">>0B0<<" in _marked(err)
    assert "waits for 0F0, which this rank only runs later, at step 1" in str(err.value)


def test_forward_before_previous_stage_forward_on_the_same_rank() -> None:
    s = _schedule({0: "1F0 0F0 1B0 0B0"}, num_stages=2, num_microbatches=1, stage_to_rank=(0, 0))
    with pytest.raises(ScheduleError, match="waits for 0F0") as err:
        validate(s)
    assert ">>1F0<<" in _marked(err)


def test_weight_before_input_gradient() -> None:
    s = _schedule({0: "0F0 0W0 0I0"}, num_stages=1, num_microbatches=1)
    with pytest.raises(ScheduleError, match="waits for 0I0"):
        validate(s)


def test_recompute_after_the_backward_that_needs_it() -> None:
    plan = RecomputePlan.full(1)
    ok = _schedule({0: "0F0 0R0 0B0"}, num_stages=1, num_microbatches=1, recompute=plan)
    validate(ok)
    bad = _schedule({0: "0F0 0B0 0R0"}, num_stages=1, num_microbatches=1, recompute=plan)
    with pytest.raises(ScheduleError, match="waits for 0R0"):
        validate(bad)
    no_plan = _schedule({0: "0F0 0R0 0B0"}, num_stages=1, num_microbatches=1)
    with pytest.raises(ScheduleError, match="recompute fraction is 0"):
        validate(no_plan)


@pytest.mark.parametrize(
    "rows,message",
    [
        ({0: "0F0 0F0 0B0"}, "appears twice"),
        ({0: "0F0"}, "has no 0B0"),
        ({0: "0B0"}, "has no forward 0F0"),
        ({0: "0F0 0I0"}, "has no 0W0"),
        ({0: "0F0 0B0 0W0"}, "both a full backward"),
        ({0: "0F0 0B0 0F1 0B1"}, "microbatch 1 but the schedule has 1"),
        ({0: "0F0 0B0 1F0"}, "stage 1 but the schedule has 1 stages"),
    ],
)
def test_structural_errors(rows: dict[int, str], message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        validate(_schedule(rows, num_stages=1, num_microbatches=1))


def test_action_on_the_wrong_rank() -> None:
    s = _schedule({0: "0F0 1F0 0B0", 1: "1B0"}, num_stages=2, num_microbatches=1)
    with pytest.raises(ScheduleError, match="stage 1 is held by rank 1") as err:
        validate(s)
    assert ">>1F0<<" in _marked(err)


def test_comm_actions_need_a_lowered_schedule_and_a_cross_rank_edge() -> None:
    s = _schedule({0: "0F0 0SEND_F0 0B0", 1: "1F0 1B0"}, num_stages=2, num_microbatches=1)
    with pytest.raises(ScheduleError, match="lowered=False"):
        validate(s)
    same_rank = _schedule(
        {0: "0F0 0SEND_F0 1RECV_F0 1F0 1B0 0B0"},
        num_stages=2,
        num_microbatches=1,
        stage_to_rank=(0, 0),
        lowered=True,
    )
    with pytest.raises(ScheduleError, match="no cross-rank edge"):
        validate(same_rank)


def test_lowered_schedule_missing_a_receive() -> None:
    good = lower(build_schedule("1f1b", num_stages=3, num_microbatches=4))
    actions = {r: list(a) for r, a in good.actions.items()}
    actions[1].remove(Action(1, ActionKind.RECV_F, 2))
    with pytest.raises(ScheduleError, match="lacks 1RECV_F2"):
        validate(dataclasses.replace(good, actions=actions))


def test_lowered_deadlock_from_a_send_after_the_backward_that_needs_it() -> None:
    good = lower(build_schedule("gpipe", num_stages=2, num_microbatches=1))
    assert [str(a) for a in good.actions[0]] == ["0F0", "0SEND_F0", "0RECV_B0", "0B0"]
    actions = {r: list(a) for r, a in good.actions.items()}
    # Rank 0 sends its activation only after its backward, whose gradient needs that activation.
    send = actions[0].pop(1)
    actions[0].append(send)
    with pytest.raises(ScheduleError, match="deadlocks") as err:
        validate(dataclasses.replace(good, actions=actions))
    assert ">>1F0<<" in _marked(err)  # the earliest blocked step is marked
    assert "rank 1 step 1 (1F0) waits for 0SEND_F0, which rank 0 runs at step 3" in str(err.value)
    assert "rank 0 step 2 (0B0) waits for 1SEND_B0" in str(err.value)


def test_lowered_receive_posted_after_its_consumer() -> None:
    good = lower(build_schedule("1f1b", num_stages=2, num_microbatches=2))
    actions = {r: list(a) for r, a in good.actions.items()}
    recv = Action(1, ActionKind.RECV_F, 0)
    actions[1].remove(recv)
    actions[1].insert(2, recv)
    with pytest.raises(ScheduleError, match="waits for 1RECV_F0, which this rank only runs later") as err:
        validate(dataclasses.replace(good, actions=actions))
    assert ">>1F0<<" in _marked(err)


def test_long_schedules_print_an_excerpt_around_the_mark() -> None:
    good = build_schedule("1f1b", num_stages=2, num_microbatches=200)
    actions = {r: list(a) for r, a in good.actions.items()}
    f = actions[0].index(Action.parse("0F150"))
    b = actions[0].index(Action.parse("0B150"))
    actions[0][f], actions[0][b] = actions[0][b], actions[0][f]
    with pytest.raises(ScheduleError) as err:
        validate(dataclasses.replace(good, actions=actions))
    text = str(err.value)
    assert "steps above" in text and "steps below" in text
    assert len(text.splitlines()) < 60
    assert ">>0B150<<" in _marked(err)


def test_lower_and_strip_are_inverse() -> None:
    s = build_schedule("interleaved-1f1b", num_stages=6, num_microbatches=6, num_ranks=3)
    lowered = lower(s)
    assert strip_comms(lowered).actions == s.actions
    with pytest.raises(ValueError, match="already lowered"):
        lower(lowered)
    n_cross = sum(1 for st in range(5) if s.stage_to_rank[st] != s.stage_to_rank[st + 1])
    n_comm = sum(1 for _, a in lowered if a.kind.is_comm)
    assert n_comm == 4 * n_cross * s.num_microbatches


def test_channel_order_is_checked_on_request() -> None:
    good = lower(build_schedule("1f1b", num_stages=2, num_microbatches=3))
    validate(good, channel_order=True)
    actions = {r: list(a) for r, a in good.actions.items()}
    # Post the receive of microbatch 1 before that of microbatch 0: fine with tags, wrong for NCCL.
    r0, r1 = (
        actions[1].index(Action(1, ActionKind.RECV_F, 0)),
        actions[1].index(Action(1, ActionKind.RECV_F, 1)),
    )
    actions[1][r0], actions[1][r1] = actions[1][r1], actions[1][r0]
    actions[1].remove(Action(1, ActionKind.RECV_F, 0))
    actions[1].insert(0, Action(1, ActionKind.RECV_F, 0))
    actions[1].remove(Action(1, ActionKind.RECV_F, 1))
    actions[1].insert(0, Action(1, ActionKind.RECV_F, 1))
    swapped = dataclasses.replace(good, actions=actions)
    validate(swapped)
    with pytest.raises(
        ScheduleError, match="receive #0 on channel rank 0 -> rank 1, but send #0 on that channel is 0SEND_F0"
    ) as err:
        validate(swapped, channel_order=True)
    assert ">>1RECV_F1<<" in _marked(err)


def _naive_lower(schedule: Schedule) -> Schedule:
    """Each receive right before its consumer (no channel ordering)."""
    lowered = lower(schedule)
    actions: dict[int, list[Action]] = {}
    for rank, acts in lowered.actions.items():
        compute_and_sends = [a for a in acts if a.kind not in (ActionKind.RECV_F, ActionKind.RECV_B)]
        out: list[Action] = []
        for a in compute_and_sends:
            if a.kind is ActionKind.FORWARD and a.stage > 0 and schedule.rank_of(a.stage - 1) != rank:
                out.append(Action(a.stage, ActionKind.RECV_F, a.microbatch))
            if (
                a.kind is ActionKind.FULL_BACKWARD
                and a.stage < schedule.num_stages - 1
                and schedule.rank_of(a.stage + 1) != rank
            ):
                out.append(Action(a.stage, ActionKind.RECV_B, a.microbatch))
            out.append(a)
        actions[rank] = out
    return dataclasses.replace(lowered, actions=actions)


def test_lowering_posts_receives_in_channel_order_for_interleaved_schedules() -> None:
    """Uneven rounds consume messages out of send order; lowering posts the earlier ones first."""
    s = build_schedule("interleaved-1f1b", num_stages=4, num_microbatches=5, num_ranks=2)
    naive = _naive_lower(s)
    validate(naive)  # fine with tagged messages
    with pytest.raises(ScheduleError, match="receives must follow the senders' order"):
        validate(naive, channel_order=True)
    lowered = lower(s)
    validate(lowered, channel_order=True)
    assert strip_comms(lowered).actions == s.actions


def test_gc_state_is_restored() -> None:
    import gc

    from merak_pipe import simulate

    s = build_schedule("1f1b", num_stages=3, num_microbatches=4)
    assert gc.isenabled()
    simulate(lower(s))
    assert gc.isenabled()
    gc.disable()
    try:
        validate(s)
        assert not gc.isenabled()
    finally:
        gc.enable()
    bad = dataclasses.replace(s, actions={r: list(reversed(a)) for r, a in s.actions.items()})
    with pytest.raises(ScheduleError):
        validate(bad)
    assert gc.isenabled()
