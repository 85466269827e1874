"""Closing the loop: predicted against measured, a profile corrected from measurements, re-planning.

After the first steps of a real run the Trainer (see :mod:`merak_core.autoplan`) measures the
median step time, the time of the pipeline part, each stage's forward and backward seconds per
microbatch and each stage's peak memory, and hands them here as a :class:`MeasuredStep`. This
module is pure (no process group, no clocks), so every decision is testable on synthetic numbers:

- :func:`compare` puts the prediction of the running configuration (:func:`predict_current`)
  next to the measurement, row by row, with relative errors ``(predicted - measured) / measured``;
- :func:`needs_replan` decides from the step-time error and a threshold;
- :func:`correct_profile` rebuilds the :class:`ModelProfile` from the measured costs (see
  [Note: profile correction]);
- :func:`replan` runs :func:`~merak_core.planner.plan` on the corrected profile and says whether
  another configuration is now predicted to be faster, and how to switch to it.

Not done here: measuring (the Trainer does it), switching layouts in a running process (a job
switches by restarting from its last checkpoint, which reshards).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from merak_core.config.layout_choice import LayoutChoice
from merak_core.planner.candidate import Candidate, recompute_label
from merak_core.planner.comm import CommModel
from merak_core.planner.memory import ZERO_STAGES
from merak_core.planner.profile import ModelProfile
from merak_core.planner.search import plan, predict
from merak_pipe import schedule_info

__all__ = [
    "MeasuredStep",
    "PlanComparison",
    "PlanContext",
    "Replan",
    "compare",
    "correct_profile",
    "needs_replan",
    "predict_current",
    "replan",
]

_MS = 1e3
_MIB = 2.0**20
_SCALE_RANGE = (1e-3, 1e3)
"""Bounds of the correction factors (a stage measured 1000x off is a measurement problem, not a cost)."""


@dataclass(kw_only=True)
class PlanContext:
    """What the planner needs besides the configuration: the profile and the machine."""

    profile: ModelProfile
    """Per-layer costs the plan was (or would be) made from."""
    comm: CommModel = field(default_factory=CommModel)
    """Communication costs (:func:`~merak_core.planner.measure_comm` on the job's ranks)."""
    memory_per_device: float = math.inf
    """Bytes one rank may use (the planner drops what does not fit)."""
    compute_slots: float | None = None
    """Ranks that can compute at once on one host (CPU: cores / threads per rank); None: a device each."""
    zero_stage: int = 0
    """The job's ZeRO stage (0 to 3, as :func:`~merak_core.planner.predict` prices them)."""
    optimizer_state_factor: float = 2.0
    """Optimizer-state bytes per parameter byte (2 for AdamW)."""
    virtual_stages: tuple[int, ...] = (1,)
    """Stages per pipeline rank the re-plan tries (:func:`~merak_core.planner.plan`'s ``virtual_stages``)."""
    job_file: str | None = None
    """The job file the run came from; the re-plan writes a copy with the suggested fields."""
    job_overrides: tuple[str, ...] = ()
    """``section.key=value`` overrides the run was started with (kept in the suggested job file)."""

    def __post_init__(self) -> None:
        if not self.memory_per_device > 0:
            raise ValueError(
                f"PlanContext.memory_per_device={self.memory_per_device!r}: expected bytes > 0 "
                "(math.inf: no limit)"
            )
        if self.compute_slots is not None and (
            isinstance(self.compute_slots, bool)
            or not isinstance(self.compute_slots, (int, float))
            or not 1 <= self.compute_slots < math.inf
        ):
            raise ValueError(
                f"PlanContext.compute_slots={self.compute_slots!r}: expected a number >= 1 or None "
                "(every rank has its own device)"
            )
        if self.zero_stage not in ZERO_STAGES:
            raise ValueError(f"PlanContext.zero_stage={self.zero_stage!r}: expected one of {ZERO_STAGES}")


@dataclass(frozen=True, kw_only=True)
class MeasuredStep:
    """What a run measured over its check steps (medians and means over the steps after warm-up)."""

    step_time_s: float
    """Median wall time of one optimizer step."""
    pipeline_s: float
    """Median time of the pipeline part of a step (the schedule's forwards and backwards)."""
    stage_forward_s: tuple[float, ...]
    """Per stage: seconds of one microbatch's forward (merak_pipe.timing.measured_costs)."""
    stage_backward_s: tuple[float, ...]
    """Per stage: seconds of one microbatch's backward, recomputation excluded."""
    stage_peak_memory_bytes: tuple[float | None, ...] = ()
    """Per stage: peak bytes of the rank (None: not measurable here); empty: not measured."""
    steps: int = 1
    """How many steps the medians are over."""

    def __post_init__(self) -> None:
        for name in ("step_time_s", "pipeline_s"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"MeasuredStep.{name}={v!r}: expected finite seconds > 0")
        n = len(self.stage_forward_s)
        if n < 1 or len(self.stage_backward_s) != n:
            raise ValueError(
                f"MeasuredStep: {n} forward and {len(self.stage_backward_s)} backward stage times; "
                "expected one of each per stage (at least one stage)"
            )
        for v in (*self.stage_forward_s, *self.stage_backward_s):
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"MeasuredStep: stage time {v!r}; expected finite seconds >= 0")
        if self.stage_peak_memory_bytes and len(self.stage_peak_memory_bytes) != n:
            raise ValueError(
                f"MeasuredStep.stage_peak_memory_bytes has {len(self.stage_peak_memory_bytes)} values "
                f"for {n} stages: give one per stage (None where unavailable) or none"
            )

    @property
    def outside_pipeline_s(self) -> float:
        """Step time not spent in the pipeline (DP all-reduce wait, clipping, optimizer, loss all-reduce)."""
        return max(self.step_time_s - self.pipeline_s, 0.0)


