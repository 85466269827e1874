"""The simulator against closed forms: makespan, bubbles, memory, critical path, p2p delays."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from merak_pipe import (
    ActionKind,
    CostModel,
    RecomputePlan,
    build_schedule,
    in_flight_counts,
    lower,
    simulate,
    stage_aware_plan,
)

costs_st = st.floats(0.1, 10.0, allow_nan=False)


@settings(max_examples=60, deadline=None)
@given(S=st.integers(1, 12), M=st.integers(1, 32), F=costs_st, B=costs_st)
def test_1f1b_bubble_and_makespan_closed_form(S: int, M: int, F: float, B: float) -> None:
    r = simulate(build_schedule("1f1b", num_stages=S, num_microbatches=M), CostModel(forward=F, backward=B))
    assert r.makespan == pytest.approx((M + S - 1) * (F + B), rel=1e-9)
    for bubble in r.bubble_fraction:
        assert bubble == pytest.approx((S - 1) / (M + S - 1), abs=1e-9)


@settings(max_examples=40, deadline=None)
@given(S=st.integers(1, 12), M=st.integers(1, 32), A=st.lists(st.floats(0.5, 4.0), min_size=12, max_size=12))
def test_activation_peaks_gpipe_m_and_1f1b_min_s_minus_i_m(S: int, M: int, A: list[float]) -> None:
    costs = CostModel(activation_bytes=A[:S])
    gpipe = simulate(build_schedule("gpipe", num_stages=S, num_microbatches=M), costs)
    one = simulate(build_schedule("1f1b", num_stages=S, num_microbatches=M), costs)
    for i in range(S):
        assert gpipe.peak_memory[i] == pytest.approx(M * A[i])
        assert one.peak_memory[i] == pytest.approx(min(S - i, M) * A[i])
        assert gpipe.memory[i][-1][1] == pytest.approx(0.0, abs=1e-9)  # everything is freed at the end
        assert one.memory[i][-1][1] == pytest.approx(0.0, abs=1e-9)


@settings(max_examples=40, deadline=None)
@given(S=st.integers(2, 10), M=st.integers(1, 24), b=st.floats(0.0, 0.3))
def test_recompute_memory_counts_kept_inputs_and_one_recomputed_microbatch(S: int, M: int, b: float) -> None:
    costs = CostModel(activation_bytes=1.0, input_bytes=b)
    full = simulate(build_schedule("1f1b", num_stages=S, num_microbatches=M, recompute="full"), costs)
    scp = simulate(build_schedule("shifted-critical-path", num_stages=S, num_microbatches=M), costs)
    half = simulate(build_schedule("1f1b", num_stages=S, num_microbatches=M, recompute=0.5), costs)
    for i in range(S):
        n = min(S - i, M)
        assert full.peak_memory[i] == pytest.approx(n * b + 1.0)
        # A partly checkpointed stage: kept (1 - f) A + b per microbatch, f A recomputed for one at a time.
        assert half.peak_memory[i] == pytest.approx(n * (0.5 + b) + 0.5)
        if i < S - 1:
            assert scp.peak_memory[i] == pytest.approx(min(2 * (S - 1 - i) + 1, M) * b + 1.0)
        else:
            assert scp.peak_memory[i] == pytest.approx(1.0)  # the last stage keeps its activations


def test_recompute_time_goes_into_the_backward_or_the_r_action() -> None:
    costs = CostModel(forward=1.0, backward=2.0, recompute=0.8)
    inside = simulate(build_schedule("1f1b", num_stages=1, num_microbatches=3, recompute=0.5), costs)
    assert inside.makespan == pytest.approx(3 * (1.0 + 2.0 + 0.4))
    plan = RecomputePlan.full(2)
    scp = simulate(
        build_schedule("shifted-critical-path", num_stages=2, num_microbatches=3, recompute=plan), costs
    )
    r_durations = [t.duration for t in scp.timeline if t.action.kind is ActionKind.RECOMPUTE]
    b_durations = [t.duration for t in scp.timeline if t.action.kind is ActionKind.FULL_BACKWARD]
    assert r_durations == [pytest.approx(0.8)] * 3
    assert b_durations == [pytest.approx(2.0)] * 6
    assert scp.busy[0] == pytest.approx(3 * (1.0 + 0.8 + 2.0)) and scp.busy[1] == pytest.approx(3 * 3.0)


@settings(max_examples=30, deadline=None)
@given(S=st.integers(2, 8), F=costs_st, B=costs_st, L=st.floats(0.0, 5.0), nbytes=st.floats(0.0, 10.0))
def test_p2p_delay_single_microbatch(S: int, F: float, B: float, L: float, nbytes: float) -> None:
    costs = CostModel(forward=F, backward=B, p2p_latency=L, p2p_bandwidth=4.0, boundary_bytes=nbytes)
    r = simulate(build_schedule("1f1b", num_stages=S, num_microbatches=1), costs)
    assert r.makespan == pytest.approx(S * (F + B) + 2 * (S - 1) * (L + nbytes / 4.0))


@pytest.mark.parametrize(
    "name,kw",
    [("1f1b", {}), ("zb-h1", {}), ("shifted-critical-path", {}), ("interleaved-1f1b", {"num_ranks": 3})],
)
def test_lowered_and_compute_only_simulate_the_same(name: str, kw: dict[str, int]) -> None:
    s = build_schedule(name, num_stages=6, num_microbatches=9, **kw)
    costs = CostModel(forward=[1, 2, 1, 1.5, 1, 1], backward=2.5, p2p_latency=0.3, input_bytes=0.1)
    a, b = simulate(s, costs), simulate(lower(s), costs)
    assert a.makespan == pytest.approx(b.makespan)
    assert a.peak_memory == pytest.approx(b.peak_memory)


@pytest.mark.parametrize(
    "name,kw",
    [
        ("1f1b", {}),
        ("gpipe", {}),
        ("zb-h1", {}),
        ("shifted-critical-path", {}),
        ("interleaved-1f1b", {"num_ranks": 2}),
    ],
)
def test_critical_path_is_a_tight_chain_from_zero_to_the_makespan(name: str, kw: dict[str, int]) -> None:
    costs = CostModel(forward=[1.0, 1.3, 0.7, 1.1], backward=2.1, p2p_latency=0.25)
    r = simulate(build_schedule(name, num_stages=4, num_microbatches=8, **kw), costs)
    path = r.critical_path
    assert path[0].start == 0.0 and path[-1].end == pytest.approx(r.makespan)
    for prev, nxt in zip(path, path[1:], strict=False):
        gap = nxt.start - prev.end
        expected = 0.0 if prev.rank == nxt.rank else 0.25
        assert gap == pytest.approx(expected, abs=1e-9), (prev, nxt)
    assert sum(t.duration for t in path) + 0.25 * sum(
        p.rank != n.rank for p, n in zip(path, path[1:], strict=False)
    ) == pytest.approx(r.makespan)


def test_every_action_respects_its_rank_order_and_bubbles_match_busy_time() -> None:
    r = simulate(
        build_schedule("interleaved-1f1b", num_stages=8, num_microbatches=8, num_ranks=4),
        CostModel(forward=1.0, backward=2.0),
    )
    by_rank: dict[int, list[tuple[float, float]]] = {}
    for t in r.timeline:
        by_rank.setdefault(t.rank, []).append((t.start, t.end))
    for rank, spans in by_rank.items():
        spans.sort()
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:], strict=False))
        busy = sum(e - s for s, e in spans)
        assert r.bubble_fraction[rank] == pytest.approx(1 - busy / r.makespan)
        assert busy == pytest.approx(2 * 8 * 3.0)  # two stages per rank, 8 microbatches, F + B = 3


def test_zb_h1_saves_the_weight_passes_of_the_cooldown_at_1f1b_memory() -> None:
    for S, M in [(4, 8), (8, 16)]:
        costs = CostModel(forward=1.0, backward=2.0)
        one = simulate(build_schedule("1f1b", num_stages=S, num_microbatches=M), costs)
        zb = simulate(build_schedule("zb-h1", num_stages=S, num_microbatches=M), costs)
        assert zb.makespan == pytest.approx(one.makespan - (S - 1) * 1.0)  # (S - 1) W passes off the path
        assert zb.peak_memory == pytest.approx(one.peak_memory)


def test_shifted_critical_path_beats_1f1b_full_recompute_within_1f1b_memory() -> None:
    """The issue's target at S=4, M=8, B = 2F, R = F (also checked by the benchmark)."""
    costs = CostModel(forward=1.0, backward=2.0, recompute=1.0, input_bytes=0.05)
    base = simulate(build_schedule("1f1b", num_stages=4, num_microbatches=8), costs)
    full = simulate(build_schedule("1f1b", num_stages=4, num_microbatches=8, recompute="full"), costs)
    scp = simulate(build_schedule("shifted-critical-path", num_stages=4, num_microbatches=8), costs)
    assert scp.makespan <= 0.92 * full.makespan
    assert all(p <= q for p, q in zip(scp.peak_memory, base.peak_memory, strict=True))


