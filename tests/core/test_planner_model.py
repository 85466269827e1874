"""The planner's cost model terms: predict(), ranks sharing cores, per-step overhead, measured all-reduce table.

Expected values are computed here from the profile and the formulas in the docstrings, not by
calling the planner's internals.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from merak_core.config.layout_choice import LayoutChoice
from merak_core.planner import CommModel, ModelProfile, plan, predict, profile_model

FREE = CommModel(
    p2p_latency_s=0.0, p2p_bandwidth=math.inf, allreduce_latency_s=0.0, allreduce_bandwidth=math.inf
)


def _profile(layers: int = 4, *, fwd: float = 1e-3, opt: float = 0.0, param: float = 4e6) -> ModelProfile:
    return ModelProfile(
        layer_forward_s=[fwd] * layers,
        layer_backward_s=[2 * fwd] * layers,
        layer_activation_bytes=[1e6] * layers,
        layer_param_bytes=[param] * layers,
        boundary_bytes=1e4,
        num_heads=4,
        optimizer_s_per_byte=opt,
    )


def test_predict_equals_the_plans_candidate_for_every_configuration():
    prof = _profile(opt=1e-10)
    comm = CommModel(p2p_latency_s=1e-4, allreduce_latency_s=2e-4, allreduce_bandwidth=1e9)
    for slots in (None, 2):
        for c in plan(
            prof, world_size=4, memory_per_device=1e12, global_batch_size=8, comm=comm, compute_slots=slots
        ):
            again = predict(
                prof,
                LayoutChoice(
                    dp=c.dp,
                    tp=c.tp,
                    pp=c.pp,
                    schedule=c.schedule,
                    num_microbatches=c.num_microbatches,
                    micro_batch_size=c.micro_batch_size,
                    recompute=c.recompute,
                ),
                comm=comm,
                memory_per_device=1e12,
                compute_slots=slots,
            )
            assert again == c


def test_ranks_sharing_cores_slow_every_stage_by_ranks_per_slot():
    prof = _profile()
    kw = dict(dp=4, tp=1, pp=1, schedule="1f1b", num_microbatches=2, micro_batch_size=2)
    alone = predict(prof, LayoutChoice(**kw), comm=FREE)
    # one rank's step: 2 microbatches x 2 samples x (4 layers x 3 ms) = 48 ms
    assert alone.step_time_s == pytest.approx(0.048, rel=1e-12)
    assert (
        predict(prof, LayoutChoice(**kw), comm=FREE, compute_slots=4) == alone
    )  # as many cores as ranks: no slowdown
    assert predict(prof, LayoutChoice(**kw), comm=FREE, compute_slots=8) == alone
    # 4 ranks on 2 cores: every rank computes at half speed
    assert predict(prof, LayoutChoice(**kw), comm=FREE, compute_slots=2).step_time_s == pytest.approx(
        0.096, rel=1e-12
    )
    assert predict(prof, LayoutChoice(**kw), comm=FREE, compute_slots=1.6).step_time_s == pytest.approx(
        0.048 * 4 / 1.6, rel=1e-12
    )


def test_a_pipeline_on_shared_cores_runs_its_critical_path_slower():
    prof = _profile()
    kw = dict(dp=1, tp=1, pp=4, schedule="gpipe", num_microbatches=4, micro_batch_size=1)
    alone = predict(prof, LayoutChoice(**kw), comm=FREE)
    # GPipe, 4 equal stages of 1 ms forward / 2 ms backward, 4 microbatches: (4 + 3) x 3 ms
    assert alone.pipeline_s == pytest.approx(0.021, rel=1e-12)
    shared = predict(prof, LayoutChoice(**kw), comm=FREE, compute_slots=2)
    assert shared.pipeline_s == pytest.approx(0.042, rel=1e-12)
    assert shared.stage_forward_s == pytest.approx((2e-3,) * 4, rel=1e-12)  # what a run would measure


def test_per_step_overhead_is_the_optimizer_and_two_small_all_reduces():
    comm = CommModel(allreduce_by_group={2: [(8.0, 1e-3), (1e6, 3e-3)], 4: [(8.0, 2e-3), (1e6, 6e-3)]})
    prof = _profile(opt=1e-9)
    c = predict(
        prof,
        LayoutChoice(dp=2, tp=1, pp=2, schedule="1f1b", num_microbatches=2, micro_batch_size=1),
        comm=comm,
    )
    stage_params = 2 * 4e6  # two layers per stage
    assert c.overhead_s == pytest.approx(stage_params * 1e-9 + 2 * 2e-3, rel=1e-12)
    # the DP all-reduce of one stage's gradients over 2 ranks, 8e6 bytes: beyond the last point, last slope
    assert c.dp_allreduce_s == pytest.approx(3e-3 + (8e6 - 1e6) * (2e-3 / (1e6 - 8.0)), rel=1e-12)
    z1 = predict(
        prof,
        LayoutChoice(dp=2, tp=1, pp=2, schedule="1f1b", num_microbatches=2, micro_batch_size=1, zero_stage=1),
        comm=comm,
    )
    assert z1.overhead_s == pytest.approx(
        stage_params / 2 * 1e-9 + 2 * 2e-3, rel=1e-12
    )  # ZeRO-1: half the states
    shared = predict(
        prof,
        LayoutChoice(dp=2, tp=1, pp=2, schedule="1f1b", num_microbatches=2, micro_batch_size=1),
        comm=comm,
        compute_slots=2,
    )
    assert shared.overhead_s == pytest.approx(
        stage_params * 1e-9 * 2 + 2 * 2e-3, rel=1e-12
    )  # 4 ranks, 2 cores


def test_measured_all_reduce_table_interpolates():
    m = CommModel(allreduce_by_group={"4": [[1000, 2e-3], [10, 1e-3], [2000, 2e-3]]})  # JSON-style, unsorted
    assert m.allreduce_by_group == {4: [(10.0, 1e-3), (1000.0, 2e-3), (2000.0, 2e-3)]}
    assert m.allreduce_s(1, 4) == 1e-3  # below the smallest size: its time
    assert m.allreduce_s(505, 4) == pytest.approx(1.5e-3)
    assert m.allreduce_s(3000, 4) == pytest.approx(2e-3)  # the last segment is flat
    assert m.allreduce_s(1000, 2) == pytest.approx(2 * 50e-6 + 1000 / 2e9)  # unmeasured size: ring formula
    assert m.allreduce_s(1000, 1) == 0.0
    with pytest.raises(ValueError, match="allreduce_by_group"):
        CommModel(allreduce_by_group={1: [(8, 1e-3)]})
    with pytest.raises(ValueError, match="allreduce_by_group"):
        CommModel(allreduce_by_group={2: [(8, -1.0)]})


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(compute_slots=0), "compute_slots=0"),
        (dict(dp=0), "dp=0"),
        (dict(schedule="interleaved_1f1b"), "interleaved_1f1b"),
        (dict(recompute="uniform"), "uniform"),
        (dict(pp=5), "pp=5"),
    ],
)
def test_predict_rejects_bad_input(kwargs, match):
    args = dict(dp=1, tp=1, pp=2, schedule="1f1b", num_microbatches=2, micro_batch_size=1)
    args.update(kwargs)
    slots = args.pop("compute_slots", None)
    with pytest.raises(ValueError, match=match):
        predict(_profile(), LayoutChoice(**args), compute_slots=slots)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_profiling_leaves_the_random_stream_and_gradients_alone():
    model = _Net()  # dropout draws random numbers in every profiled forward
    torch.manual_seed(5)
    sample = torch.randn(4, 8)
    expected = torch.rand(3)
    torch.manual_seed(5)
    sample = torch.randn(4, 8)
    before = [p.detach().clone() for p in model.parameters()]
    prof = profile_model(model, sample, repeats=1)
    assert torch.equal(torch.rand(3), expected)  # the stream continues as if nothing had been profiled
    assert prof.optimizer_s_per_byte > 0
    assert all(p.grad is None for p in model.parameters())
    assert all(
        torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True)
    )  # the optimizer ran on copies


def _table_body():
    from merak_core.planner import measure_comm

    return measure_comm(repeats=2, large_bytes=1 << 16).allreduce_by_group


def test_measure_comm_times_every_group_size_with_all_groups_at_once():
    from merak_core.planner.comm import ALLREDUCE_SIZES
    from tests.support.dist import run_on_ranks

    tables = run_on_ranks(4, _table_body)
    assert all(t == tables[0] for t in tables)  # every rank holds the slowest rank's times
    table = tables[0]
    assert sorted(table) == [2, 4]
    for points in table.values():
        assert [x for x, _ in points] == [float(x) for x in ALLREDUCE_SIZES]
        times = [t for _, t in points]
        assert all(t > 0 for t in times) and times == sorted(times)


def test_tp_all_reduce_waits_are_not_cpu_work_on_shared_cores():
    comm = CommModel(allreduce_by_group={2: [(8.0, 1e-3)]})  # every TP all-reduce: 1 ms
    prof = _profile()
    kw = dict(dp=1, tp=2, pp=1, schedule="1f1b", num_microbatches=1, micro_batch_size=2)
    alone = predict(prof, LayoutChoice(**kw), comm=comm)
    # per rank: compute 2 samples x 4 layers x 3 ms / tp 2 = 12 ms, plus 2 all-reduces per layer and direction
    assert alone.pipeline_s == pytest.approx(0.012 + 2 * 4 * 2 * 1e-3, rel=1e-12)
    # one core: both ranks' compute (24 ms) runs one after the other, the 16 ms of waits are not doubled
    assert predict(prof, LayoutChoice(**kw), comm=comm, compute_slots=1).pipeline_s == pytest.approx(
        0.024 + 0.016, rel=1e-12
    )


def test_a_measured_wait_per_synchronisation_is_charged_to_every_synchronising_step():
    prof = _profile()
    base = CommModel(allreduce_by_group={2: [(8.0, 1e-3)], 4: [(8.0, 2e-3)]}, p2p_latency_s=1e-4)
    waiting = CommModel(
        allreduce_by_group={2: [(8.0, 1e-3)], 4: [(8.0, 2e-3)]}, p2p_latency_s=1e-4, sync_wait_s=5e-4
    )
    kw = dict(dp=2, tp=2, pp=1, schedule="1f1b", num_microbatches=1, micro_batch_size=2)
    a, b = predict(prof, LayoutChoice(**kw), comm=base), predict(prof, LayoutChoice(**kw), comm=waiting)
    # 4 layers x 2 all-reduces x 2 directions in the pipeline, one DP all-reduce, two per-step all-reduces
    assert b.pipeline_s - a.pipeline_s == pytest.approx(16 * 5e-4, rel=1e-9)
    assert b.dp_allreduce_s - a.dp_allreduce_s == pytest.approx(5e-4, rel=1e-9)
    assert b.overhead_s - a.overhead_s == pytest.approx(2 * 5e-4, rel=1e-9)
    with pytest.raises(ValueError, match="sync_wait_s"):
        CommModel(sync_wait_s=-1.0)


def test_the_fixed_cost_per_microbatch_is_shared_by_the_stages_by_layer_count():
    prof = dataclasses.replace(
        _profile(), microbatch_overhead_s=8e-3
    )  # forward 4 ms + backward 4 ms, whole model
    whole = predict(
        prof,
        LayoutChoice(dp=1, tp=1, pp=1, schedule="1f1b", num_microbatches=1, micro_batch_size=1),
        comm=FREE,
    )
    assert whole.stage_forward_s == pytest.approx(
        (4e-3 + 4e-3,), rel=1e-12
    )  # 4 layers x 1 ms + the whole 4 ms
    split = predict(
        prof,
        LayoutChoice(dp=1, tp=2, pp=2, schedule="1f1b", num_microbatches=2, micro_batch_size=1),
        comm=FREE,
    )
    # two layers per stage: half the fixed cost each, and a TP shard pays it whole (it runs every operator)
    assert split.stage_forward_s == pytest.approx((2e-3 / 2 + 2e-3,) * 2, rel=1e-12)
    assert split.stage_backward_s == pytest.approx((4e-3 / 2 + 2e-3,) * 2, rel=1e-12)


def test_a_measured_tp_scale_multiplies_the_layers_time_at_that_degree_only():
    comm = CommModel(allreduce_by_group={2: [(8.0, 1e-3)], 4: [(8.0, 2e-3)]})
    prof = _profile()
    scaled = dataclasses.replace(prof, tp_scale={"2": 1.5})  # JSON-style key
    assert scaled.tp_scale == {2: 1.5}
    kw = dict(dp=2, pp=2, schedule="1f1b", num_microbatches=2, micro_batch_size=1)
    a, b = (
        predict(prof, LayoutChoice(tp=1, **kw), comm=comm),
        predict(scaled, LayoutChoice(tp=1, **kw), comm=comm),
    )
    assert a == b  # tp=1 is not scaled
    kw = dict(dp=1, pp=2, schedule="1f1b", num_microbatches=2, micro_batch_size=1)
    a, b = (
        predict(prof, LayoutChoice(tp=2, **kw), comm=comm),
        predict(scaled, LayoutChoice(tp=2, **kw), comm=comm),
    )
    assert b.stage_forward_s == pytest.approx(tuple(1.5 * f for f in a.stage_forward_s), rel=1e-12)
    assert b.stage_backward_s == pytest.approx(tuple(1.5 * x for x in a.stage_backward_s), rel=1e-12)
    assert b.overhead_s == a.overhead_s and b.dp_allreduce_s == a.dp_allreduce_s
    for bad in ({0: 2.0}, {2: 0.0}, {2: math.inf}):
        with pytest.raises(ValueError, match="tp_scale"):
            dataclasses.replace(prof, tp_scale=bad)


def test_the_probed_overhead_scale_multiplies_the_time_outside_the_pipeline():
    comm = CommModel(allreduce_by_group={2: [(8.0, 1e-3)], 4: [(8.0, 2e-3)]})
    prof = _profile(opt=1e-9)
    kw = dict(dp=2, tp=1, pp=2, schedule="1f1b", num_microbatches=2, micro_batch_size=1)
    a = predict(prof, LayoutChoice(**kw), comm=comm)
    b = predict(
        dataclasses.replace(prof, overhead_scale=1.7, tp_scale={1: 1.1}), LayoutChoice(**kw), comm=comm
    )
    assert b.overhead_s == pytest.approx(1.7 * a.overhead_s, rel=1e-12)
    assert b.dp_allreduce_s == pytest.approx(1.7 * a.dp_allreduce_s, rel=1e-12)
    assert b.stage_forward_s == pytest.approx(tuple(1.1 * f for f in a.stage_forward_s), rel=1e-12)
    with pytest.raises(ValueError, match="overhead_scale"):
        dataclasses.replace(prof, overhead_scale=0.0)