@dataclass(frozen=True)
class _Row:
    name: str
    unit: str
    predicted: float
    measured: float | None

    @property
    def error(self) -> float | None:
        if self.measured is None or not self.measured > 0:
            return None
        return (self.predicted - self.measured) / self.measured


@dataclass(frozen=True)
class PlanComparison:
    """Predicted against measured, row by row; ``error`` is (predicted - measured) / measured."""

    candidate: Candidate
    measured: MeasuredStep
    rows: tuple[_Row, ...]

    @property
    def step_time_error(self) -> float:
        return (self.candidate.step_time_s - self.measured.step_time_s) / self.measured.step_time_s

    def errors(self) -> dict[str, float | None]:
        """Relative error by row name."""
        return {r.name: r.error for r in self.rows}

    def table(self) -> str:
        c = self.candidate
        lines = [
            f"plan check over {self.measured.steps} steps: {_describe(c)}",
            f"{'':<34} {'predicted':>11} {'measured':>11} {'error':>8}",
        ]
        for r in self.rows:
            scale = _MS if r.unit == "ms" else 1 / _MIB
            meas = "n/a" if r.measured is None else f"{r.measured * scale:.3f}"
            err = "n/a" if r.error is None else f"{100 * r.error:+.1f}%"
            lines.append(
                f"{r.name + ' (' + r.unit + ')':<34} {r.predicted * scale:>11.3f} {meas:>11} {err:>8}"
            )
        return "\n".join(lines)

    def to_record(self) -> dict[str, Any]:
        """Flat numbers for metrics.jsonl (seconds and bytes; errors as fractions; None: n/a)."""
        out: dict[str, Any] = {
            "plan_check": _describe(self.candidate),
            "plan_check_steps": self.measured.steps,
        }
        for r in self.rows:
            key = r.name.replace(" ", "_")
            suffix = "_s" if r.unit == "ms" else "_bytes"
            out[f"predicted_{key}{suffix}"] = r.predicted
            out[f"measured_{key}{suffix}"] = r.measured
            out[f"error_{key}"] = r.error
        return out


def _describe(c: Candidate) -> str:
    rc = recompute_label(c)
    return f"{c.layout} {c.schedule_label} m={c.num_microbatches} mbs={c.micro_batch_size} recompute={rc}"


