"""The NCCL replay checker: every built-in schedule's issue order passes; broken orders are named.

Pure tests (no process group). The runtime issues exactly :func:`issue_orders`, so a pass here
is a pass for what runs. The regression tests rebuild the order the runtime used to issue
(receives posted up to two compute actions ahead, single ops outside the batches) and show the
checker flags it, and that the plain lowered order of shifted-critical-path (which needs NCCL's
eager buffer) is flagged while the runtime's order is not.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from merak_pipe import Action, ActionKind, Schedule, ScheduleError, build_schedule, lower, validate
from merak_pipe.nccl_check import check_nccl, replay, round_units
from merak_pipe.p2p_order import P2POp, Unit, _base_order, _op, issue_orders

BUILT_IN = ["gpipe", "1f1b", "interleaved-1f1b", "shifted-critical-path", "zb-h1"]


def _build(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    ranks = {"num_ranks": max(1, num_stages // 2)} if name == "interleaved-1f1b" else {}
    return build_schedule(name, num_stages=num_stages, num_microbatches=num_microbatches, **ranks)


def _grid() -> list[tuple[str, int, int]]:
    cases = []
    for name in BUILT_IN:
        for stages in (2, 3, 4, 8, 16):
            if name == "interleaved-1f1b" and stages % 2:
                continue
            for microbatches in (1, 2, 5, 8, 16, 64):
                cases.append((name, stages, microbatches))
    return cases


@pytest.mark.parametrize("name,num_stages,num_microbatches", _grid())
def test_built_in_schedules_run_under_nccl_rules(name: str, num_stages: int, num_microbatches: int) -> None:
    schedule = lower(_build(name, num_stages, num_microbatches))
    assert check_nccl(schedule) is schedule
    for forward_only in (False, True):
        result = replay(round_units(schedule, forward_only=forward_only))
        assert result.ok, result.summary()


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(BUILT_IN), num_stages=st.integers(1, 16), num_microbatches=st.integers(1, 64))
def test_any_size_runs_under_nccl_rules(name: str, num_stages: int, num_microbatches: int) -> None:
    if name == "interleaved-1f1b" and num_stages % 2:
        num_stages += 1
    validate(_build(name, num_stages, num_microbatches), nccl=True)


def test_every_message_is_paired_with_itself() -> None:
    """On each channel the k-th send and the k-th receive carry the same message (checked inside replay)."""
    schedule = lower(_build("interleaved-1f1b", 8, 16))
    units = round_units(schedule)
    sends = sorted(op.message for rank in units for unit in units[rank] for op in unit if op.send)
    recvs = sorted(op.message for rank in units for unit in units[rank] for op in unit if not op.send)
    assert sends == recvs and replay(units).ok


# ----------------------------------------------------------------------------- the old order


def _old_issue_order(schedule: Schedule, rank: int) -> list[Unit]:
    """The p2p units the runtime issued before this check existed (data messages only).

    Runs of consecutive send/recv actions were one batch, but before each compute action the
    receives of the next two compute actions were posted at once as single ops (a RECV_B once
    the stage had run a forward, a RECV_F once its input shapes were known).
    """
    actions = schedule.actions[rank]
    rank_of = schedule.stage_to_rank
    compute = [i for i, a in enumerate(actions) if a.kind.is_compute]
    posted: set[int] = set()
    forwarded: set[int] = set()
    shapes_known: set[int] = set()
    units: list[Unit] = []
    batch: list[P2POp] = []
    next_compute = 0
    for index, action in enumerate(actions):
        if action.kind.is_comm:
            if index not in posted:
                posted.add(index)
                batch.append(_op(action, rank_of))
            continue
        if batch:
            units.append(tuple(batch))
            batch = []
        while next_compute < len(compute) and compute[next_compute] <= index:
            next_compute += 1
        horizon_rank = min(next_compute + 1, len(compute) - 1)
        horizon = compute[horizon_rank] if horizon_rank >= next_compute else index
        for j in range(index + 1, min(horizon, len(actions))):
            ahead = actions[j]
            if j in posted:
                continue
            if (ahead.kind is ActionKind.RECV_B and ahead.stage in forwarded) or (
                ahead.kind is ActionKind.RECV_F and ahead.stage in shapes_known
            ):
                posted.add(j)
                units.append((_op(ahead, rank_of),))
        if action.kind is ActionKind.FORWARD:
            forwarded.add(action.stage)
            shapes_known.add(action.stage)
    if batch:
        units.append(tuple(batch))
    return units


@pytest.mark.parametrize("num_stages", [2, 4])
@pytest.mark.parametrize("name", ["1f1b", "gpipe", "zb-h1"])
def test_the_old_early_receives_are_flagged(name: str, num_stages: int) -> None:
    schedule = lower(_build(name, num_stages, 8))
    old = {rank: _old_issue_order(schedule, rank) for rank in range(schedule.num_ranks)}
    result = replay(old)
    assert not result.unmatched and not result.mismatched
    assert result.stuck, f"{name} at pp={num_stages}: the old order was expected to deadlock"
    assert replay(round_units(schedule)).ok  # what the runtime issues now


def test_the_old_two_stage_1f1b_deadlock_names_both_ranks_and_actions() -> None:
    """Stage 0 posts RECV_B0 before SEND_F1 while stage 1 posts RECV_F1 before SEND_B0."""
    schedule = lower(_build("1f1b", 2, 4))
    old = {rank: _old_issue_order(schedule, rank) for rank in range(2)}
    assert [str(op) for op in old[0][1]] == ["0RECV_B0"] and [str(op) for op in old[0][2]] == ["0SEND_F1"]
    assert [str(op) for op in old[1][1]] == ["1RECV_F1"] and [str(op) for op in old[1][2]] == ["1SEND_B0"]
    result = replay(old)
    assert result.stuck == {0: 1, 1: 1}
    text = result.summary()
    assert "rank 0 is stuck at unit 1 [0RECV_B0]" in text
    assert "rank 1 is stuck at unit 1 [1RECV_F1]" in text
    assert "0RECV_B0 needs its partner in rank 1's unit 2" in text


def test_shifted_critical_path_plain_lowered_order_needs_an_eager_buffer() -> None:
    """Lowered order as is: stage 0 sends F2 before receiving B0, stage 1 sends B0 before receiving F2;
    with a rendezvous (a message above NCCL's eager size) that deadlocks. The runtime defers the send."""
    schedule = lower(_build("shifted-critical-path", 2, 4))
    plain = {
        rank: [s for s in _base_order(schedule, rank, False) if isinstance(s, tuple)] for rank in range(2)
    }
    result = replay(plain)
    assert result.stuck, result.summary()
    assert "0SEND_F2" in result.summary()
    fixed = issue_orders(schedule)
    unit_with_f2 = next(step for step in fixed[0] if isinstance(step, tuple) and "0SEND_F2" in map(str, step))
    assert "0RECV_B0" in map(str, unit_with_f2)  # batched with the receive it used to block
    assert replay(round_units(schedule)).ok


# ----------------------------------------------------------------------------- hand-made orders


def _lowered(rows: dict[int, str], *, num_stages: int = 2, num_microbatches: int = 1) -> Schedule:
    actions = {rank: [Action.parse(t) for t in row.split()] for rank, row in rows.items()}
    return Schedule("hand", num_stages, num_microbatches, tuple(range(num_stages)), actions, lowered=True)


def test_a_receive_ahead_of_the_send_its_peer_waits_for_is_a_deadlock() -> None:
    """Valid under non-blocking posts (validate without nccl), a deadlock under NCCL's stream order."""
    schedule = _lowered({0: "0RECV_B0 0F0 0SEND_F0 0B0", 1: "1RECV_F0 1F0 1B0 1SEND_B0"})
    validate(schedule)
    with pytest.raises(ScheduleError, match="can deadlock under NCCL's point-to-point rules") as err:
        validate(schedule, nccl=True)
    text = str(err.value)
    assert "rank 0 is stuck at unit 0 [0RECV_B0]" in text and "rank 1 is stuck at unit" in text
    assert err.value.rank == 0 and err.value.step == 0
    assert ">>0RECV_B0<<" in text


def test_receives_out_of_the_senders_order_are_mismatched_pairs() -> None:
    schedule = _lowered(
        {
            0: "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
            1: "1RECV_F1 1RECV_F0 1F0 1B0 1SEND_B0 1F1 1B1 1SEND_B1",
        },
        num_microbatches=2,
    )
    validate(schedule)
    with pytest.raises(ScheduleError, match="breaks NCCL's point-to-point rules") as err:
        validate(schedule, nccl=True)
    assert "rank 0 sends 0SEND_F0" in str(err.value) and "receives it as 1RECV_F1" in str(err.value)


def test_unmatched_operations_are_reported() -> None:
    send = P2POp(True, 1, "F", 0, 0, Action(0, ActionKind.SEND_F, 0))
    result = replay({0: [(send,)], 1: []})
    assert not result.ok and result.unmatched and "posts no matching receive" in result.unmatched[0]


@pytest.mark.parametrize("num_stages", [4, 8, 16])
@pytest.mark.parametrize("num_microbatches", [1, 4, 16])
def test_a_v_layout_runs_under_nccl_rules(num_stages: int, num_microbatches: int) -> None:
    """Two stages per rank in a V (stage s on rank min(s, S - 1 - s)), GPipe order."""
    from tests.pipe._runtime_bodies import v_schedule

    validate(v_schedule(num_stages=num_stages, num_microbatches=num_microbatches), nccl=True)
