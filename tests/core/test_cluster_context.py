"""Context parallelism on the cluster model and in the dry run (merak_core.planner.cluster_context).

Pure, single process, meta device: the cluster's cp terms are the profiled planner's
(merak_core.planner.context_cost) applied to one cp rank's share of the traced costs, over the cp
group's link; the dry run's groups are those ParallelLayout builds at cp=2.
"""

from __future__ import annotations

import dataclasses

import pytest

from merak_core.config.layout_choice import LayoutChoice
from merak_core.planner.cluster import load_cluster
from merak_core.planner.cluster_context import attach_attentions, attention_view, cp_stage_costs, local_costs
from merak_core.planner.cluster_cost import model_costs, stage_costs, state_bytes, trace_for_cluster
from merak_core.planner.cluster_search import plan_cluster, predict_config
from merak_core.planner.comm import CommModel
from merak_core.planner.context_cost import cp_attention_extra_bytes, cp_layer_comm_s, cp_local_profile
from merak_core.planner.gpt_shapes import DecoderShape, build_decoder, decoder_inputs
from merak_core.planner.model_profile import ModelProfile

SHAPE = DecoderShape(num_layers=4, hidden=64, num_heads=4, num_kv_heads=2, vocab_size=128, seq_len=32)


def _costs(shape: DecoderShape = SHAPE, cluster_name: str = "h100-sxm-8x"):
    model = build_decoder(shape)
    sharded = trace_for_cluster(model, decoder_inputs(shape), load_cluster(cluster_name))
    costs = model_costs(
        sharded, model, num_heads=shape.num_heads, num_kv_heads=shape.kv_heads, vocab_size=shape.vocab_size
    )
    return attach_attentions(costs, model), model


@pytest.fixture(scope="module")
def costs():
    return _costs()[0]


def _view(costs) -> ModelProfile:
    """What context_cost reads of a profile: the residual stream's bytes per sample and the heads."""
    view = attention_view(costs)
    assert (view.boundary_bytes, view.num_heads, view.num_kv_heads) == (
        costs.tp_message_bytes,
        costs.num_heads,
        costs.num_kv_heads,
    )
    return view


def test_every_block_has_one_attention(costs) -> None:
    assert sum(costs._cache["cp_attentions"]) == SHAPE.num_layers
    with pytest.raises(ValueError, match="attach_attentions"):
        local_costs(dataclasses.replace(costs, _cache={}), 2, "ring")


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_a_cp_rank_holds_its_share_plus_the_attention_bytes(costs, mode: str) -> None:
    local = local_costs(costs, 2, mode)
    extra = cp_attention_extra_bytes(_view(costs), 2, mode)
    if mode == "ring":  # its float32 log-sum-exp: one value per local token and head
        extra += SHAPE.seq_len / 2 * SHAPE.num_heads * 4
    counts = costs._cache["cp_attentions"]
    for ly, lo, n in zip(costs.layers, local.layers, counts, strict=True):
        assert lo.forward_s == ly.forward_s / 2 and lo.flops == ly.flops / 2
        assert lo.activation_bytes == ly.activation_bytes / 2 + n * extra
        assert lo.output_bytes == ly.output_bytes / 2
    assert local.tp_message_bytes == costs.tp_message_bytes / 2
    assert local_costs(costs, 1, mode) is costs