def predict_current(
    ctx: PlanContext,
    choice: LayoutChoice,
    *,
    memory_budget: float | None = None,
    profile: ModelProfile | None = None,
) -> Candidate:
    """:func:`~merak_core.planner.predict` of ``choice`` with the context's machine and ZeRO stage.

    The choice's ``schedule`` may be spelled with hyphens; ``memory_budget`` is the stage-aware budget
    (default: the context's memory per device); ``profile`` replaces the context's.
    """
    return predict(
        profile or ctx.profile,
        dataclasses.replace(choice, schedule=schedule_info(choice.schedule).key, zero_stage=ctx.zero_stage),
        comm=ctx.comm,
        optimizer_state_factor=ctx.optimizer_state_factor,
        memory_per_device=float(memory_budget) if memory_budget is not None else ctx.memory_per_device,
        compute_slots=ctx.compute_slots,
    )


def _repredict(ctx: PlanContext, c: Candidate, profile: ModelProfile) -> Candidate:
    budget = c.memory_per_device if c.recompute == "stage_aware" and c.memory_per_device > 0 else None
    return predict_current(ctx, c.choice(), memory_budget=budget, profile=profile)


def compare(predicted: Candidate, measured: MeasuredStep) -> PlanComparison:
    """Rows: step time, pipeline, outside the pipeline, then per stage F, B (per microbatch) and peak memory."""
    num_stages = len(predicted.stage_forward_s)  # pp * virtual stages
    if len(measured.stage_forward_s) != num_stages:
        raise ValueError(
            f"compare: the measurement has {len(measured.stage_forward_s)} stages but the prediction "
            f"{predicted.layout} has pp={predicted.pp}"
            + (f" x {predicted.virtual_stages} virtual stages" if predicted.virtual_stages > 1 else "")
            + ": measure the configuration that was predicted"
        )
    rows = [
        _Row("step time", "ms", predicted.step_time_s, measured.step_time_s),
        _Row("pipeline", "ms", predicted.pipeline_s, measured.pipeline_s),
        _Row(
            "outside pipeline",
            "ms",
            predicted.step_time_s - predicted.pipeline_s,
            measured.outside_pipeline_s,
        ),
    ]
    for s in range(num_stages):
        rows.append(_Row(f"stage {s} F", "ms", predicted.stage_forward_s[s], measured.stage_forward_s[s]))
        rows.append(_Row(f"stage {s} B", "ms", predicted.stage_backward_s[s], measured.stage_backward_s[s]))
    # Memory is measured per pipeline rank (one stage each, or its virtual stages together).
    device = predicted.device_peak_bytes or predicted.peak_memory_bytes
    label = "stage" if predicted.virtual_stages == 1 else "rank"
    for r in range(predicted.pp):
        mem = measured.stage_peak_memory_bytes[r] if measured.stage_peak_memory_bytes else None
        rows.append(_Row(f"{label} {r} peak memory", "MiB", device[r], mem))
    return PlanComparison(predicted, measured, tuple(rows))


def needs_replan(comparison: PlanComparison, threshold: float) -> bool:
    """Whether the step-time error is larger than ``threshold`` (a fraction, e.g. 0.25) either way."""
    if not threshold >= 0:
        raise ValueError(f"needs_replan: threshold={threshold!r}; expected a fraction >= 0 such as 0.25")
    return abs(comparison.step_time_error) > threshold


def _scaled(
    profile: ModelProfile, fwd: Sequence[float], bwd: Sequence[float], g: float = 1.0
) -> ModelProfile:
    return dataclasses.replace(
        profile, layer_forward_s=[g * f for f in fwd], layer_backward_s=[g * b for b in bwd]
    )


def _clamp(k: float) -> float:
    return min(max(k, _SCALE_RANGE[0]), _SCALE_RANGE[1])