def test_stage_aware_recompute_under_half_the_stage0_peak_recomputes_less_than_full() -> None:
    S, M, L = 4, 8, 8
    costs = CostModel(forward=1.0, backward=2.0, recompute=1.0, input_bytes=1.0 / L)
    schedule = build_schedule("1f1b", num_stages=S, num_microbatches=M)
    budget = simulate(schedule, costs).peak_memory[0] / 2
    plan = stage_aware_plan(
        layer_activation_bytes=[[1.0 / L] * L] * S,
        memory_budget=budget,
        schedule=schedule,
        input_bytes=1.0 / L,
    )
    assert plan.total < RecomputePlan.full(S).total
    aware = simulate(build_schedule("1f1b", num_stages=S, num_microbatches=M, recompute=plan), costs)
    full = simulate(build_schedule("1f1b", num_stages=S, num_microbatches=M, recompute="full"), costs)
    assert max(aware.peak_memory) <= budget + 1e-9
    assert aware.makespan < full.makespan


def test_cost_model_checks_its_values() -> None:
    with pytest.raises(ValueError, match="bandwidth"):
        CostModel(p2p_bandwidth=0.0)
    with pytest.raises(ValueError, match="weight_grad_fraction"):
        CostModel(weight_grad_fraction=2.0)
    with pytest.raises(ValueError, match="has 2 values but the schedule has 3 stages"):
        simulate(build_schedule("1f1b", num_stages=3, num_microbatches=2), CostModel(forward=[1.0, 2.0]))
    with pytest.raises(ValueError, match="give backward_weight explicitly"):
        simulate(
            build_schedule("zb-h1", num_stages=2, num_microbatches=2),
            CostModel(backward=1.0, backward_input=2.0),
        )
    assert in_flight_counts(build_schedule("1f1b", num_stages=3, num_microbatches=2)) == [2, 2, 1]
    assert math.isinf(CostModel().p2p_bandwidth)