@pytest.mark.parametrize(("mode", "devices_per_node"), [("ring", 8), ("ulysses", 8), ("ring", 2)])
def test_the_cp_exchanges_are_context_costs_over_the_cp_groups_link(
    costs, mode: str, devices_per_node: int
) -> None:
    cluster = load_cluster("h100-sxm-8x")
    cluster = dataclasses.replace(cluster, devices_per_node=devices_per_node)
    dp, tp, cp, b = 2, 2, 2, 3
    bounds = [0, 3, costs.num_layers]
    got = cp_stage_costs(
        costs, cluster, bounds=bounds, dp=dp, tp=tp, cp=cp, cp_mode=mode, micro_batch_size=b, num_ranks=2
    )
    local = local_costs(costs, cp, mode)
    base = stage_costs(local, cluster, bounds=bounds, dp=dp * cp, tp=tp, micro_batch_size=b, num_ranks=2)
    bandwidth, latency = cluster.link([0, tp])  # cp ranks 0 and tp: within a node unless it holds 2
    comm = CommModel(p2p_latency_s=latency, p2p_bandwidth=bandwidth)
    view = cp_local_profile(_view(costs), cp, mode)
    if mode == "ring":  # a bf16 model's ring passes its key/value blocks in float32: twice the model's bytes
        assert costs.precision.weight_bytes == 2
        view = dataclasses.replace(view, boundary_bytes=view.boundary_bytes * 2)
    counts = costs._cache["cp_attentions"]
    for s in range(2):
        f = g = 0.0
        for i in range(bounds[s], bounds[s + 1]):
            one = cp_layer_comm_s(
                view,
                comm,
                cp=cp,
                cp_mode=mode,
                micro_batch_size=b,
                layer_forward_s=b * local.layers[i].forward_s / tp,
                layer_backward_s=2 * b * local.layers[i].forward_s / tp,  # the cluster's backward: 2x forward
                tp=tp,
            )
            f += counts[i] * one[0]
            g += counts[i] * one[1]
        assert got.forward_s[s] == pytest.approx(base.forward_s[s] + f, rel=1e-12)
        assert got.backward_s[s] == pytest.approx(base.backward_s[s] + g, rel=1e-12)
        assert g > 0
    assert got.activation_bytes == base.activation_bytes and got.static_bytes == base.static_bytes


def test_cp_group_across_nodes_costs_more() -> None:
    costs, _ = _costs()
    on_node = load_cluster("h100-sxm-8x")
    split = dataclasses.replace(on_node, devices_per_node=2)
    kw = dict(bounds=[0, costs.num_layers], dp=1, tp=2, cp=2, cp_mode="ring", micro_batch_size=1)
    near, far = cp_stage_costs(costs, on_node, **kw), cp_stage_costs(costs, split, **kw)
    assert far.backward_s[0] > near.backward_s[0]


def test_zero1_shards_the_optimizer_over_dp_zero2_over_dp_x_cp(costs) -> None:
    cluster = load_cluster("h100-sxm-8x")
    kw = dict(bounds=[0, costs.num_layers], dp=2, tp=1, cp=2, cp_mode="ring", micro_batch_size=1)
    one = cp_stage_costs(costs, cluster, zero_stage=1, **kw)
    n = one.params_per_device[0]
    assert one.static_bytes[0] == state_bytes(n, costs.precision, zero_stage=1, dp=2, trainable_numel=n)
    two = cp_stage_costs(costs, cluster, zero_stage=2, **kw)
    local = local_costs(costs, 2, "ring")
    ref = stage_costs(local, cluster, bounds=kw["bounds"], dp=4, tp=1, micro_batch_size=1, zero_stage=2)
    assert two.static_bytes == ref.static_bytes


def test_predict_config_at_cp_sums_gradients_over_dp_x_cp(costs) -> None:
    cluster = load_cluster("h100-sxm-8x")
    base = dict(tp=1, pp=1, schedule="1f1b", num_microbatches=1, micro_batch_size=1)
    at_cp = predict_config(costs, cluster, LayoutChoice(dp=2, cp=2, **base))
    at_dp = predict_config(costs, cluster, LayoutChoice(dp=4, **base))
    assert at_cp is not None and at_dp is not None
    assert at_cp.dp_allreduce_s == pytest.approx(at_dp.dp_allreduce_s, rel=1e-12)  # both over 4 ranks
    assert at_cp.layout == "dp2-cp2-tp1-pp1"


