"""Cluster descriptions, the cluster cost model and its search (pure, single process, meta device)."""

from __future__ import annotations

import copy
import math

import pytest
import yaml

from merak_core.config.layout_choice import LayoutChoice
from merak_core.planner.cluster import ClusterSpec, load_cluster, shipped_clusters
from merak_core.planner.cluster_cost import model_costs, stage_costs, trace_for_cluster
from merak_core.planner.cluster_search import format_cluster_plan, plan_cluster, predict_config
from merak_core.planner.gpt_shapes import PAPER_MODELS, DecoderShape, build_decoder, decoder_inputs

SMALL = DecoderShape(num_layers=4, hidden=64, num_heads=4, vocab_size=128, seq_len=16)


def _raw(**changes):
    raw = yaml.safe_load(shipped_clusters()["h100-sxm-8x"].read_text())
    for path, value in changes.items():
        node = raw
        keys = path.split(".")
        for k in keys[:-1]:
            node = node[k]
        if value is None:
            del node[keys[-1]]
        else:
            node[keys[-1]] = value
    return raw


def _tiny_cluster(memory_gb: float = 80.0, devices_per_node: int = 8) -> ClusterSpec:
    raw = _raw(devices_per_node=devices_per_node)
    raw["device"]["memory_gb"] = memory_gb
    raw["inter_node"]["nics_per_node"] = devices_per_node
    return ClusterSpec.from_dict(raw)


@pytest.fixture(scope="module")
def small_costs():
    cluster = load_cluster("h100-sxm-8x")
    model = build_decoder(SMALL)
    return model_costs(
        trace_for_cluster(model, decoder_inputs(SMALL), cluster), model, num_heads=4, vocab_size=128
    )


# ------------------------------------------------------------------ cluster files


def test_shipped_clusters_load_with_spec_sheet_numbers():
    assert set(shipped_clusters()) == {"a100-80gb-8x", "h100-sxm-8x", "h200-8x"}
    a100, h100, h200 = (load_cluster(n) for n in ("a100-80gb-8x", "h100-sxm-8x", "h200-8x"))
    assert a100.peak_flops == {"bf16": 312e12, "fp32": 19.5e12}
    assert h100.peak_flops == {"bf16": 989e12, "fp32": 67e12}
    assert h200.peak_flops["bf16"] == 989e12 and h200.memory_bytes == 141e9
    assert (a100.memory_bandwidth, h100.memory_bandwidth, h200.memory_bandwidth) == (2039e9, 3350e9, 4800e9)
    # NVLink figures are both directions together: half each way.
    assert (a100.intra_node_bandwidth, h100.intra_node_bandwidth) == (300e9, 450e9)
    # One NIC per GPU: 200 Gb/s HDR = 25 GB/s, 400 Gb/s NDR = 50 GB/s per device.
    assert (a100.inter_node_bandwidth, h100.inter_node_bandwidth, h200.inter_node_bandwidth) == (
        25e9,
        50e9,
        50e9,
    )
    for c in (a100, h100, h200):
        assert c.devices_per_node == 8 and "spec sheet" in c.source


def test_cluster_links_inside_and_across_nodes():
    c = load_cluster("a100-80gb-8x")
    assert c.link(range(8)) == (300e9 * c.link_efficiency, 3e-6)
    assert c.link([0, 8]) == (25e9 * c.link_efficiency, 5e-6)
    assert c.node_of(7) == 0 and c.node_of(8) == 1


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"devices_per_node": 0}, "devices_per_node=0 must be > 0"),
        ({"devices_per_node": 8.5}, "devices_per_node=8.5 must be a int"),
        ({"device.memory_gb": -1}, "device.memory_gb=-1 must be > 0"),
        ({"device.peak_tflops.bf16": "989 TFLOP/s"}, "device.peak_tflops.bf16='989 TFLOP/s' must be a float"),
        ({"device.memory_bandwith_gb_s": 1}, "unknown key 'device.memory_bandwith_gb_s'"),
        ({"device.memory_bandwidth_gb_s": None}, "the key 'device.memory_bandwidth_gb_s' is missing"),
        ({"efficiency.compute": 1.5}, r"efficiency.compute=1.5 must be a fraction in \(0, 1\]"),
        ({"intra_node": [900]}, "intra_node must be a mapping"),
        ({"intra_node.bidirectional": "yes"}, "intra_node.bidirectional='yes' must be a bool"),
    ],
)
def test_bad_cluster_files_are_refused_with_the_key(changes, match):
    with pytest.raises(ValueError, match=match):
        ClusterSpec.from_dict(_raw(**changes))


