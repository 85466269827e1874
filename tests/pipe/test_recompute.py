"""Recomputation plans: constructors, Merak's closed form, the budget-driven stage-aware solve."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from merak_pipe import RecomputePlan, build_schedule, closed_form_plan, in_flight_counts, stage_aware_plan
from merak_pipe.recompute import as_plan


def test_constructors_and_checks() -> None:
    assert RecomputePlan.none(3).fractions == (0.0, 0.0, 0.0)
    assert RecomputePlan.full(2).fractions == (1.0, 1.0)
    assert RecomputePlan.uniform(2, 0.25)[1] == 0.25
    assert RecomputePlan.from_list([0, 1]).total == 1.0
    with pytest.raises(ValueError, match="stage 1 is 1.5; expected a value in \\[0, 1\\]"):
        RecomputePlan((0.0, 1.5))
    with pytest.raises(ValueError, match="empty"):
        RecomputePlan(())
    with pytest.raises(ValueError, match="num_stages=0"):
        RecomputePlan.full(0)
    assert as_plan(None, 3) is None
    assert as_plan(1, 2) == RecomputePlan.full(2)


@settings(max_examples=50, deadline=None)
@given(S=st.integers(2, 12), r0=st.floats(0.0, 1.0))
def test_stage_aware_reproduces_merak_closed_form(S: int, r0: float) -> None:
    """Uniform layers, no static memory, in-flight S-1-i, budget (1 - r0)(S - 1): the closed form."""
    L = 720
    plan = stage_aware_plan(
        layer_activation_bytes=[[1.0 / L] * L] * S,
        memory_budget=(1 - r0) * (S - 1),
        in_flight=[S - 1 - i for i in range(S)],
        count_recompute_buffer=False,
    )
    closed = closed_form_plan(S, r0)
    assert closed[S - 1] == 0.0 and plan[S - 1] == 0.0
    for i in range(S):
        # The solve rounds up to whole layers: within one layer of the closed form, never below it.
        assert closed[i] - 1e-9 <= plan[i] <= closed[i] + 1.0 / L + 1e-9
        if 0 < closed[i] < 1 and i < S - 1:
            assert (1 - closed[i]) * (S - 1 - i) == pytest.approx((1 - r0) * (S - 1))


@settings(max_examples=50, deadline=None)
@given(
    layers=st.lists(st.floats(0.01, 3.0), min_size=1, max_size=12),
    n=st.integers(1, 8),
    static=st.floats(0.0, 5.0),
    inp=st.floats(0.0, 1.0),
    slack=st.floats(0.0, 40.0),
)
def test_stage_aware_choice_is_the_smallest_that_fits(
    layers: list[float], n: int, static: float, inp: float, slack: float
) -> None:
    L = len(layers)

    def need(k: int) -> float:
        kept = sum(layers[k:]) + (inp if k else 0.0)
        return static + n * kept + sum(layers[:k])

    budget = min(need(k) for k in range(L + 1)) + slack
    plan = stage_aware_plan(
        layer_activation_bytes=[layers],
        memory_budget=budget,
        static_bytes=static,
        in_flight=[n],
        input_bytes=inp,
    )
    k = round(plan[0] * L)
    assert need(k) <= budget * (1 + 1e-12)
    assert all(need(j) > budget for j in range(k))


def test_stage_aware_raises_when_nothing_fits() -> None:
    with pytest.raises(
        ValueError, match="stage 0 does not fit its memory budget even with full recomputation"
    ):
        stage_aware_plan(
            layer_activation_bytes=[[1.0, 1.0], [1.0]], memory_budget=1.0, static_bytes=0.5, in_flight=[3, 1]
        )
    with pytest.raises(ValueError, match="in_flight .* or a schedule"):
        stage_aware_plan(layer_activation_bytes=[[1.0]], memory_budget=1.0)
    with pytest.raises(ValueError, match="one per stage"):
        stage_aware_plan(layer_activation_bytes=[[1.0], [1.0]], memory_budget=[1.0], in_flight=[1, 1])


def test_stage_aware_uses_the_schedule_in_flight_counts() -> None:
    S, L = 4, 10
    one = build_schedule("1f1b", num_stages=S, num_microbatches=8)
    gpipe = build_schedule("gpipe", num_stages=S, num_microbatches=8)
    kw = {"layer_activation_bytes": [[0.1] * L] * S, "memory_budget": 3.0}
    p1 = stage_aware_plan(schedule=one, **kw)  # type: ignore[arg-type]
    pg = stage_aware_plan(schedule=gpipe, **kw)  # type: ignore[arg-type]
    assert in_flight_counts(one) == [4, 3, 2, 1]
    # Later stages hold fewer microbatches under 1F1B, so they recompute less; GPipe holds 8 everywhere.
    assert list(p1.fractions) == sorted(p1.fractions, reverse=True) and p1[S - 1] == 0.0
    assert all(g >= f for g, f in zip(pg.fractions, p1.fractions, strict=True))
    assert pg.total > p1.total


def test_closed_form_edges() -> None:
    assert closed_form_plan(1, 0.7).fractions == (0.0,)
    assert closed_form_plan(4, 1.0).fractions == (1.0, 1.0, 1.0, 0.0)
    assert closed_form_plan(4, 0.0).fractions == (0.0, 0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="first_stage_fraction"):
        closed_form_plan(4, 1.5)


def test_stage_aware_shares_a_device_budget_between_interleaved_stages() -> None:
    from merak_pipe import CostModel, simulate

    P, v, M, L = 2, 2, 8, 8
    S = P * v
    schedule = build_schedule("interleaved-1f1b", num_stages=S, num_microbatches=M, num_ranks=P)
    costs = CostModel(activation_bytes=1.0, input_bytes=1.0 / L)
    base = simulate(schedule, costs)
    budget = base.peak_memory_per_rank[0] / 2
    plan = stage_aware_plan(
        layer_activation_bytes=[[1.0 / L] * L] * S,
        memory_budget=budget,
        schedule=schedule,
        input_bytes=1.0 / L,
    )
    assert 0 < plan.total < S
    with_plan = simulate(
        build_schedule("interleaved-1f1b", num_stages=S, num_microbatches=M, num_ranks=P, recompute=plan),
        costs,
    )
    assert max(with_plan.peak_memory_per_rank) <= budget + 1e-9
    # Checkpointing one layer fewer on any stage would break the (conservative) device bound.
    counts = in_flight_counts(schedule)
    for s in range(S):
        k = round(plan[s] * L)
        if k == 0:
            continue
        device = [t for t in range(S) if schedule.stage_to_rank[t] == schedule.stage_to_rank[s]]

        def need(ks: dict[int, int]) -> float:
            kept = sum(counts[t] * ((L - k) / L + (1.0 / L if k else 0.0)) for t, k in ks.items())
            return kept + max(k / L for k in ks.values())

        ks = {t: round(plan[t] * L) for t in device}
        assert need(ks) <= budget + 1e-9
        ks[s] -= 1
        assert need(ks) > budget - 1e-9
    with pytest.raises(ValueError, match="device 0 \\(stages \\[0, 2\\]\\) does not fit"):
        stage_aware_plan(layer_activation_bytes=[[1.0 / L] * L] * S, memory_budget=0.1, schedule=schedule)
