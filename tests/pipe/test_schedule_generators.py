"""Every built-in schedule validates (compute-only and lowered) for every size, or refuses clearly."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from merak_pipe import (
    ActionKind,
    RecomputePlan,
    Schedule,
    ScheduleError,
    available_schedules,
    build_schedule,
    in_flight_counts,
    lower,
    register_schedule,
    validate,
)
from merak_pipe.schedules import _REGISTRY

ONE_STAGE_PER_RANK = ["gpipe", "1f1b", "zb-h1", "shifted-critical-path"]


def _check(schedule: Schedule) -> None:
    validate(schedule)
    lowered = lower(schedule)
    validate(lowered, channel_order=True)  # receives follow the senders' order (NCCL)
    assert lowered.lowered and not schedule.lowered
    assert [a for a in lowered.actions[0] if a.kind.is_compute] == schedule.actions[0]


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(ONE_STAGE_PER_RANK), S=st.integers(1, 16), M=st.integers(1, 64))
def test_one_stage_per_rank_schedules_validate(name: str, S: int, M: int) -> None:
    schedule = build_schedule(name, num_stages=S, num_microbatches=M)
    assert schedule.num_ranks == S and schedule.stage_to_rank == tuple(range(S))
    _check(schedule)


@pytest.mark.parametrize("name", ONE_STAGE_PER_RANK)
@pytest.mark.parametrize("S,M", [(1, 1), (16, 1), (1, 64), (16, 64), (16, 15), (5, 3)])
def test_one_stage_per_rank_schedules_validate_at_the_corners(name: str, S: int, M: int) -> None:
    _check(build_schedule(name, num_stages=S, num_microbatches=M))


@settings(max_examples=80, deadline=None)
@given(P=st.integers(1, 16), v=st.integers(1, 4), M=st.integers(1, 64))
def test_interleaved_validates_for_every_size(P: int, v: int, M: int) -> None:
    schedule = build_schedule("interleaved-1f1b", num_stages=P * v, num_microbatches=M, num_ranks=P)
    assert schedule.num_ranks == P
    assert all(schedule.stages_of(r) == tuple(r + k * P for k in range(v)) for r in range(P))
    _check(schedule)


@pytest.mark.parametrize("P,v,M", [(3, 2, 7), (4, 3, 13), (16, 4, 62), (5, 2, 64), (7, 4, 15)])
def test_interleaved_uneven_rounds(P: int, v: int, M: int) -> None:
    assert M % max(1, M // P) != 0  # sizes torch's flexible interleaved schedule refuses
    _check(build_schedule("interleaved-1f1b", num_stages=P * v, num_microbatches=M, num_ranks=P))


@settings(max_examples=40, deadline=None)
@given(P=st.integers(1, 8), v=st.integers(1, 4), M=st.integers(1, 32))
def test_interleaved_matches_torch_where_torch_defines_it(P: int, v: int, M: int) -> None:
    torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    rounds = max(1, M // P)
    if M % rounds != 0:
        return
    fake = SimpleNamespace(
        n_local_stages=v, pp_group_size=P, microbatches_per_round=M // rounds, _n_microbatches=M
    )
    ours = build_schedule("interleaved-1f1b", num_stages=P * v, num_microbatches=M, num_ranks=P)
    for rank in range(P):
        theirs = torch_schedules.ScheduleInterleaved1F1B._calculate_single_rank_operations(fake, rank)
        assert [str(a) for a in ours.actions[rank]] == [str(a) for a in theirs if a is not None]


def test_interleaved_layout_arguments() -> None:
    a = build_schedule("interleaved-1f1b", num_stages=8, num_microbatches=8, virtual_stages=2)
    b = build_schedule("interleaved-1f1b", num_stages=8, num_microbatches=8, num_ranks=4)
    assert a.actions == b.actions and a.num_ranks == 4
    with pytest.raises(ValueError, match="num_ranks=P or virtual_stages"):
        build_schedule("interleaved-1f1b", num_stages=8, num_microbatches=8)
    with pytest.raises(ValueError, match="not a multiple of num_ranks"):
        build_schedule("interleaved-1f1b", num_stages=6, num_microbatches=8, num_ranks=4)
    with pytest.raises(ValueError, match="make them agree"):
        build_schedule("interleaved-1f1b", num_stages=8, num_microbatches=8, num_ranks=4, virtual_stages=4)


@pytest.mark.parametrize("name", ONE_STAGE_PER_RANK)
def test_one_stage_per_rank_schedules_refuse_other_rank_counts(name: str) -> None:
    with pytest.raises(ValueError, match="num_ranks=2 must equal num_stages=4"):
        build_schedule(name, num_stages=4, num_microbatches=4, num_ranks=2)


@settings(max_examples=40, deadline=None)
@given(S=st.integers(1, 16), M=st.integers(1, 64))
def test_in_flight_counts_match_the_closed_forms(S: int, M: int) -> None:
    assert in_flight_counts(build_schedule("gpipe", num_stages=S, num_microbatches=M)) == [M] * S
    expected = [min(S - i, M) for i in range(S)]
    assert in_flight_counts(build_schedule("1f1b", num_stages=S, num_microbatches=M)) == expected
    assert in_flight_counts(build_schedule("zb-h1", num_stages=S, num_microbatches=M)) == expected


@settings(max_examples=40, deadline=None)
@given(S=st.integers(2, 16), M=st.integers(1, 64))
def test_shifted_critical_path_shape(S: int, M: int) -> None:
    schedule = build_schedule("shifted-critical-path", num_stages=S, num_microbatches=M)
    assert schedule.recompute is not None and schedule.recompute.fractions == (1.0,) * (S - 1) + (0.0,)
    last = schedule.actions[S - 1]
    assert all(a.kind is not ActionKind.RECOMPUTE for a in last)
    for rank in range(S - 1):
        acts = schedule.actions[rank]
        for step, a in enumerate(acts):
            if a.kind is ActionKind.FULL_BACKWARD:
                # (b): the recompute of this microbatch comes right before its backward, i.e. ahead
                # of the gradient's arrival, not after it.
                assert (
                    acts[step - 1].kind is ActionKind.RECOMPUTE and acts[step - 1].microbatch == a.microbatch
                )
        # (c): a deeper warm-up than 1F1B's S - 1 - i on stages that recompute everything.
        warmup = next(i for i, a in enumerate(acts) if a.kind is not ActionKind.FORWARD)
        assert warmup == min(2 * (S - 1 - rank) + 1, M)


def test_shifted_critical_path_keeps_partial_plans_and_zeroes_the_last_stage() -> None:
    plan = RecomputePlan((0.5, 0.25, 0.0, 0.7))
    schedule = build_schedule("shifted-critical-path", num_stages=4, num_microbatches=8, recompute=plan)
    assert schedule.recompute == RecomputePlan((0.5, 0.25, 0.0, 0.0))
    assert {a.stage for _, a in schedule if a.kind is ActionKind.RECOMPUTE} == {0, 1}
    # Partial fractions keep 1F1B's warm-up depth.
    assert [a.kind for a in schedule.actions[0][:4]] == [ActionKind.FORWARD] * 4
    assert schedule.actions[0][4].kind is ActionKind.RECOMPUTE
    none = build_schedule("shifted-critical-path", num_stages=4, num_microbatches=8, recompute="none")
    assert none.actions == build_schedule("1f1b", num_stages=4, num_microbatches=8).actions
    with pytest.raises(ValueError, match="extra_warmup"):
        build_schedule("shifted-critical-path", num_stages=4, num_microbatches=8, extra_warmup=[1, 2])


@settings(max_examples=40, deadline=None)
@given(fractions=st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=2, max_size=8), M=st.integers(1, 16))
def test_shifted_critical_path_validates_for_any_recompute_plan(fractions: list[float], M: int) -> None:
    """A later stage recomputing more than an earlier one (e.g. (0, 1, 0, 0)) must not deadlock."""
    schedule = build_schedule(
        "shifted-critical-path",
        num_stages=len(fractions),
        num_microbatches=M,
        recompute=RecomputePlan(tuple(fractions)),
    )
    _check(schedule)
    validate(schedule, nccl=True)
    warmups = [
        next((i for i, a in enumerate(acts) if a.kind is not ActionKind.FORWARD), len(acts))
        for acts in (schedule.actions[r] for r in range(len(fractions)))
    ]
    assert all(b <= a for a, b in zip(warmups, warmups[1:], strict=False)), warmups


def test_shifted_critical_path_cuts_a_deeper_warmup_after_a_shallower_stage() -> None:
    schedule = build_schedule(
        "shifted-critical-path",
        num_stages=4,
        num_microbatches=8,
        recompute=RecomputePlan((0.0, 1.0, 0.0, 0.0)),
    )
    # Stage 1 recomputes everything but may not warm up deeper than stage 0 (3 forwards) nor run
    # more than 2 ahead of stage 2: it keeps 1F1B's depth, its R still before each B.
    assert schedule.options["extra_warmup"] == (0, 0, 0, 0)
    assert [str(a) for a in schedule.actions[1][:5]] == ["1F0", "1F1", "1F2", "1R0", "1B0"]
    full = build_schedule("shifted-critical-path", num_stages=4, num_microbatches=8)
    assert full.options["extra_warmup"] == (3, 2, 1, 0)  # the default plan keeps its deeper warm-up
    with pytest.raises(ValueError, match="stage 1 would warm up with 7 forwards, more than the 3 of stage 0"):
        build_schedule("shifted-critical-path", num_stages=4, num_microbatches=8, extra_warmup=[0, 5, 0, 0])


def test_recompute_argument_forms() -> None:
    for given_value, expected in [("full", (1.0,) * 3), ("none", (0.0,) * 3), (0.25, (0.25,) * 3)]:
        s = build_schedule("1f1b", num_stages=3, num_microbatches=2, recompute=given_value)
        assert s.recompute is not None and s.recompute.fractions == expected
    with pytest.raises(ValueError, match="'none', 'full'"):
        build_schedule("1f1b", num_stages=3, num_microbatches=2, recompute="some")
    with pytest.raises(ValueError, match="covers 2 stages"):
        build_schedule("1f1b", num_stages=3, num_microbatches=2, recompute=RecomputePlan.full(2))


def test_registry() -> None:
    assert {"gpipe", "1f1b", "interleaved-1f1b", "shifted-critical-path", "zb-h1"} <= set(
        available_schedules()
    )
    with pytest.raises(ValueError, match="unknown schedule 'nope'"):
        build_schedule("nope", num_stages=2, num_microbatches=2)
    with pytest.raises(ValueError, match="already registered"):
        register_schedule("1f1b", lambda **kw: None)

    def reversed_gpipe(
        *, num_stages: int, num_microbatches: int, num_ranks: int | None, recompute: RecomputePlan | None
    ) -> Schedule:
        s = build_schedule("gpipe", num_stages=num_stages, num_microbatches=num_microbatches, check=False)
        for acts in s.actions.values():
            acts.reverse()  # backwards before forwards: invalid
        s.name = "reversed-gpipe"
        return s

    register_schedule("reversed-gpipe-test", reversed_gpipe)
    try:
        with pytest.raises(ScheduleError, match="deadlocks or breaks a dependency"):
            build_schedule("reversed-gpipe-test", num_stages=2, num_microbatches=2)
        s = build_schedule("reversed-gpipe-test", num_stages=2, num_microbatches=2, check=False)
        assert s.name == "reversed-gpipe"
    finally:
        _REGISTRY.pop("reversed-gpipe-test")


@pytest.mark.parametrize(
    "kwargs", [{"num_stages": 0, "num_microbatches": 1}, {"num_stages": 2, "num_microbatches": 0}]
)
def test_sizes_are_checked(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError, match=">= 1"):
        build_schedule("1f1b", **kwargs)