def test_simulate_refuses_invalid_schedules() -> None:
    from merak_pipe import ScheduleError

    s = build_schedule("gpipe", num_stages=2, num_microbatches=2)
    for acts in s.actions.values():
        acts.reverse()
    with pytest.raises(ScheduleError, match="deadlocks or breaks a dependency"):
        simulate(s)
    s = build_schedule("1f1b", num_stages=2, num_microbatches=2)
    s.actions[1].pop()
    with pytest.raises(ScheduleError, match="has no 1B1"):
        simulate(s)


# ---------------------------------------------------------------------------- per-action cost


def _per_action_makespans(per_action: float) -> dict[str, float]:
    """pp=2, 8 microbatches, the model split in the same total work whatever the stage count."""
    out = {}
    for name, virtual in (("1f1b", 1), ("gpipe", 1), ("interleaved-1f1b", 2), ("zb-v", 2)):
        schedule = build_schedule(name, num_stages=2 * virtual, num_ranks=2, num_microbatches=8)
        costs = CostModel(forward=1.0 / virtual, backward=2.0 / virtual, per_action=per_action)
        out[name] = simulate(schedule, costs).makespan
    return out


def test_per_action_cost_reverses_the_ranking_of_virtual_stages() -> None:
    """Free actions: interleaved 1F1B and ZB-V beat 1F1B (smaller bubble). An expensive runtime: they lose,
    since they run twice the compute actions and messages per step; the prediction follows."""
    free = _per_action_makespans(0.0)
    assert free["interleaved-1f1b"] < free["1f1b"] and free["zb-v"] < free["1f1b"]
    assert free["1f1b"] == pytest.approx(27.0)  # (M + S - 1)(F + B), as without the parameter
    costly = _per_action_makespans(0.2)
    assert costly["interleaved-1f1b"] > costly["1f1b"] and costly["zb-v"] > costly["1f1b"]
    # 1F1B's first rank: 16 compute actions plus 16 messages (8 sends, 8 receives) at 0.2 each.
    assert costly["1f1b"] >= free["1f1b"] + 32 * 0.2 - 1e-9


@pytest.mark.parametrize("name,stages", [("1f1b", 4), ("zb-h1", 4), ("interleaved-1f1b", 8), ("zb-v", 8)])
def test_per_action_cost_counts_messages_alike_lowered_or_not(name: str, stages: int) -> None:
    """A compute-only schedule carries the messages lowering would add: each rank's busy time equals the
    lowered schedule's, which has one SEND/RECV action per message."""
    schedule = build_schedule(name, num_stages=stages, num_ranks=4, num_microbatches=8)
    costs = CostModel(forward=1.0, backward=2.0, per_action=0.125)
    lowered = lower(schedule)
    assert simulate(schedule, costs).busy == pytest.approx(simulate(lowered, costs).busy)
    base = simulate(lowered, CostModel(forward=1.0, backward=2.0))
    counts = [len(lowered.actions[r]) for r in range(4)]
    assert simulate(lowered, costs).busy == pytest.approx(
        [b + 0.125 * n for b, n in zip(base.busy, counts, strict=True)]
    )


@pytest.mark.parametrize("value", [-1e-6, math.inf, math.nan])
def test_per_action_cost_refuses_bad_values(value: float) -> None:
    with pytest.raises(ValueError, match="per_action"):
        CostModel(per_action=value)