def test_load_cluster_from_a_file_and_unknown_names(tmp_path):
    path = tmp_path / "mine.yaml"
    raw = _raw(name="mine")
    del raw["inter_node"]  # a single-node machine needs no network
    path.write_text(yaml.safe_dump(raw))
    c = load_cluster(path)
    assert c.name == "mine" and c.inter_node_bandwidth == c.intra_node_bandwidth
    with pytest.raises(ValueError, match="neither a file nor a shipped cluster"):
        load_cluster("tpu-v9")
    path.write_text("name: [unclosed")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_cluster(path)


def test_cluster_files_are_in_the_wheel_configuration():
    # hatch's wheel target packages the whole src/merak_core directory, YAML files included
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    text = (root / "packages/merak-core/pyproject.toml").read_text()
    assert '[tool.hatch.build.targets.wheel]\npackages = ["src/merak_core"]' in text
    for path in shipped_clusters().values():
        assert "src/merak_core/planner/clusters" in path.as_posix()


# ------------------------------------------------------------------ cost model


def test_traced_flops_match_the_transformer_formula(small_costs):
    s, h, L, v = SMALL.seq_len, SMALL.hidden, SMALL.num_layers, SMALL.vocab_size
    block = 24 * s * h * h + 4 * s * s * h  # qkv, proj, two MLP matmuls; QK^T and AV
    assert sum(ly.flops for ly in small_costs.layers) == L * block + 2 * s * h * v
    n_params = sum(small_costs.param_numel.values())
    assert n_params == SMALL.num_parameters()


def test_compute_bound_layer_time_is_flops_over_sustained_peak():
    cluster = load_cluster("h100-sxm-8x")
    big = DecoderShape(num_layers=2, hidden=2048, num_heads=16, vocab_size=1024, seq_len=512)
    model = build_decoder(big)
    costs = model_costs(trace_for_cluster(model, decoder_inputs(big), cluster), model)
    matmul_layers = [ly for ly in costs.layers if ly.flops > 1e10]
    assert matmul_layers
    for ly in matmul_layers:  # roofline: at least the FLOPs at the sustained rate, memory-bound ops on top
        assert ly.forward_s >= ly.flops / cluster.flops("bf16") * (1 - 1e-9)
        assert ly.forward_s < 1.5 * ly.flops / cluster.flops("bf16")


def test_single_device_step_is_microbatches_times_forward_and_backward(small_costs):
    cluster = load_cluster("h100-sxm-8x")
    c = predict_config(
        small_costs,
        cluster,
        LayoutChoice(dp=1, tp=1, pp=1, schedule="1f1b", num_microbatches=4, micro_batch_size=2),
    )
    f = 2 * sum(ly.forward_s for ly in small_costs.layers)
    assert c.pipeline_s == pytest.approx(4 * 3 * f, rel=1e-9)
    assert c.dp_allreduce_s == 0.0 and c.step_time_s == pytest.approx(c.pipeline_s + c.optimizer_s)


def test_dp_allreduce_is_the_ring_formula_over_the_network(small_costs):
    cluster = load_cluster("a100-80gb-8x")
    c = predict_config(
        small_costs,
        cluster,
        LayoutChoice(dp=16, tp=1, pp=1, schedule="1f1b", num_microbatches=1, micro_batch_size=1),
    )
    grads = SMALL.num_parameters() * 4.0  # fp32 gradients of bf16 weights
    bw, lat = 25e9 * cluster.link_efficiency, 5e-6
    assert c.dp_allreduce_s == pytest.approx(2 * 15 * lat + 2 * 15 / 16 * grads / bw, rel=1e-9)
    assert c.dp_crosses_nodes


def test_zero1_divides_optimizer_states_by_dp(small_costs):
    cluster = load_cluster("h100-sxm-8x")
    kw = dict(dp=4, tp=1, pp=1, schedule="1f1b", num_microbatches=1, micro_batch_size=1)
    z0 = predict_config(small_costs, cluster, LayoutChoice(zero_stage=0, **kw))
    z1 = predict_config(small_costs, cluster, LayoutChoice(zero_stage=1, **kw))
    n = SMALL.num_parameters()
    assert z0.stage_static_bytes[0] == pytest.approx(n * (2 + 4 + 12))
    assert z1.stage_static_bytes[0] == pytest.approx(n * (2 + 4 + 12 / 4))


