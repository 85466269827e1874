"""Dry runs: what every rank would build, in this process (fake process group, meta device)."""

from __future__ import annotations

import pytest
import torch.distributed as dist
import yaml

from merak_core.config.layout_choice import LayoutChoice
from merak_core.parallel.rank_grid import coords_of, rank_of
from merak_core.planner.cluster import ClusterSpec, load_cluster, shipped_clusters
from merak_core.planner.dryrun import dry_run
from merak_core.planner.gpt_shapes import DecoderShape, build_decoder, decoder_inputs

SMALL = DecoderShape(num_layers=4, hidden=64, num_heads=4, vocab_size=128, seq_len=16)


def _cluster(devices_per_node: int = 8, memory_gb: float = 80.0) -> ClusterSpec:
    raw = yaml.safe_load(shipped_clusters()["h100-sxm-8x"].read_text())
    raw["devices_per_node"] = devices_per_node
    raw["inter_node"]["nics_per_node"] = devices_per_node
    raw["device"]["memory_gb"] = memory_gb
    return ClusterSpec.from_dict(raw)


def _run(cluster: ClusterSpec, world_size: int, shape: DecoderShape = SMALL, **kw):
    kw.setdefault("num_heads", shape.num_heads)
    kw.setdefault("vocab_size", shape.vocab_size)
    return dry_run(build_decoder(shape), decoder_inputs(shape), cluster, world_size=world_size, **kw)


