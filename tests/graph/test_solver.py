"""The cost partitioner reaches the optimal contiguous partition (checked by brute force)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from merak_graph import PartitionError, optimal_contiguous_partition, uniform_partition


def _brute_force(costs, num_stages, pm=None, am=None, flight=None, limit=None):  # type: ignore[no-untyped-def]
    n = len(costs)
    pm = pm or [0.0] * n
    am = am or [0.0] * n
    flight = flight or [1.0] * num_stages
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), num_stages - 1):
        bounds = [0, *cuts, n]
        ok = True
        worst = 0.0
        for s in range(num_stages):
            lo, hi = bounds[s], bounds[s + 1]
            if limit is not None and sum(pm[lo:hi]) + flight[s] * sum(am[lo:hi]) > limit:
                ok = False
                break
            worst = max(worst, sum(costs[lo:hi]))
        if ok:
            best = min(best, worst)
    return best


def _slowest(costs, bounds):  # type: ignore[no-untyped-def]
    return max(sum(costs[bounds[i] : bounds[i + 1]]) for i in range(len(bounds) - 1))


@settings(max_examples=150, deadline=None)
@given(
    costs=st.lists(st.integers(min_value=0, max_value=50).map(float), min_size=1, max_size=9),
    num_stages=st.integers(min_value=1, max_value=5),
)
def test_matches_brute_force(costs: list[float], num_stages: int) -> None:
    if len(costs) < num_stages:
        with pytest.raises(PartitionError, match="shards"):
            optimal_contiguous_partition(costs, num_stages)
        return
    bounds = optimal_contiguous_partition(costs, num_stages)
    assert bounds[0] == 0 and bounds[-1] == len(costs) and len(bounds) == num_stages + 1
    assert all(bounds[i] < bounds[i + 1] for i in range(num_stages)), "every stage is non-empty"
    assert _slowest(costs, bounds) == _brute_force(costs, num_stages)


@settings(max_examples=150, deadline=None)
@given(
    data=st.lists(
        st.tuples(st.integers(1, 20), st.integers(0, 10), st.integers(0, 5)), min_size=2, max_size=8
    ),
    num_stages=st.integers(min_value=2, max_value=4),
    limit=st.integers(min_value=5, max_value=60),
    one_f_one_b=st.booleans(),
)
def test_memory_limit_and_in_flight_match_brute_force(data, num_stages, limit, one_f_one_b) -> None:  # type: ignore[no-untyped-def]
    costs = [float(c) for c, _, _ in data]
    pm = [float(p) for _, p, _ in data]
    am = [float(a) for _, _, a in data]
    if len(costs) < num_stages:
        return
    flight = [float(num_stages - i) for i in range(num_stages)] if one_f_one_b else None
    expected = _brute_force(costs, num_stages, pm, am, flight, limit)
    if expected == float("inf"):
        with pytest.raises(PartitionError, match="memory_limit"):
            optimal_contiguous_partition(
                costs, num_stages, param_memory=pm, activation_memory=am, in_flight=flight, memory_limit=limit
            )
        return
    bounds = optimal_contiguous_partition(
        costs, num_stages, param_memory=pm, activation_memory=am, in_flight=flight, memory_limit=limit
    )
    assert _slowest(costs, bounds) == expected
    f = flight or [1.0] * num_stages
    for s in range(num_stages):
        lo, hi = bounds[s], bounds[s + 1]
        assert sum(pm[lo:hi]) + f[s] * sum(am[lo:hi]) <= limit


def test_in_flight_moves_activation_heavy_shards_later() -> None:
    # Equal costs; under 1F1B stage 0 holds 2 microbatches, so the heavy-activation shard must go last.
    costs = [1.0, 1.0, 1.0, 1.0]
    am = [0.0, 0.0, 0.0, 10.0]
    bounds = optimal_contiguous_partition(
        costs, 2, activation_memory=am, in_flight=[2.0, 1.0], memory_limit=10.0
    )
    assert bounds[1] <= 3


def test_uniform_partition_counts() -> None:
    assert uniform_partition(10, 4) == [0, 3, 6, 8, 10]
    with pytest.raises(PartitionError, match="at most 3 stages"):
        uniform_partition(3, 4)


@settings(max_examples=100, deadline=None)
@given(
    data=st.lists(st.tuples(st.integers(1, 20), st.integers(1, 30)), min_size=2, max_size=8),
    num_stages=st.integers(min_value=2, max_value=4),
    slack=st.sampled_from([0.0, 0.1, 0.5]),
)
def test_smallest_boundary_among_optimal_matches_brute_force(data, num_stages, slack) -> None:  # type: ignore[no-untyped-def]
    from merak_graph.solver import smallest_boundary_partition

    costs = [float(c) for c, _ in data]
    cut = [float(b) for _, b in data]
    if len(costs) < num_stages:
        return
    opt = _brute_force(costs, num_stages)
    limit = opt * (1 + slack)
    best = None
    for cuts in itertools.combinations(range(1, len(costs)), num_stages - 1):
        bounds = [0, *cuts, len(costs)]
        if _slowest(costs, bounds) <= limit:
            key = (max(cut[c - 1] for c in cuts), sum(cut[c - 1] for c in cuts))
            best = key if best is None or key < best else best
    bounds = smallest_boundary_partition(costs, num_stages, cut, limit)
    assert bounds is not None and _slowest(costs, bounds) <= limit
    inner = bounds[1:-1]
    assert (max(cut[c - 1] for c in inner), sum(cut[c - 1] for c in inner)) == best


def test_partition_level_in_flight_and_tolerance() -> None:
    """1F1B in-flight counts raise early stages' memory; a tolerance trades balance for boundary size."""
    from merak_graph import partition
    from tests.support.models import REFERENCE_MODELS, build_reference

    model = build_reference("gpt")
    spec = REFERENCE_MODELS["gpt"]
    x = spec.make_inputs(2, 8, 0)
    plain = partition(model, 4, example_inputs=x, input_names=spec.input_names)
    flight = partition(model, 4, example_inputs=x, input_names=spec.input_names, in_flight="1f1b")
    for p_info, f_info, in_flight in zip(plain.stage_info, flight.stage_info, [4, 3, 2, 1], strict=True):
        assert f_info.memory_bytes == f_info.param_bytes * 4.0 + in_flight * f_info.activation_bytes
        assert p_info.memory_bytes == p_info.param_bytes * 4.0 + p_info.activation_bytes
    loose = partition(model, 4, example_inputs=x, input_names=spec.input_names, balance_tolerance=0.5)
    assert max(loose.stage_costs) <= 1.5 * max(plain.stage_costs) * (1 + 1e-9)
    cut = [sum(b.nbytes for b in c) for c in loose.boundaries]
    assert max(cut) <= max(sum(b.nbytes for b in c) for c in plain.boundaries)
    with pytest.raises(ValueError, match="in_flight"):
        partition(model, 4, example_inputs=x, input_names=spec.input_names, in_flight="gpipe")