def test_tp_overlap_hides_communication_but_never_compute():
    cluster = load_cluster("h100-sxm-8x")
    big = DecoderShape(num_layers=2, hidden=2048, num_heads=16, vocab_size=1024, seq_len=512)
    model = build_decoder(big)
    costs = model_costs(trace_for_cluster(model, decoder_inputs(big), cluster), model)
    bounds = [0, costs.num_layers]
    # 16 x 512 tokens: bandwidth-bound all-reduces (a latency-bound case: test_cluster_terms.py)
    plain = stage_costs(costs, cluster, bounds=bounds, dp=1, tp=4, micro_batch_size=16)
    over = stage_costs(costs, cluster, bounds=bounds, dp=1, tp=4, micro_batch_size=16, tp_overlap=True)
    compute = 16 * sum(ly.forward_s for ly in costs.layers) / 4
    assert plain.forward_s[0] > over.forward_s[0] >= compute
    assert plain.tp_exposed_s[0] > over.tp_exposed_s[0] > 0


def test_pipeline_messages_cross_nodes_when_a_stage_fills_a_node(small_costs):
    cluster = load_cluster("h100-sxm-8x")
    inside = predict_config(
        small_costs,
        cluster,
        LayoutChoice(dp=2, tp=2, pp=2, schedule="1f1b", num_microbatches=2, micro_batch_size=1),
    )
    across = predict_config(
        small_costs,
        cluster,
        LayoutChoice(dp=4, tp=2, pp=2, schedule="1f1b", num_microbatches=2, micro_batch_size=1),
    )
    assert not inside.pipeline_crosses_nodes and across.pipeline_crosses_nodes


def test_stage_aware_recomputation_fits_and_beats_full(small_costs):
    # A device just big enough that stage 0 of pp=4 cannot keep every activation.
    probe = predict_config(
        small_costs,
        load_cluster("h100-sxm-8x"),
        LayoutChoice(dp=1, tp=1, pp=4, schedule="1f1b", num_microbatches=8, micro_batch_size=64),
    )
    need = max(probe.stage_memory_bytes)
    cluster = _tiny_cluster(memory_gb=need * 0.8 / 0.9 / 1e9)
    kw = dict(dp=1, tp=1, pp=4, num_microbatches=8, micro_batch_size=64)
    sa = predict_config(
        small_costs, cluster, LayoutChoice(schedule="shifted_critical_path", recompute="stage_aware", **kw)
    )
    full = predict_config(small_costs, cluster, LayoutChoice(schedule="1f1b", recompute="full", **kw))
    assert sa is not None and sa.fits and full.fits
    assert sa.recompute_fractions[-1] == 0.0 and max(sa.recompute_fractions) > 0
    assert sa.step_time_s < full.step_time_s


def test_plan_cluster_ranks_feasible_configs_and_keeps_tp_in_a_node(small_costs):
    cluster = load_cluster("h100-sxm-8x")
    cands = plan_cluster(small_costs, cluster, num_nodes=2, global_batch_size=32, max_microbatches=16)
    assert cands and all(c.fits for c in cands)
    assert [c.step_time_s for c in cands] == sorted(c.step_time_s for c in cands)
    assert all(c.dp * c.tp * c.pp == 16 and 8 % c.tp == 0 and 4 % c.tp == 0 for c in cands)
    assert {c.zero_stage for c in cands} == {0, 1} and {c.schedule for c in cands} >= {"1f1b"}
    text = format_cluster_plan(cands, top=3)
    assert "dp" in text and text.count("\n") == 3


def test_plan_cluster_says_what_is_missing_when_nothing_fits(small_costs):
    with pytest.raises(ValueError, match="nothing fits .* the smallest configuration needs"):
        plan_cluster(small_costs, _tiny_cluster(memory_gb=1e-6), num_nodes=1, global_batch_size=8)
    with pytest.raises(ValueError, match="no \\(dp, tp, pp\\)"):
        plan_cluster(small_costs, load_cluster("h100-sxm-8x"), num_nodes=1, global_batch_size=3, layouts=[])


def test_paper_models_have_their_advertised_sizes():
    for name, billions in (("gpt-1.5b", 1.5), ("gpt-2.5b", 2.5), ("gpt-8.3b", 8.3), ("gpt-20b", 20)):
        n = PAPER_MODELS[name].num_parameters() / 1e9
        assert math.isclose(n, billions, rel_tol=0.1), (name, n)


def test_cluster_spec_is_validated_when_built_directly():
    good = load_cluster("h100-sxm-8x")
    fields = {k: copy.deepcopy(getattr(good, k)) for k in good.__dataclass_fields__}
    with pytest.raises(ValueError, match="compute_efficiency=0"):
        ClusterSpec(**{**fields, "compute_efficiency": 0})
    with pytest.raises(ValueError, match="no peak for dtype 'fp8'"):
        good.flops("fp8")