def test_every_rank_gets_its_groups_stage_and_schedule():
    report = _run(
        load_cluster("h100-sxm-8x"),
        16,
        tp=2,
        pp=2,
        num_microbatches=4,
        schedule="shifted_critical_path",
        recompute="stage_aware",
    )
    assert report.ok, report.summary()
    assert report.degrees == (4, 2, 2) and report.groups_backend == "torch fake process group"
    assert not dist.is_initialized()  # the fake groups are gone again
    assert [p.rank for p in report.ranks] == list(range(16))
    for p in report.ranks:
        stage, d, t = coords_of(p.rank, dp=4, tp=2)
        assert (p.stage, p.dp_rank, p.tp_rank, p.node) == (stage, d, t, p.rank // 8)
        assert p.dp_group == tuple(rank_of(stage, x, t, dp=4, tp=2) for x in range(4))
        assert p.tp_group == tuple(rank_of(stage, d, x, dp=4, tp=2) for x in range(2))
        assert p.pp_group == tuple(rank_of(x, d, t, dp=4, tp=2) for x in range(2))
        assert p.rank in p.dp_group and p.rank in p.tp_group and p.rank in p.pp_group
        assert p.schedule.split()[0] == f"{stage}F0"  # every stage starts with its first forward
        assert p.memory_bytes == report.prediction.stage_memory_bytes[stage]
    assert report.ranks[-1].recompute_fraction == 0.0  # the last stage never recomputes
    # the tied embedding's gradient group: stage 0 and stage 1 of the same pipeline
    ties = report.ranks[0].shared_groups
    assert ties == {"embed.weight": (0, 8)}
    assert "every rank would build and fit" in report.summary()


def test_a_layout_that_does_not_divide_fails_on_rank_0():
    report = _run(load_cluster("h100-sxm-8x"), 12, tp=8, pp=1)
    first = report.first_failure
    assert first is not None and first.rank == 0 and first.kind == "layout"
    assert "does not divide WORLD_SIZE=12" in first.message
    assert not report.ranks
    heads = _run(load_cluster("h100-sxm-8x"), 24, tp=3, pp=1, num_microbatches=1)
    assert heads.first_failure.kind == "layout" and "tp=3 does not divide the model's heads=4" in str(
        heads.first_failure
    )
    too_deep = _run(load_cluster("h100-sxm-8x"), 64, pp=64, num_microbatches=64)
    assert too_deep.first_failure.kind == "partition" and "num_stages=64" in too_deep.first_failure.message


def test_a_stage_that_does_not_fit_names_the_first_rank_of_that_stage():
    # 2 nodes of 4 devices, pp=2, no recomputation: stage 0 (ranks 0..3) holds 2 microbatches
    # of activations, stage 1 one; a device between the two fails stage 0 only.
    base = _run(_cluster(devices_per_node=4), 8, pp=2, num_microbatches=8, micro_batch_size=64)
    assert base.ok
    s0, s1 = base.prediction.stage_memory_bytes
    assert s0 > s1
    mid = (s0 + s1) / 2 / 0.9 / 1e9
    report = _run(
        _cluster(devices_per_node=4, memory_gb=mid), 8, pp=2, num_microbatches=8, micro_batch_size=64
    )
    first = report.first_failure
    assert first is not None and (first.rank, first.stage, first.kind) == (0, 0, "memory")
    assert "stage 0 needs" in first.message and "raise pp or tp" in first.message
    # stage 1's ranks fit: only one memory problem is reported
    assert [p.kind for p in report.problems if p.fatal] == ["memory"]
    # when every stage fails, the first failure is rank 0 and it is the only memory problem
    flipped = _run(
        _cluster(devices_per_node=4, memory_gb=s1 * 0.99 / 0.9 / 1e9),
        8,
        dp=4,
        pp=2,
        num_microbatches=8,
        micro_batch_size=64,
    )
    assert flipped.first_failure.rank == 0 and [p.kind for p in flipped.problems if p.fatal] == ["memory"]


def test_a_tied_parameter_across_nodes_is_reported():
    # 4 devices per node, 8 ranks, pp=2: stage 0 on node 0, stage 1 (the tied head) on node 1.
    report = _run(_cluster(devices_per_node=4), 8, pp=2, num_microbatches=2)
    assert report.ok  # it works, but costs a network all-reduce every step
    ties = [p for p in report.problems if p.kind == "shared-parameter"]
    assert len(ties) == 1 and not ties[0].fatal
    assert "'embed.weight' is tied across stages [0, 1] on nodes [0, 1]" in ties[0].message
    assert report.ranks[0].shared_groups == {"embed.weight": (0, 4)}
    # inside one node: no report
    inside = _run(_cluster(devices_per_node=8), 8, pp=2, num_microbatches=2)
    assert not [p for p in inside.problems if p.kind == "shared-parameter"]


def test_too_few_microbatches_are_refused():
    report = _run(load_cluster("h100-sxm-8x"), 8, pp=4, num_microbatches=2)
    assert (
        report.first_failure.kind == "schedule"
        and "num_microbatches=2 < pp=4" in report.first_failure.message
    )


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_dry_run_prediction_matches_the_planner(recompute):
    from merak_core.planner.cluster_cost import model_costs, trace_for_cluster
    from merak_core.planner.cluster_search import predict_config

    cluster = load_cluster("a100-80gb-8x")
    report = _run(cluster, 16, tp=2, pp=2, num_microbatches=4, recompute=recompute)
    model = build_decoder(SMALL)
    costs = model_costs(trace_for_cluster(model, decoder_inputs(SMALL), cluster), model)
    ref = predict_config(
        costs,
        cluster,
        LayoutChoice(
            dp=4, tp=2, pp=2, schedule="1f1b", num_microbatches=4, micro_batch_size=1, recompute=recompute
        ),
        stage_layers=report.prediction.stage_layers,
    )
    assert report.prediction.step_time_s == pytest.approx(ref.step_time_s, rel=1e-12)
    assert report.prediction.stage_memory_bytes == pytest.approx(ref.stage_memory_bytes, rel=1e-12)


def test_large_dry_runs_build_a_sample_of_ranks_through_the_fake_group_and_compute_the_rest():
    report = _run(load_cluster("h100-sxm-8x"), 128, tp=4, pp=2, num_microbatches=2, fake_pg_ranks=16)
    # ranks 0..7, the first and last rank of both stages (0, 63, 64, 127)
    assert report.ok and "for 11 sampled ranks" in report.groups_backend
    assert len(report.ranks) == 128
    for p in report.ranks:
        stage, d, t = coords_of(p.rank, dp=16, tp=4)
        assert p.dp_group == tuple(rank_of(stage, x, t, dp=16, tp=4) for x in range(16))
        assert p.pp_group == tuple(rank_of(x, d, t, dp=16, tp=4) for x in range(2))


def test_an_interleaved_schedule_is_refused_as_the_trainer_would():
    report = _run(load_cluster("h100-sxm-8x"), 8, pp=2, num_microbatches=4, schedule="interleaved_1f1b")
    assert report.first_failure.kind == "schedule" and "one stage per rank" in report.first_failure.message
