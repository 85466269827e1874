"""A cluster file's ``device.per_action_us``: the pipeline runtime's own cost per action in the cluster
model (pure, single process, meta device). Without the key every prediction is what it was; with it a
pipelined step grows by exactly the busiest rank's lowered actions x the cost."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from merak_core.config.layout_choice import LayoutChoice
from merak_core.planner.cluster import ClusterSpec, load_cluster, shipped_clusters
from merak_core.planner.cluster_cost import model_costs, trace_for_cluster
from merak_core.planner.cluster_search import plan_cluster, predict_config
from merak_core.planner.gpt_shapes import DecoderShape, build_decoder, decoder_inputs

SMALL = DecoderShape(num_layers=4, hidden=64, num_heads=4, vocab_size=128, seq_len=16)
PER_ACTION_US = 250.0


def _spec(per_action_us: float | None) -> ClusterSpec:
    raw = yaml.safe_load(shipped_clusters()["h100-sxm-8x"].read_text())
    if per_action_us is not None:
        raw["device"]["per_action_us"] = per_action_us
    return ClusterSpec.from_dict(raw)


@pytest.fixture(scope="module")
def small_costs():
    model = build_decoder(SMALL)
    return model_costs(
        trace_for_cluster(model, decoder_inputs(SMALL), load_cluster("h100-sxm-8x")),
        model,
        num_heads=4,
        vocab_size=128,
    )


def _lowered_actions(schedule: str, stages: int, ranks: int, microbatches: int) -> int:
    """The busiest rank's actions, counted on merak_pipe's own lowered schedule."""
    from merak_pipe import build_schedule, lower

    options = {"num_ranks": ranks} if stages > ranks else {}
    built = lower(build_schedule(schedule, num_stages=stages, num_microbatches=microbatches, **options))
    return max(len(built.actions[r]) for r in range(ranks))


def test_the_file_key_is_optional_in_microseconds_and_validated():
    assert _spec(None).per_action_s == 0.0
    assert all(load_cluster(name).per_action_s == 0.0 for name in shipped_clusters())
    assert _spec(PER_ACTION_US).per_action_s == pytest.approx(PER_ACTION_US * 1e-6, rel=1e-15)
    with pytest.raises(ValueError, match=r"device\.per_action_us=-1.0 must be > 0"):
        _spec(-1.0)
    with pytest.raises(ValueError, match=r"device\.per_action_us='x' must be a float"):
        _spec("x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="per_action_s"):
        dataclasses.replace(_spec(None), per_action_s=-1e-6)


@pytest.mark.parametrize(
    ("schedule", "virtual", "microbatches"),
    [("1f1b", 1, 4), ("gpipe", 1, 4), ("interleaved_1f1b", 2, 8)],
)
def test_a_pipelined_step_grows_by_actions_times_the_cost(small_costs, schedule, virtual, microbatches):
    choice = LayoutChoice(
        dp=1,
        tp=1,
        pp=2,
        schedule=schedule,
        num_microbatches=microbatches,
        micro_batch_size=1,
        recompute="none",
        virtual_stages=virtual,
    )
    without = predict_config(small_costs, _spec(None), choice)
    priced = predict_config(small_costs, _spec(PER_ACTION_US), choice)
    actions = _lowered_actions(schedule, 2 * virtual, 2, microbatches)
    assert actions >= 4 * microbatches  # a forward, a backward, a send and a receive per microbatch
    assert priced.step_time_s - without.step_time_s == pytest.approx(actions * PER_ACTION_US * 1e-6, rel=1e-9)
    # only the step: the pipeline's simulation, the collectives and the memory are the same
    rest = ("pipeline_s", "dp_allreduce_s", "optimizer_s", "stage_memory_bytes", "recompute_fractions")
    assert all(getattr(priced, k) == getattr(without, k) for k in rest)


def test_no_pipeline_no_runtime_cost_and_no_key_no_change(small_costs):
    one = LayoutChoice(dp=2, tp=1, pp=1, schedule="1f1b", num_microbatches=2, micro_batch_size=1)
    assert predict_config(small_costs, _spec(PER_ACTION_US), one) == predict_config(
        small_costs, _spec(None), one
    )
    # a file without the key plans exactly as a spec with a zero cost (the defaults before the key)
    zero = dataclasses.replace(_spec(None), per_action_s=0.0)
    kw = dict(
        num_nodes=1, global_batch_size=16, max_microbatches=8, layouts=[(8, 1, 1), (4, 1, 2), (2, 1, 4)]
    )
    plain = plan_cluster(small_costs, _spec(None), **kw)  # type: ignore[arg-type]
    assert {c.pp for c in plain} == {1, 2, 4}
    assert plain == plan_cluster(small_costs, zero, **kw)  # type: ignore[arg-type]
    priced = plan_cluster(small_costs, _spec(PER_ACTION_US), **kw)  # type: ignore[arg-type]
    assert {c.pp for c in priced} == {1, 2, 4}
    before = {
        (c.pp, c.schedule, c.virtual_stages, c.num_microbatches, c.zero_stage, c.recompute): c for c in plain
    }
    for c in priced:  # a pipelined configuration only grows; one without a pipeline is unchanged
        old = before[(c.pp, c.schedule, c.virtual_stages, c.num_microbatches, c.zero_stage, c.recompute)]
        assert c.step_time_s > old.step_time_s if c.pp > 1 else c.step_time_s == old.step_time_s