def correct_profile(ctx: PlanContext, predicted: Candidate, measured: MeasuredStep) -> ModelProfile:
    """The context's profile with its costs corrected so that it predicts what was measured.

    [Note: profile correction]
    1. Per stage and direction, the prediction is affine in the layer costs: ``F_s = fixed_s +
       var_s`` (fixed: per-microbatch overhead and TP communication). ``fixed_s`` and ``var_s`` come
       from predicting with every layer cost doubled (the split of layers over stages stays the
       same), and each layer of stage ``s`` (by ``predicted.stage_layers``) is scaled by
       ``(measured_s - fixed_s) / var_s``.
    2. The time outside the pipeline (optimizer, clipping, loss all-reduce, DP all-reduce wait)
       goes into the per-step overhead (``optimizer_s_per_byte``, affine likewise).
    3. One common factor on every layer makes the predicted pipeline time equal the measured one
       (bisection; 1 when the simulator reproduces the measured stage times exactly, below 1 when
       the measured stage times already include the slow-down of ranks sharing CPU cores, which
       the prediction adds again).
    So ``predict()`` of the measured configuration gives back the measured step time, except where
    a part of the prediction that is not scaled already exceeds the measurement: the fixed part of
    the pipeline (per-microbatch overhead, TP all-reduces from the communication model) or the
    DP all-reduce and all-reduces outside it; then the layer costs go to the lower bound of
    ``_SCALE_RANGE`` (or the optimizer cost to 0) and the prediction stays above the measurement,
    but closer to it. When the corrected costs move the planner's cut between layers, the
    re-predicted stage times follow the new cut (the planner always balances the split).
    """
    prof = ctx.profile
    if len(measured.stage_forward_s) != predicted.pp or len(predicted.stage_layers) != predicted.pp:
        raise ValueError(
            f"correct_profile: the measurement has {len(measured.stage_forward_s)} stages but "
            f"{predicted.layout} has pp={predicted.pp}"
        )
    base = _repredict(ctx, predicted, prof)
    double = _repredict(ctx, predicted, _scaled(prof, prof.layer_forward_s, prof.layer_backward_s, 2.0))
    fwd, bwd = list(prof.layer_forward_s), list(prof.layer_backward_s)
    start = 0
    for s, n in enumerate(predicted.stage_layers):
        for one, two, meas, layers in (
            (base.stage_forward_s[s], double.stage_forward_s[s], measured.stage_forward_s[s], fwd),
            (base.stage_backward_s[s], double.stage_backward_s[s], measured.stage_backward_s[s], bwd),
        ):
            var = two - one
            k = _clamp((meas - (one - var)) / var) if var > 0 else 1.0
            for i in range(start, start + n):
                layers[i] *= k
        start += n
    out = _scaled(prof, fwd, bwd)
    if hasattr(out, "optimizer_s_per_byte"):
        out = _correct_overhead(ctx, predicted, out, measured.outside_pipeline_s)

    def pipeline(g: float) -> float:
        return _repredict(ctx, predicted, _scaled(out, fwd, bwd, g)).pipeline_s

    lo, hi = _SCALE_RANGE
    target = measured.pipeline_s
    if pipeline(lo) >= target:
        g = lo
    elif pipeline(hi) <= target:
        g = hi
    else:
        g = 1.0
        for _ in range(60):  # bisection in log space: the pipeline time is increasing in g
            g = math.sqrt(lo * hi)
            value = pipeline(g)
            if abs(value - target) <= 1e-9 * target:
                break
            lo, hi = (g, hi) if value < target else (lo, g)
    return _scaled(out, fwd, bwd, g)


def _correct_overhead(
    ctx: PlanContext, predicted: Candidate, prof: ModelProfile, outside_s: float
) -> ModelProfile:
    """Set ``optimizer_s_per_byte`` so that the predicted time outside the pipeline equals ``outside_s``."""
    delta = 1e-9
    zero = _repredict(ctx, predicted, dataclasses.replace(prof, optimizer_s_per_byte=0.0))
    some = _repredict(ctx, predicted, dataclasses.replace(prof, optimizer_s_per_byte=delta))
    outside = lambda c: c.step_time_s - c.pipeline_s  # noqa: E731
    slope = (outside(some) - outside(zero)) / delta
    if slope <= 0:
        return prof
    return dataclasses.replace(prof, optimizer_s_per_byte=max((outside_s - outside(zero)) / slope, 0.0))