def test_shifted_schedule_with_a_non_monotone_recompute_plan_validates():
    from merak_pipe import RecomputePlan, build_schedule

    build_schedule(
        "shifted-critical-path",
        num_stages=4,
        num_microbatches=8,
        recompute=RecomputePlan((0.0, 1.0, 0.0, 0.0)),
    )


def test_a_non_monotone_stage_aware_plan_is_predicted(small_costs, monkeypatch, caplog):
    """A plan where a later stage recomputes more than an earlier one gets a prediction (it was skipped)."""
    import merak_pipe

    monkeypatch.setattr(
        merak_pipe, "stage_aware_plan", lambda **kw: merak_pipe.RecomputePlan((0.0, 1.0, 0.0, 0.0))
    )
    kw = dict(
        dp=1,
        tp=1,
        pp=4,
        schedule="shifted_critical_path",
        num_microbatches=8,
        micro_batch_size=1,
        recompute="stage_aware",
    )
    got = predict_config(small_costs, load_cluster("h100-sxm-8x"), LayoutChoice(**kw), memo={})
    assert got is not None and got.recompute_fractions == (0.0, 1.0, 0.0, 0.0)
    assert got.pipeline_s > 0
    assert "does not validate" not in caplog.text


def test_virtual_stages_shrink_the_bubble_and_sum_memory_per_rank(small_costs):
    cluster = load_cluster("h100-sxm-8x")
    kw = dict(dp=1, tp=1, pp=2, num_microbatches=2, micro_batch_size=256)
    plain = predict_config(small_costs, cluster, LayoutChoice(schedule="1f1b", **kw))
    inter = predict_config(
        small_costs, cluster, LayoutChoice(schedule="interleaved_1f1b", virtual_stages=2, **kw)
    )
    assert inter.virtual_stages == 2 and len(inter.stage_layers) == 4 and len(inter.stage_memory_bytes) == 2
    assert inter.pipeline_s < plain.pipeline_s
    # every rank holds two stages: its static memory is the sum of theirs
    bounds = [0]
    for size in inter.stage_layers:
        bounds.append(bounds[-1] + size)
    per_stage = [small_costs.stage_params(bounds[s], bounds[s + 1]) * (2 + 4 + 12) for s in range(4)]
    assert inter.stage_static_bytes == pytest.approx(
        (per_stage[0] + per_stage[2], per_stage[1] + per_stage[3])
    )
    # The job file's fields carry the virtual stages, and the Trainer's arguments take them.
    fields = inter.training_fields()
    assert fields["virtual_stages"] == 2 and fields["schedule"] == "interleaved_1f1b", fields
    from merak_core import TrainingArguments

    args = TrainingArguments(**fields)
    assert (args.virtual_stages, args.schedule, args.pp) == (2, "interleaved_1f1b", inter.pp)
    searched = plan_cluster(
        small_costs,
        cluster,
        num_nodes=1,
        global_batch_size=16,
        max_microbatches=8,
        schedules=("1f1b", "interleaved_1f1b"),
        zero_stages=(0,),
        tp_overlaps=(False,),
        layouts=[(1, 1, 4)],
    )
    assert {c.virtual_stages for c in searched} == {1, 2}


def test_per_operator_overhead_is_charged_per_microbatch_not_per_sample(small_costs):
    # The fixed cost per operator (dispatch, kernel launch) does not grow with the micro batch and
    # is not divided by tp; the backward pays it twice like the rest of the forward.
    plain = ClusterSpec.from_dict(_raw())
    raw = _raw()
    raw["device"]["op_overhead_us"] = 10.0
    slow = ClusterSpec.from_dict(raw)
    assert slow.op_overhead_s == pytest.approx(1e-5) and plain.op_overhead_s == 0.0
    ops = sum(ly.num_ops for ly in small_costs.layers)
    assert ops > 4 * SMALL.num_layers  # every block runs many operators
    bounds = [0, small_costs.num_layers]
    for b, tp in ((1, 1), (8, 1), (8, 4)):
        a = stage_costs(small_costs, plain, bounds=bounds, dp=1, tp=tp, micro_batch_size=b)
        c = stage_costs(small_costs, slow, bounds=bounds, dp=1, tp=tp, micro_batch_size=b)
        assert c.forward_s[0] == pytest.approx(a.forward_s[0] + 1e-5 * ops, rel=1e-9)
        assert c.backward_s[0] == pytest.approx(a.backward_s[0] + 2e-5 * ops, rel=1e-9)


def test_a_negative_or_non_numeric_operator_overhead_is_refused():
    for bad in (-1.0, "fast"):
        raw = _raw()
        raw["device"]["op_overhead_us"] = bad
        with pytest.raises(ValueError, match="device.op_overhead_us"):
            ClusterSpec.from_dict(raw)