def test_plan_cluster_ranks_cp_when_cp1_does_not_fit() -> None:
    # One head (no TP), two ranks, two samples per step: dp=2 holds a whole sample per rank, cp=2 half.
    shape = DecoderShape(num_layers=2, hidden=64, num_heads=1, vocab_size=128, seq_len=2048)
    costs, _ = _costs(shape)
    roomy = dataclasses.replace(load_cluster("h100-sxm-8x"), devices_per_node=2)
    kw = dict(num_nodes=1, global_batch_size=2, recompute_modes=("none",), zero_stages=(0,))
    every = plan_cluster(costs, roomy, cps=(1, 2), **kw)
    need = {cp: min(max(c.stage_memory_bytes) for c in every if c.cp == cp) for cp in (1, 2)}
    assert need[2] < need[1]
    tight = dataclasses.replace(roomy, memory_bytes=(need[1] + need[2]) / 2 / roomy.usable_memory_fraction)
    with pytest.raises(ValueError, match="nothing fits"):
        plan_cluster(costs, tight, cps=(1,), **kw)
    cands = plan_cluster(costs, tight, cps=(1, 2), **kw)
    assert cands and all(c.cp == 2 and c.cp_mode == "ring" and c.fits for c in cands)


def test_dry_run_groups_at_cp2_are_the_layouts() -> None:
    import torch.distributed as dist

    from merak_core.parallel import _compat
    from merak_core.parallel.layout import ParallelLayout
    from merak_core.planner.dryrun import dry_run

    fake = _compat.fake_process_group_store()
    if fake is None or dist.is_initialized():
        pytest.skip("needs torch's fake process group in a process without one")
    model = build_decoder(SHAPE)
    cluster = load_cluster("h100-sxm-8x")
    dp, cp, tp, pp = 2, 2, 2, 2
    world = dp * cp * tp * pp
    report = dry_run(
        model,
        decoder_inputs(SHAPE),
        cluster,
        world_size=world,
        tp=tp,
        pp=pp,
        cp=cp,
        num_microbatches=2,
        num_heads=SHAPE.num_heads,
        num_kv_heads=SHAPE.kv_heads,
        vocab_size=SHAPE.vocab_size,
    )
    assert report.ok, report.summary()
    assert report.degrees == (dp, tp, pp) and "cp=2" in report.summary()
    for r in range(world):
        dist.init_process_group("fake", rank=r, world_size=world, store=fake())
        try:
            lay = ParallelLayout.build(dp, tp, pp, cp=cp, device="cpu")
            want = [
                dist.get_process_group_ranks(g)
                for g in (lay.dp_group, lay.tp_group, lay.pp_group, lay.cp_group)
            ]
            coords = (lay.pp_rank, lay.dp_rank, lay.tp_rank, lay.cp_rank)
        finally:
            dist.destroy_process_group()
        p = report.ranks[r]
        assert [list(p.dp_group), list(p.tp_group), list(p.pp_group), list(p.cp_group)] == want
        assert (p.stage, p.dp_rank, p.tp_rank, p.cp_rank) == coords
    # priced at the job's cp: the prediction is predict_config's at cp=2
    assert report.prediction is not None and report.prediction.cp == cp
    costs, _ = _costs()
    choice = LayoutChoice(dp=dp, tp=tp, pp=pp, cp=cp, schedule="1f1b", num_microbatches=2, micro_batch_size=1)
    ref = predict_config(costs, cluster, choice, stage_layers=report.prediction.stage_layers)
    assert ref is not None and report.prediction.stage_memory_bytes == ref.stage_memory_bytes
    assert report.prediction.step_time_s == ref.step_time_s


def test_merak_plan_on_a_cluster_and_its_dry_run_take_the_jobs_cp(capsys: pytest.CaptureFixture[str]) -> None:
    from pathlib import Path

    from merak_core.cli.main import main

    demo = str(Path(__file__).resolve().parents[2] / "examples" / "addition" / "config.yaml")
    assert main(["plan", demo, "training.cp=2", "--cluster", "h100-sxm-8x", "--nodes", "1"]) == 0
    assert "feasible configurations" in capsys.readouterr().out
    assert main(["plan", demo, "training.cp=2", "training.pp=2", "--dry-run-ranks", "8"]) == 0
    out = capsys.readouterr().out
    assert "dp=1 tp=2 pp=2 cp=2" in out and "cp_rank  1" in out and "every rank would build and fit" in out
