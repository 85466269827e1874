"""The planner's search on synthetic profiles (no processes): memory, errors, ties, obvious choices, sums.

Expected values are computed here from the profile independently of the planner (sums of the
per-layer costs, the static memory formula, the activation peak of one stage).
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from merak_core.planner import (
    Candidate,
    CommModel,
    ModelProfile,
    format_plan,
    plan,
    profile_model,
    split_layers,
)
from merak_core.planner.memory import usable_memory

FREE = CommModel(
    p2p_latency_s=0.0, p2p_bandwidth=math.inf, allreduce_latency_s=0.0, allreduce_bandwidth=math.inf
)


def _profile(
    layers: int = 8,
    *,
    heads: int | None = 4,
    fwd: float = 1e-3,
    act: float = 1e6,
    param: float = 4e6,
    boundary: float = 1e4,
) -> ModelProfile:
    return ModelProfile(
        layer_forward_s=[fwd] * layers,
        layer_backward_s=[2 * fwd] * layers,
        layer_activation_bytes=[act] * layers,
        layer_param_bytes=[param] * layers,
        boundary_bytes=boundary,
        num_heads=heads,
        vocab_size=16,
    )


def test_every_candidate_fits_and_tighter_memory_keeps_a_subset():
    prof = _profile()
    big = plan(prof, world_size=4, memory_per_device=1e9, global_batch_size=16)
    assert all(max(c.peak_memory_bytes) <= 1e9 for c in big)
    peaks = sorted(max(c.peak_memory_bytes) for c in big)
    limit = peaks[len(peaks) // 2]
    small = plan(prof, world_size=4, memory_per_device=limit, global_batch_size=16)
    assert all(max(c.peak_memory_bytes) <= limit for c in small)
    assert 0 < len(small) < len(big)
    key = lambda c: (c.layout, c.schedule, c.num_microbatches, c.recompute_fractions)  # noqa: E731
    big_keys = {key(c) for c in big}
    # a stage-aware plan depends on the budget; every other candidate under the small limit is one of the big ones
    assert all(key(c) in big_keys for c in small if c.recompute != "stage_aware")
    # kept below the limit less the planner's margin ([Note: memory margin] in planner.memory)
    kept = usable_memory(limit)
    assert all(max(c.peak_memory_bytes) <= kept for c in small)
    assert {key(c) for c in big if max(c.peak_memory_bytes) <= kept and c.recompute != "stage_aware"} <= {
        key(c) for c in small
    }


def test_single_stage_memory_and_time_equal_the_sums():
    prof = ModelProfile(
        layer_forward_s=[1e-3, 2e-3, 3e-3],
        layer_backward_s=[2e-3, 5e-3, 1e-3],
        layer_activation_bytes=[10.0, 20.0, 30.0],
        layer_param_bytes=[100.0, 0.0, 50.0],
        boundary_bytes=7.0,
        microbatch_overhead_s=4e-4,
    )
    cands = plan(prof, world_size=1, memory_per_device=1e6, global_batch_size=6, comm=FREE)
    assert {(c.dp, c.tp, c.pp) for c in cands} == {(1, 1, 1)}
    assert sorted(c.num_microbatches for c in cands if c.recompute == "none") == [1, 2, 3, 6]
    for c in cands:
        b = c.micro_batch_size
        assert c.micro_batch_size * c.num_microbatches == 6
        m = c.num_microbatches
        extra = (
            m * (2e-4 + b * 6e-3) if c.recompute == "full" else 0.0
        )  # recompute = the forward, overhead too
        assert c.step_time_s == pytest.approx(6 * (6e-3 + 8e-3) + m * 4e-4 + extra, rel=1e-12)
        static = 150.0 * (2 + 2)
        act = b * 60.0 + (b * 7.0 if c.recompute == "full" else 0.0)
        assert c.peak_memory_bytes == pytest.approx((static + act,), rel=1e-12)


def test_zero_stage_one_divides_optimizer_states_by_dp():
    prof = _profile(layers=2)
    kw = dict(
        world_size=2,
        memory_per_device=1e12,
        global_batch_size=4,
        schedules=("1f1b",),
        recompute_modes=("none",),
    )
    z0 = {(c.layout, c.num_microbatches): c for c in plan(prof, **kw)}
    z1 = {(c.layout, c.num_microbatches): c for c in plan(prof, zero_stage=1, **kw)}
    c0, c1 = z0[("dp2-tp1-pp1", 1)], z1[("dp2-tp1-pp1", 1)]
    opt = 2 * 2 * 4e6  # optimizer-state bytes of both layers (factor 2)
    assert c0.peak_memory_bytes[0] - c1.peak_memory_bytes[0] == pytest.approx(opt - opt / 2)


def test_nothing_fits_names_the_least_memory_needed_and_that_memory_suffices():
    prof = _profile()
    with pytest.raises(ValueError, match="smallest configuration needs") as info:
        plan(prof, world_size=4, memory_per_device=1e3, global_batch_size=16)
    needed = float(str(info.value).split("needs ")[1].split(" bytes")[0])
    assert needed > 1e3
    cands = plan(prof, world_size=4, memory_per_device=needed * (1 + 1e-5), global_batch_size=16)
    # the message counts the planner's margin: the smallest peak uses what it leaves
    assert min(max(c.peak_memory_bytes) for c in cands) == pytest.approx(usable_memory(needed), rel=1e-5)
    with pytest.raises(ValueError, match="smallest configuration needs"):
        plan(prof, world_size=4, memory_per_device=needed * (1 - 1e-4), global_batch_size=16)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(world_size=0), "world_size=0"),
        (dict(global_batch_size=0), "global_batch_size=0"),
        (dict(memory_per_device=-1.0), "memory_per_device"),
        (dict(zero_stage=4), "zero_stage=4"),
        (dict(schedules=("interleaved_1f1b",)), "interleaved_1f1b"),
        (dict(recompute_modes=("uniform",)), "uniform"),
    ],
)
def test_invalid_inputs_raise(kwargs, match):
    args = dict(world_size=2, memory_per_device=1e9, global_batch_size=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        plan(_profile(), **args)


def test_no_layout_suits_the_model():
    # 3 heads, 1 layer, world 2: tp=2 does not divide heads, pp=2 > layers, dp=2 does not divide batch 3
    with pytest.raises(ValueError, match="no \\(dp, tp, pp\\)"):
        plan(_profile(layers=1, heads=3), world_size=2, memory_per_device=1e9, global_batch_size=3)


def test_profile_validation():
    with pytest.raises(ValueError, match="layer_backward_s has 1 values"):
        ModelProfile(
            layer_forward_s=[1.0, 1.0],
            layer_backward_s=[1.0],
            layer_activation_bytes=[1.0, 1.0],
            layer_param_bytes=[1.0, 1.0],
        )
    with pytest.raises(ValueError, match="num_heads=0"):
        _profile(heads=0)
    with pytest.raises(ValueError, match="allreduce_bandwidth"):
        CommModel(allreduce_bandwidth=0.0)


def test_ties_are_broken_by_fewer_tp_ranks_then_layout_and_are_deterministic():
    prof = _profile(heads=4)
    cands = plan(prof, world_size=4, memory_per_device=1e12, global_batch_size=8, comm=FREE)
    again = plan(prof, world_size=4, memory_per_device=1e12, global_batch_size=8, comm=FREE)
    assert cands == again
    # with free communication and linear costs, dp4 (m=2) and dp2-tp2 (m=4) and dp1-tp4 (m=8) all take
    # 8 samples * 8 layers * 3 ms / 4 ranks = 48 ms with one stage: the fewest TP ranks comes first
    one_stage = [c for c in cands if c.pp == 1 and c.micro_batch_size == 1 and c.recompute == "none"]
    assert {c.layout for c in one_stage} == {"dp4-tp1-pp1", "dp2-tp2-pp1", "dp1-tp4-pp1"}
    assert all(c.step_time_s == pytest.approx(8 * 8 * 3e-3 / 4, rel=1e-12) for c in one_stage)
    positions = [cands.index(c) for c in one_stage]
    assert [cands[i].tp for i in sorted(positions)] == [1, 2, 4]
    for a, b in itertools.pairwise(cands):
        ta, tb = float(f"{a.step_time_s:.9g}"), float(f"{b.step_time_s:.9g}")
        assert ta < tb or (ta == tb and (a.tp, a.layout) <= (b.tp, b.layout))


def test_at_least_one_microbatch_per_stage():
    cands = plan(_profile(), world_size=4, memory_per_device=1e12, global_batch_size=8)
    assert all(c.num_microbatches >= c.pp for c in cands)
    assert any(c.pp == 4 for c in cands) and any(c.num_microbatches == 1 for c in cands)


def test_one_head_forces_tp_one():
    cands = plan(_profile(heads=1), world_size=4, memory_per_device=1e12, global_batch_size=8)
    assert cands and all(c.tp == 1 for c in cands)
    assert {c.pp for c in cands} == {1, 2, 4}


def test_expensive_p2p_and_plenty_of_memory_choose_one_stage():
    comm = CommModel(p2p_latency_s=1.0, p2p_bandwidth=1e3, allreduce_latency_s=1e-6, allreduce_bandwidth=1e12)
    cands = plan(_profile(heads=1), world_size=4, memory_per_device=1e12, global_batch_size=8, comm=comm)
    assert cands[0].pp == 1 and cands[0].layout == "dp4-tp1-pp1"


def test_scarce_memory_chooses_pipeline_or_recompute():
    # parameters too big for one device: only pp splits them
    prof = _profile(layers=4, heads=1, param=1e8, act=1e3)
    cands = plan(prof, world_size=4, memory_per_device=9e8, global_batch_size=4)
    assert all(c.pp >= 2 for c in cands)
    # activations too big without recomputation: only plans that recompute fit (with one stage a single
    # microbatch is in flight, so recomputation cannot lower its peak; with two stages it can)
    prof = _profile(layers=4, heads=1, param=1.0, act=1e6, boundary=1e3)
    free = plan(prof, world_size=2, memory_per_device=1e12, global_batch_size=8)
    none_peak = min(max(c.peak_memory_bytes) for c in free if c.recompute == "none")
    tight = plan(prof, world_size=2, memory_per_device=none_peak * 0.9, global_batch_size=8)
    assert tight and all(c.recompute != "none" and c.pp == 2 for c in tight)
    assert all(max(c.peak_memory_bytes) <= none_peak * 0.9 for c in tight)


def test_stage_aware_fractions_are_reported_and_fit():
    prof = _profile(layers=8, heads=1, param=1e3, act=1e6, boundary=1e3)
    free = plan(prof, world_size=4, memory_per_device=1e12, global_batch_size=16, schedules=("1f1b",))
    none4 = min(max(c.peak_memory_bytes) for c in free if c.recompute == "none" and c.pp == 4)
    tight = plan(prof, world_size=4, memory_per_device=none4 * 0.8, global_batch_size=16, schedules=("1f1b",))
    sa = [c for c in tight if c.recompute == "stage_aware"]
    assert sa
    for c in sa:
        assert len(c.recompute_fractions) == c.pp and max(c.peak_memory_bytes) <= none4 * 0.8
        assert c.training_fields()["memory_budget"] == int(usable_memory(none4 * 0.8))
        assert 0 < sum(c.recompute_fractions) < c.pp


def test_split_layers_matches_brute_force():
    costs = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    for k in range(1, len(costs) + 1):
        sizes = split_layers(costs, k)
        assert len(sizes) == k and sum(sizes) == len(costs) and min(sizes) >= 1
        best = math.inf
        for cuts in itertools.combinations(range(1, len(costs)), k - 1):
            bounds = [0, *cuts, len(costs)]
            best = min(best, max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds)))
        bounds = [sum(sizes[:i]) for i in range(k + 1)]
        assert max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds)) == best


def test_format_plan_and_training_fields():
    cands = plan(_profile(), world_size=2, memory_per_device=1e9, global_batch_size=4)
    text = format_plan(cands, top=3)
    assert cands[0].layout in text and text.splitlines()[-1].startswith("why: ")
    assert len(text.splitlines()) == 5
    f = cands[0].training_fields()
    assert f["dp"] * f["tp"] * f["pp"] == 2
    assert f["per_device_train_batch_size"] * f["gradient_accumulation_steps"] * f["dp"] == 4
    assert isinstance(cands[0], Candidate)


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class _Tiny(nn.Module):
    num_heads = 2

    def __init__(self, width: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, width)
        self.layers = nn.ModuleList(_Block(width) for _ in range(depth))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return x


def test_profile_model_measures_and_caches(tmp_path: Path):
    torch.manual_seed(0)
    model = _Tiny()
    sample = torch.randint(0, 10, (4, 5))
    prof = profile_model(model, sample, cache_dir=tmp_path, repeats=1)
    assert prof.num_layers == 3 and prof.num_heads == 2 and prof.vocab_size == 10
    # each block saves its Linear input (5*8 float32) and the tanh output (5*8) per sample; a block's
    # input is the previous block's saved tanh output (one storage, counted there), and the last layer
    # also carries one output-sized tensor for the loss
    assert prof.layer_activation_bytes[1:] == [5 * 8 * 4.0, 2 * 5 * 8 * 4.0]
    assert prof.layer_param_bytes[1:] == [(8 * 8 + 8) * 4.0] * 2
    assert prof.layer_param_bytes[0] == (8 * 8 + 8 + 10 * 8) * 4.0
    assert prof.boundary_bytes == 5 * 8 * 4.0
    assert all(t > 0 for t in prof.layer_forward_s + prof.layer_backward_s)
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and prof.fingerprint in files[0].name
    assert profile_model(model, sample, cache_dir=tmp_path) == prof  # read from the cache
    assert ModelProfile.from_json(prof.to_json()) == prof


def test_merak_plan_command_prints_a_table_and_writes_a_valid_job(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    from merak_core.cli import main
    from merak_core.job import JobConfig

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "planned.yaml"
    rc = main(
        [
            "plan",
            str(root / "examples/addition/config.yaml"),
            "data.kwargs.train_size=64",
            "--world-size",
            "4",
            "--memory-per-device",
            "1GiB",
            "--top",
            "3",
            "--write-config",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0
    lines = text.splitlines()
    assert lines[0].startswith("memory per device: 1073741824 bytes") and "--memory-per-device" in lines[0]
    assert lines[1].startswith("pipeline runtime: split backward (I + W) / B = ")  # measured: no flag given
    lines = lines[2:]  # the table follows the lines naming the memory and the runtime's costs
    assert "feasible configurations for 4 ranks" in lines[0] and lines[-2].startswith("why: ")
    assert len([ln for ln in lines[1:] if ln[:3].strip().isdigit()]) == 3
    job = JobConfig.from_yaml(out)
    t = job.training
    assert t.dp * t.tp * t.pp == 4
    assert t.per_device_train_batch_size * t.gradient_accumulation_steps * t.dp == 16 * 2 * 2
    assert f"dp{t.dp}-tp{t.tp}-pp{t.pp}" in lines[2]  # the first ranked row is what was written
    rc = main(
        [
            "plan",
            str(root / "examples/addition/config.yaml"),
            "--world-size",
            "4",
            "--memory-per-device",
            "1KiB",
        ]
    )
    assert rc == 2 and "smallest configuration needs" in capsys.readouterr().err


def _measure_body():
    from merak_core.planner import measure_comm

    return measure_comm(repeats=2, large_bytes=1 << 18)


def test_measure_comm_with_gloo_gives_one_positive_model_on_every_rank():
    from tests.support.dist import run_on_ranks

    models = run_on_ranks(2, _measure_body)
    assert models[0] == models[1]
    m = models[0]
    assert m.p2p_latency_s >= 0 and m.allreduce_latency_s >= 0
    assert m.p2p_bandwidth > 0 and m.allreduce_bandwidth > 0
    # the fitted model reproduces a positive time that grows with the bytes
    assert 0 < m.allreduce_s(1 << 10, 2) <= m.allreduce_s(1 << 18, 2)


def test_allreduce_ring_formula():
    m = CommModel(allreduce_latency_s=1e-3, allreduce_bandwidth=1e6)
    assert m.allreduce_s(1e6, 1) == 0.0
    assert m.allreduce_s(1e6, 4) == pytest.approx(6 * 1e-3 + 1.5)
