"""The cluster cost model's ZeRO stages, per-step terms and the plan check's ZeRO stages (pure, one process)."""

from __future__ import annotations

import dataclasses

import pytest

from merak_core.config.layout_choice import LayoutChoice
from merak_core.planner.cluster import load_cluster
from merak_core.planner.cluster_cost import (
    Precision,
    model_costs,
    stage_costs,
    state_bytes,
    trace_for_cluster,
)
from merak_core.planner.cluster_overhead import STEP_OPS_PER_TENSOR, step_overhead_s
from merak_core.planner.gpt_shapes import DecoderShape, build_decoder, decoder_inputs
from merak_core.planner.memory import model_state_bytes

SMALL = DecoderShape(num_layers=2, hidden=32, num_heads=4, vocab_size=64, seq_len=8)


@pytest.fixture(scope="module")
def costs():
    model = build_decoder(SMALL)
    return model_costs(trace_for_cluster(model, decoder_inputs(SMALL), load_cluster("h100-sxm-8x")), model)


def _stages(costs, cluster, zero_stage, *, dp=4, bounds=None):
    bounds = bounds or [0, costs.num_layers // 2, costs.num_layers]
    return bounds, stage_costs(
        costs, cluster, bounds=bounds, dp=dp, tp=1, micro_batch_size=1, zero_stage=zero_stage
    )


def test_zero_memory_per_stage_follows_one_rule(costs):
    """bf16 weights (2 B), fp32 gradients (4 B), 12 B of optimizer states per parameter, dp = 4:
    ZeRO-0 18 B; ZeRO-1 6 + 12/4; ZeRO-2 also holds the gathered weights beside their shard
    (2 + 2/4 + 4 + 12/4); ZeRO-3 its shard and one gathered layer, except on the last stage of a
    pipeline, which holds them as ZeRO-2. (ZeRO-2/3 were priced as ZeRO-0 before.)"""
    cluster = load_cluster("h100-sxm-8x")
    bounds = [0, costs.num_layers // 2, costs.num_layers]
    n = [costs.stage_params(bounds[s], bounds[s + 1]) for s in range(2)]
    unit = costs.largest_layer_params(bounds[0], bounds[1])
    assert 0 < unit < n[0]
    expected = {
        0: [18.0 * x for x in n],
        1: [9.0 * x for x in n],
        2: [9.5 * x for x in n],
        3: [0.5 * n[0] + 2 * unit + 7 * n[0], 9.5 * n[1]],
    }
    for zero, want in expected.items():
        _, st = _stages(costs, cluster, zero, bounds=bounds)
        assert st.static_bytes == pytest.approx(want, rel=1e-12), zero
    # The profile planner's rule, in its own units (weights of 2 B, optimizer factor 6).
    for zero in range(4):
        p, g, o = model_state_bytes(2.0 * n[1], zero_stage=zero, dp=4, optimizer_state_factor=6.0)
        if zero < 3:
            assert state_bytes(n[1], Precision(), zero_stage=zero, dp=4) == pytest.approx(p + 2 * g + o)
    # One DP rank: nothing is sharded, every stage holds ZeRO-0's bytes.
    for zero in range(4):
        _, st = _stages(costs, cluster, zero, dp=1, bounds=bounds)
        assert st.static_bytes == pytest.approx(expected[0], rel=1e-12)


def test_zero_stage_out_of_range_is_refused(costs):
    with pytest.raises(ValueError, match=r"zero_stage=4; expected one of \(0, 1, 2, 3\)"):
        _stages(costs, load_cluster("h100-sxm-8x"), 4)


def test_zero_communication_reduce_scatter_gathers_and_sharded_optimizer(costs):
    """Over 4 ranks of one node: ZeRO-0/1 all-reduce the gradients (2 ring passes of 4 B per
    parameter); ZeRO-2 reduce-scatters them and all-gathers the 2-byte weights once (one pass
    each); ZeRO-3 reduce-scatters per step and all-gathers per microbatch in the forward, and in
    the backward on every stage but the pipeline's last. ZeRO-1/2/3 run the optimizer on 1/dp."""
    cluster = load_cluster("h100-sxm-8x")
    bw, lat = cluster.intra_node_bandwidth * cluster.link_efficiency, cluster.intra_node_latency_s

    def one_pass(nbytes):
        return 3 * lat + 3 / 4 * nbytes / bw

    sync, rest = {}, {}
    for zero in range(4):
        bounds, st = _stages(costs, cluster, zero)
        sync[zero], rest[zero] = step_overhead_s(
            costs, cluster, st, bounds=bounds, dp=4, tp=1, zero_stage=zero
        )
    largest = max(st.params_per_device)
    tied = costs.tied_across(bounds)  # the tied embedding: stages 0 and 1, ranks 0 and 4 of the node
    assert list(tied.values()) == [[0, 1]]
    tied_s = sum(2 * lat + costs.param_numel[name] * 4 / bw for name in tied)
    sync = {zero: s - tied_s for zero, s in sync.items()}
    assert sync[0] == pytest.approx(2 * one_pass(4 * largest), rel=1e-9) == sync[1]
    assert sync[2] == pytest.approx(one_pass(4 * largest) + one_pass(2 * largest), rel=1e-9)
    assert sync[3] == pytest.approx(one_pass(4 * largest), rel=1e-9)
    no_latency = dataclasses.replace(cluster, intra_node_latency_s=0.0, inter_node_latency_s=0.0)
    for zero in range(4):  # the optimizer alone (no all-reduce latencies)
        bounds, st = _stages(costs, no_latency, zero)
        rest[zero] = step_overhead_s(costs, no_latency, st, bounds=bounds, dp=4, tp=1, zero_stage=zero)[1]
    assert rest[1] == pytest.approx(rest[2]) == pytest.approx(rest[3]) == pytest.approx(rest[0] / 4)
    _, z2 = _stages(costs, cluster, 2)
    _, z3 = _stages(costs, cluster, 3)
    n0, n1 = z3.params_per_device
    assert z3.forward_s[0] - z2.forward_s[0] == pytest.approx(one_pass(2 * n0), rel=1e-9)
    assert z3.backward_s[0] - z2.backward_s[0] == pytest.approx(one_pass(2 * n0), rel=1e-9)
    assert z3.forward_s[1] - z2.forward_s[1] == pytest.approx(one_pass(2 * n1), rel=1e-9)
    assert z3.backward_s[1] == z2.backward_s[1]  # the last stage keeps its parameters gathered


def test_per_tensor_step_operators_and_small_allreduces(costs):
    """The step's fixed terms: STEP_OPS_PER_TENSOR operators per parameter tensor at the file's
    op_overhead_s (ZeRO-1: the tensors a rank owns, 1/dp), and the gradient-norm (PP group) and loss
    (all ranks) all-reduces at 2 log2(n) latencies each."""
    base = load_cluster("h100-sxm-8x")
    slow = dataclasses.replace(base, op_overhead_s=1e-5)
    bounds = [0, costs.num_layers // 2, costs.num_layers]
    tensors = max(
        len({n for ly in costs.layers[bounds[s] : bounds[s + 1]] for n in ly.param_names}) for s in range(2)
    )
    assert tensors == max(costs.stage_tensors(bounds[s], bounds[s + 1]) for s in range(2)) > 10

    def rest(cluster, zero, dp):
        st = stage_costs(costs, cluster, bounds=bounds, dp=dp, tp=1, micro_batch_size=1, zero_stage=zero)
        return step_overhead_s(costs, cluster, st, bounds=bounds, dp=dp, tp=1, zero_stage=zero)[1]

    assert rest(slow, 0, 2) - rest(base, 0, 2) == pytest.approx(
        tensors * STEP_OPS_PER_TENSOR * 1e-5, rel=1e-9
    )
    assert rest(slow, 1, 2) - rest(base, 1, 2) == pytest.approx(
        tensors * STEP_OPS_PER_TENSOR * 1e-5 / 2, rel=1e-9
    )
    # dp=1 x pp=2: the norm over the 2 pipeline ranks and the loss over the same 2 ranks: 2 x 2 hops.
    st = stage_costs(costs, base, bounds=bounds, dp=1, tp=1, micro_batch_size=1)
    _, one = step_overhead_s(costs, base, st, bounds=bounds, dp=1, tp=1, zero_stage=0)
    no_latency = dataclasses.replace(base, intra_node_latency_s=0.0, inter_node_latency_s=0.0)
    st0 = stage_costs(costs, no_latency, bounds=bounds, dp=1, tp=1, micro_batch_size=1)
    _, zero_lat = step_overhead_s(costs, no_latency, st0, bounds=bounds, dp=1, tp=1, zero_stage=0)
    assert one - zero_lat == pytest.approx(4 * base.intra_node_latency_s, rel=1e-9)


def test_plan_context_takes_every_zero_stage_the_planner_prices():
    """The plan check's context accepted ZeRO 0 and 1 only, so a ZeRO-2/3 job could not be checked."""
    from merak_core.planner import ModelProfile, PlanContext, predict_current

    profile = ModelProfile(
        layer_forward_s=[1e-3] * 4,
        layer_backward_s=[2e-3] * 4,
        layer_activation_bytes=[1e6] * 4,
        layer_param_bytes=[4e6] * 4,
        boundary_bytes=1e4,
        num_heads=4,
    )
    peaks = {}
    for zero in range(4):
        ctx = PlanContext(profile=profile, zero_stage=zero)
        c = predict_current(
            ctx, LayoutChoice(dp=2, tp=1, pp=2, schedule="1f1b", num_microbatches=2, micro_batch_size=1)
        )
        peaks[zero] = c.peak_memory_bytes
    assert peaks[1][0] < peaks[0][0] and peaks[2][0] > peaks[1][0]
    with pytest.raises(ValueError, match=r"PlanContext.zero_stage=4: expected one of \(0, 1, 2, 3\)"):
        PlanContext(profile=profile, zero_stage=4)


def test_sub_pipelined_tp_pays_latency_and_operators_per_chunk(costs):
    """k chunks run k all-reduces of 1/k of the bytes and the TP blocks' operators k times; with a
    latency-bound all-reduce (this small model) overlapping costs more than it hides. (It was
    priced as the same one all-reduce, partly hidden: always a gain.)"""
    cluster = dataclasses.replace(load_cluster("h100-sxm-8x"), op_overhead_s=2e-6)
    bounds = [0, costs.num_layers]
    kw = dict(bounds=bounds, dp=1, tp=2, micro_batch_size=1)
    plain = stage_costs(costs, cluster, **kw)
    over = stage_costs(costs, cluster, tp_overlap=True, tp_chunks=2, **kw)
    bw, lat = cluster.intra_node_bandwidth * cluster.link_efficiency, cluster.intra_node_latency_s
    blocks = sum(1 for ly in costs.layers if ly.param_names)
    message = costs.tp_message_bytes
    assert plain.tp_exposed_s[0] == pytest.approx(2 * blocks * (2 * lat + message / bw), rel=1e-9)
    chunked = blocks * 2 * (2 * lat + message / 2 / bw)
    compute_f = plain.forward_s[0] - plain.tp_exposed_s[0] / 2
    compute_k = compute_f + sum(ly.num_ops for ly in costs.layers if ly.param_names) * 2e-6
    assert over.forward_s[0] == pytest.approx(compute_k + max(chunked / 2, chunked - compute_k / 2), rel=1e-9)
    assert over.backward_s[0] == pytest.approx(
        2 * compute_k + max(chunked / 2, chunked - compute_k), rel=1e-9
    )
    assert over.forward_s[0] > plain.forward_s[0] and over.backward_s[0] > plain.backward_s[0]


def test_measured_step_overhead_per_step_tensor_and_parameter(costs):
    """[Note: measured step overhead]: a file's device.step_overhead_us is added once per step,
    step_tensor_us per owned parameter tensor (replacing STEP_OPS_PER_TENSOR x op_overhead_us) and
    step_param_ns per owned parameter (replacing Adam's bytes at the memory bandwidth); without the
    keys the step is what it was. Also read from a file, and a negative value is refused."""
    import yaml

    from merak_core.planner.cluster import ClusterSpec, shipped_clusters

    base = dataclasses.replace(load_cluster("h100-sxm-8x"), op_overhead_s=1e-5)
    bounds = [0, costs.num_layers // 2, costs.num_layers]
    tensors = max(costs.stage_tensors(bounds[s], bounds[s + 1], trainable=True) for s in range(2))
    params = max(costs.stage_trainable(bounds[s], bounds[s + 1]) for s in range(2))

    def rest(cluster, zero, dp):
        st = stage_costs(costs, cluster, bounds=bounds, dp=dp, tp=1, micro_batch_size=1, zero_stage=zero)
        return step_overhead_s(costs, cluster, st, bounds=bounds, dp=dp, tp=1, zero_stage=zero)[1]

    fixed = dataclasses.replace(base, step_overhead_s=2e-3)
    assert rest(fixed, 0, 2) - rest(base, 0, 2) == pytest.approx(2e-3, rel=1e-9)
    no_bytes = dataclasses.replace(base, step_param_s=0.0, step_tensor_s=0.0)
    assert rest(no_bytes, 0, 2) < rest(base, 0, 2)  # both terms of the default gone
    per_tensor = dataclasses.replace(no_bytes, step_tensor_s=3e-5)
    assert rest(per_tensor, 0, 2) - rest(no_bytes, 0, 2) == pytest.approx(tensors * 3e-5, rel=1e-9)
    assert rest(per_tensor, 1, 2) - rest(no_bytes, 1, 2) == pytest.approx(tensors * 3e-5 / 2, rel=1e-9)
    per_param = dataclasses.replace(no_bytes, step_param_s=4e-9)
    assert rest(per_param, 0, 2) - rest(no_bytes, 0, 2) == pytest.approx(params * 4e-9, rel=1e-9)
    assert rest(per_param, 1, 2) - rest(no_bytes, 1, 2) == pytest.approx(params * 4e-9 / 2, rel=1e-9)

    raw = yaml.safe_load(shipped_clusters()["h100-sxm-8x"].read_text())
    assert ClusterSpec.from_dict(raw).step_overhead_s == 0.0
    assert (
        ClusterSpec.from_dict(raw).step_tensor_s is None and ClusterSpec.from_dict(raw).step_param_s is None
    )
    raw["device"].update(step_overhead_us=2000.0, step_tensor_us=30.0, step_param_ns=4.0)
    spec = ClusterSpec.from_dict(raw)
    assert (spec.step_overhead_s, spec.step_tensor_s, spec.step_param_s) == pytest.approx((2e-3, 3e-5, 4e-9))
    for key in ("step_overhead_us", "step_tensor_us", "step_param_ns"):
        bad = {**raw, "device": {**raw["device"], key: -1.0}}
        with pytest.raises(ValueError, match="step_"):
            ClusterSpec.from_dict(bad)
