"""Closing the loop on synthetic numbers (no processes): errors, the threshold, the corrected profile, re-planning.

"Measurements" come from predicting with a hidden *true* profile (other per-layer costs, another
optimizer cost) or are written by hand; the expected errors are computed here from the rows'
numbers. The key property: after :func:`correct_profile`, ``predict()`` of the measured
configuration gives back the measured step time, pipeline time and (with a device per rank) the
measured per-stage forward and backward times.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from merak_core.config.layout_choice import LayoutChoice
from merak_core.planner import (
    CommModel,
    MeasuredStep,
    ModelProfile,
    PlanContext,
    compare,
    correct_profile,
    needs_replan,
    plan,
    predict_current,
    replan,
)


def _profile(**kw) -> ModelProfile:
    values = dict(
        layer_forward_s=[1e-3] * 4,
        layer_backward_s=[2e-3] * 4,
        layer_activation_bytes=[1e6] * 4,
        layer_param_bytes=[4e6] * 4,
        boundary_bytes=1e4,
        microbatch_overhead_s=2e-4,
        num_heads=4,
        vocab_size=16,
        optimizer_s_per_byte=1e-10,
    )
    values.update(kw)
    return ModelProfile(**values)


FREE = CommModel(
    p2p_latency_s=0.0, p2p_bandwidth=math.inf, allreduce_latency_s=0.0, allreduce_bandwidth=math.inf
)

TRUE = dict(
    layer_forward_s=[1.5e-3, 1.4e-3, 0.9e-3, 1.1e-3],
    layer_backward_s=[3e-3, 2.5e-3, 2e-3, 2.5e-3],
    optimizer_s_per_byte=5e-10,
)
"""The hidden costs the "measurements" come from: stages differ, and so does the optimizer."""

CONFIGS = [
    dict(dp=1, tp=1, pp=4, schedule="1f1b", num_microbatches=4, micro_batch_size=2),
    dict(dp=2, tp=1, pp=2, schedule="gpipe", num_microbatches=2, micro_batch_size=2),
    dict(dp=1, tp=2, pp=2, schedule="zb_h1", num_microbatches=4, micro_batch_size=2),
    dict(
        dp=1,
        tp=1,
        pp=2,
        schedule="shifted_critical_path",
        num_microbatches=4,
        micro_batch_size=2,
        recompute="full",
    ),
    dict(dp=4, tp=1, pp=1, schedule="1f1b", num_microbatches=1, micro_batch_size=2),
]


def _measure(
    ctx: PlanContext, cfg: dict, true: ModelProfile, *, memory: bool = True, steps: int = 3
) -> MeasuredStep:
    t = predict_current(ctx, LayoutChoice(**cfg), profile=true)
    return MeasuredStep(
        step_time_s=t.step_time_s,
        pipeline_s=t.pipeline_s,
        stage_forward_s=t.stage_forward_s,
        stage_backward_s=t.stage_backward_s,
        stage_peak_memory_bytes=t.peak_memory_bytes if memory else (),
        steps=steps,
    )


def test_compare_rows_and_errors_come_from_the_numbers():
    ctx = PlanContext(profile=_profile())
    cfg = CONFIGS[1]
    pred = predict_current(ctx, LayoutChoice(**cfg))
    measured = MeasuredStep(
        step_time_s=2 * pred.step_time_s,
        pipeline_s=pred.pipeline_s * 1.5,
        stage_forward_s=(4e-3, 5e-3),
        stage_backward_s=(9e-3, 8e-3),
        stage_peak_memory_bytes=(3 * 2**20, None),
        steps=4,
    )
    comp = compare(pred, measured)
    rows = {r.name: r for r in comp.rows}
    assert list(rows) == [
        "step time",
        "pipeline",
        "outside pipeline",
        "stage 0 F",
        "stage 0 B",
        "stage 1 F",
        "stage 1 B",
        "stage 0 peak memory",
        "stage 1 peak memory",
    ]
    assert comp.step_time_error == pytest.approx(-0.5)
    assert rows["stage 0 F"].predicted == pred.stage_forward_s[0]
    assert rows["stage 1 B"].error == pytest.approx((pred.stage_backward_s[1] - 8e-3) / 8e-3)
    outside = 2 * pred.step_time_s - 1.5 * pred.pipeline_s
    assert rows["outside pipeline"].measured == pytest.approx(outside)
    assert rows["outside pipeline"].error == pytest.approx(
        (pred.step_time_s - pred.pipeline_s - outside) / outside
    )
    assert rows["stage 0 peak memory"].error == pytest.approx(pred.peak_memory_bytes[0] / (3 * 2**20) - 1)
    assert rows["stage 1 peak memory"].measured is None and rows["stage 1 peak memory"].error is None
    table = comp.table()
    assert "plan check over 4 steps: dp2-tp1-pp2 gpipe m=2 mbs=2 recompute=none" in table
    assert "-50.0%" in table and "n/a" in table
    step_line = next(line for line in table.splitlines() if line.startswith("step time"))
    assert f"{pred.step_time_s * 1e3:.3f}" in step_line and f"{2 * pred.step_time_s * 1e3:.3f}" in step_line
    record = comp.to_record()
    assert record["error_step_time"] == pytest.approx(-0.5)
    assert record["measured_stage_1_peak_memory_bytes"] is None
    assert record["predicted_stage_0_F_s"] == pred.stage_forward_s[0]


def test_compare_rejects_another_stage_count():
    ctx = PlanContext(profile=_profile())
    pred = predict_current(ctx, LayoutChoice(**CONFIGS[1]))
    m = MeasuredStep(step_time_s=1.0, pipeline_s=0.5, stage_forward_s=(1.0,), stage_backward_s=(1.0,))
    with pytest.raises(ValueError, match="1 stages but the prediction dp2-tp1-pp2 has pp=2"):
        compare(pred, m)


@pytest.mark.parametrize(
    "error, threshold, expected",
    [
        (0.3, 0.25, True),
        (-0.3, 0.25, True),
        (0.2, 0.25, False),
        (-0.2, 0.25, False),
        (0.3, 0.35, False),
        (0.01, 0.0, True),
    ],
)
def test_needs_replan_compares_the_absolute_step_error_with_the_threshold(error, threshold, expected):
    ctx = PlanContext(profile=_profile())
    pred = predict_current(ctx, LayoutChoice(**CONFIGS[4]))
    measured = MeasuredStep(
        step_time_s=pred.step_time_s / (1 + error),
        pipeline_s=pred.pipeline_s,
        stage_forward_s=pred.stage_forward_s,
        stage_backward_s=pred.stage_backward_s,
    )
    comp = compare(pred, measured)
    assert comp.step_time_error == pytest.approx(error)
    assert needs_replan(comp, threshold) is expected


def test_needs_replan_rejects_a_negative_threshold():
    ctx = PlanContext(profile=_profile())
    pred = predict_current(ctx, LayoutChoice(**CONFIGS[4]))
    comp = compare(pred, _measure(ctx, CONFIGS[4], _profile()))
    with pytest.raises(ValueError, match="threshold=-0.1"):
        needs_replan(comp, -0.1)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"dp{c['dp']}-tp{c['tp']}-pp{c['pp']}-{c['schedule']}")
def test_corrected_profile_predicts_what_was_measured(cfg):
    ctx = PlanContext(profile=_profile(), comm=CommModel(), memory_per_device=1e9)
    true = _profile(**TRUE)
    pred = predict_current(ctx, LayoutChoice(**cfg))
    measured = _measure(ctx, cfg, true)
    before = compare(pred, measured)
    assert abs(before.step_time_error) > 0.1  # the uncorrected profile is far off
    corrected = correct_profile(ctx, pred, measured)
    again = predict_current(ctx, LayoutChoice(**cfg), profile=corrected)
    assert again.stage_layers == pred.stage_layers
    assert again.step_time_s == pytest.approx(measured.step_time_s, rel=1e-6)
    assert again.pipeline_s == pytest.approx(measured.pipeline_s, rel=1e-6)
    assert again.stage_forward_s == pytest.approx(measured.stage_forward_s, rel=1e-6)
    assert again.stage_backward_s == pytest.approx(measured.stage_backward_s, rel=1e-6)
    after = compare(again, measured)
    assert abs(after.step_time_error) < 1e-6
    # memory and the sizes the planner needs are not touched
    assert corrected.layer_activation_bytes == ctx.profile.layer_activation_bytes
    assert corrected.layer_param_bytes == ctx.profile.layer_param_bytes


def test_corrected_profile_with_ranks_sharing_cores_still_gives_the_measured_step_time():
    # 4 ranks on 2 cores: the prediction adds the contention, so a common factor below 1 absorbs it
    ctx = PlanContext(profile=_profile(), compute_slots=2)
    cfg = CONFIGS[0]
    true = _profile(**TRUE)
    t = predict_current(ctx, LayoutChoice(**cfg), profile=true)
    slowed = 2.0  # measured stage times include the slow-down of sharing cores
    measured = MeasuredStep(
        step_time_s=t.step_time_s,
        pipeline_s=t.pipeline_s,
        stage_forward_s=tuple(slowed * f for f in t.stage_forward_s),
        stage_backward_s=tuple(slowed * b for b in t.stage_backward_s),
    )
    corrected = correct_profile(ctx, predict_current(ctx, LayoutChoice(**cfg)), measured)
    again = predict_current(ctx, LayoutChoice(**cfg), profile=corrected)
    assert again.step_time_s == pytest.approx(measured.step_time_s, rel=1e-6)
    assert again.pipeline_s == pytest.approx(measured.pipeline_s, rel=1e-6)
    # the shape across stages follows the measurement
    ratio = [a / m for a, m in zip(again.stage_forward_s, measured.stage_forward_s, strict=True)]
    assert max(ratio) < 1.0


def test_replan_keeps_a_configuration_that_was_measured_as_predicted():
    ctx = PlanContext(profile=_profile(), memory_per_device=1e9)
    best = plan(ctx.profile, world_size=4, memory_per_device=1e9, global_batch_size=8, comm=ctx.comm)[0]
    cfg = dict(
        dp=best.dp,
        tp=best.tp,
        pp=best.pp,
        schedule=best.schedule,
        num_microbatches=best.num_microbatches,
        micro_batch_size=best.micro_batch_size,
        recompute=best.recompute,
    )
    pred = predict_current(ctx, LayoutChoice(**cfg))
    result = replan(ctx, pred, _measure(ctx, cfg, ctx.profile))
    assert not result.changed
    assert result.current.step_time_s == pytest.approx(pred.step_time_s, rel=1e-6)
    assert "nothing to change" in result.message()


def test_replan_switches_when_the_measurement_says_the_current_layout_is_slow():
    # With free communication and a free optimizer, pure DP is predicted best (equal compute, fewest TP
    # ranks); measured, its optimizer step (the whole model on every rank) costs 1 ns per byte. Corrected,
    # layouts that hold a part of the model per rank win.
    ctx = PlanContext(profile=_profile(optimizer_s_per_byte=0.0), memory_per_device=1e9, comm=FREE)
    cands = plan(ctx.profile, world_size=4, memory_per_device=1e9, global_batch_size=8, comm=ctx.comm)
    current = cands[0]
    assert current.pp == 1 and current.tp == 1
    cfg = dict(
        dp=current.dp,
        tp=1,
        pp=1,
        schedule=current.schedule,
        num_microbatches=current.num_microbatches,
        micro_batch_size=current.micro_batch_size,
        recompute=current.recompute,
    )
    slow = dataclasses.replace(ctx.profile, optimizer_s_per_byte=1e-9)
    measured = _measure(ctx, cfg, slow)
    comp = compare(current, measured)
    assert needs_replan(comp, 0.25)
    result = replan(ctx, current, measured, global_batch_size=8)
    assert result.current.step_time_s == pytest.approx(measured.step_time_s, rel=1e-6)
    assert result.changed and result.best.layout != current.layout
    assert result.best.step_time_s < 0.95 * result.current.step_time_s
    text = result.message(job_path="out/run/replanned.yaml", has_checkpoints=False)
    assert text.startswith(f"re-planned from measured costs: best is now {result.best.layout}")
    assert f"vs the current {current.layout}" in text
    assert f"dp={result.best.dp} tp={result.best.tp} pp={result.best.pp}" in text
    assert "(written to out/run/replanned.yaml)" in text
    assert "merak train out/run/replanned.yaml --resume latest" in text and "set save_steps" in text
    assert "merak train NEW.yaml --resume latest" in result.message() and "in a job file" in result.message()


def test_replan_reports_when_nothing_fits():
    ctx = PlanContext(profile=_profile(), memory_per_device=1e9)
    cfg = CONFIGS[4]
    pred = predict_current(ctx, LayoutChoice(**cfg))
    tight = dataclasses.replace(ctx, memory_per_device=1e3)
    result = replan(tight, pred, _measure(ctx, cfg, ctx.profile))
    assert result.candidates == () and not result.changed
    assert (
        "found nothing else that fits" in result.message() and "smallest configuration needs" in result.error
    )


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(step_time_s=0.0), "step_time_s=0.0"),
        (dict(pipeline_s=math.nan), "pipeline_s=nan"),
        (dict(stage_backward_s=(1.0,)), "2 forward and 1 backward"),
        (dict(stage_forward_s=(1.0, -1.0)), "stage time -1.0"),
        (dict(stage_peak_memory_bytes=(1.0,)), "1 values for 2 stages"),
    ],
)
def test_measured_step_validation(kw, match):
    values = dict(step_time_s=1.0, pipeline_s=0.5, stage_forward_s=(1.0, 1.0), stage_backward_s=(1.0, 1.0))
    values.update(kw)
    with pytest.raises(ValueError, match=match):
        MeasuredStep(**values)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(memory_per_device=0), "memory_per_device=0"),
        (dict(compute_slots=0), "compute_slots=0"),
        (dict(zero_stage=4), "zero_stage=4"),  # 0-3 are priced (test_cluster_terms.py)
    ],
)
def test_plan_context_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        PlanContext(profile=_profile(), **kw)