@dataclass(frozen=True)
class Replan:
    """The outcome of re-planning from measured costs."""

    current: Candidate
    """The running configuration, predicted from the corrected profile."""
    candidates: tuple[Candidate, ...]
    """Every feasible configuration from the corrected profile, best first (empty: nothing fits)."""
    profile: ModelProfile
    """The corrected profile."""
    error: str = ""
    """Why there are no candidates (plan's ValueError), if so."""
    min_gain: float = 0.05
    """A different configuration counts as better only when predicted at least this much faster."""

    @property
    def best(self) -> Candidate:
        return self.candidates[0] if self.candidates else self.current

    @property
    def changed(self) -> bool:
        """Whether the best configuration differs from the running one and is ``min_gain`` faster."""
        return (
            self.best.choice() != self.current.choice()
            and self.best.step_time_s < (1 - self.min_gain) * self.current.step_time_s
        )

    def message(self, *, job_path: str | None = None, has_checkpoints: bool = True) -> str:
        """What the run logs: the new best against the current, and how to switch.

        ``job_path``: where the suggested job file was written (the Trainer writes
        ``output_dir/replanned.yaml``); None: the message asks for a job file with the fields.
        """
        b, c = self.best, self.current
        text = (
            f"re-planned from measured costs: best is now {_describe(b)} (predicted {b.step_time_s * _MS:.3f} ms) "
            f"vs the current {_describe(c)} (predicted {c.step_time_s * _MS:.3f} ms)"
        )
        if self.error:
            return text + f"; the re-plan found nothing else that fits: {self.error}"
        if not self.changed:
            return text + (
                f"; the current configuration stays the best (nothing predicted {100 * self.min_gain:.0f}% "
                "faster): nothing to change"
            )
        fields = " ".join(f"{k}={v}" for k, v in b.training_fields().items())
        where = job_path or "NEW.yaml"
        text += (
            f"; to switch, set training: {fields} ({'written to ' + where if job_path else 'in a job file'}) "
            f"and run `merak train {where} --resume latest`: it restarts from the last checkpoint in the new "
            "layout (checkpoints reshard)"
        )
        if not has_checkpoints:
            text += "; this run saves no checkpoints (set save_steps), so it would start from scratch"
        return text


def replan(
    ctx: PlanContext,
    predicted: Candidate,
    measured: MeasuredStep,
    *,
    global_batch_size: int | None = None,
    max_microbatches: int = 64,
) -> Replan:
    """Correct the profile from ``measured`` (:func:`correct_profile`) and plan again for the same ranks and batch.

    ``global_batch_size`` defaults to the predicted configuration's (dp x microbatches x micro batch size).
    """
    if global_batch_size is None:
        global_batch_size = predicted.dp * predicted.num_microbatches * predicted.micro_batch_size
    corrected = correct_profile(ctx, predicted, measured)
    current = _repredict(ctx, predicted, corrected)
    try:
        cands = plan(
            corrected,
            world_size=predicted.dp * predicted.cp * predicted.tp * predicted.pp,
            memory_per_device=ctx.memory_per_device,
            global_batch_size=global_batch_size,
            comm=ctx.comm,
            zero_stage=ctx.zero_stage,
            optimizer_state_factor=ctx.optimizer_state_factor,
            max_microbatches=max_microbatches,
            compute_slots=ctx.compute_slots,
            virtual_stages=ctx.virtual_stages,
            cp_degrees=(predicted.cp,),  # the run's cp group (its model and sequence were checked for it)
            cp_mode=predicted.cp_mode,
            ep_degrees=sorted({1, predicted.ep}),  # the run's ep (checked for its model), or none
        )
    except ValueError as exc:
        return Replan(current=current, candidates=(), profile=corrected, error=str(exc))
    return Replan(current=current, candidates=tuple(cands), profile=corrected)
