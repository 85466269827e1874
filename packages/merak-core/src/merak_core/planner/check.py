"""The plan check of a running job: predicted against measured, and a re-plan when they disagree.

:class:`PlanCheck` is the Trainer's hook (``plan_check_steps``): after warm-up it records the
pipeline runner's per-action timings and the peak memory for a few steps, gathers them to rank 0,
and hands them to :mod:`merak_core.planner.feedback` for the table and the re-plan. It gathers
numbers only; every decision lives in the feedback module.

Not done here: switching layouts in a running process (the re-plan writes a job file to restart
from the last checkpoint with).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
from typing import Any

import torch
import torch.distributed as dist

from merak_core.planner import (
    MeasuredStep,
    PlanComparison,
    PlanContext,
    Replan,
    compare,
    needs_replan,
    predict_current,
    replan,
)

logger = logging.getLogger(__name__)

__all__ = ["PlanCheck"]


def _read_status(field_name: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return float(line.split()[1]) * 1024.0  # kB
    except OSError:
        return None
    return None


class PlanCheck:
    """The Trainer's plan check (see the module docstring); build it with :meth:`for_trainer`."""

    def __init__(self, trainer: Any, context: PlanContext, steps: int) -> None:
        self.trainer, self.context, self.steps = trainer, context, steps
        self.comparison: PlanComparison | None = None
        """Rank 0, after the check: predicted against measured."""
        self.replan: Replan | None = None
        """Rank 0, after the check, when the error was above the threshold."""
        self._start: int | None = None
        self._end = self._first_measured = 0
        self._timings: list[Any] = []
        self._step_s: list[float] = []
        self._pipeline_s: list[float] = []
        self._memory_base: float | None = None
        self.done = False

    @classmethod
    def for_trainer(cls, trainer: Any, context: PlanContext | None) -> PlanCheck | None:
        steps = trainer.args.plan_check_steps or 0
        if context is None or steps == 0:
            if steps and dist.get_rank() == 0:
                logger.info("plan check: plan_check_steps=%d but no profile to predict from: pass "
                            "Trainer(plan_context=...) or use layout: auto", steps)
            return None
        kind, _ = trainer.args.recompute_mode
        if kind == "uniform":
            if dist.get_rank() == 0:
                logger.info("plan check: recompute=%r is not in the planner's model (none, full, stage_aware): off",
                            trainer.args.recompute)
            return None
        return cls(trainer, context, steps)

    def before_step(self, total_steps: int) -> None:
        t = self.trainer
        if self.done:
            return
        if self._start is None:
            self._start = t.global_step
            self._end = t.global_step + min(self.steps, total_steps - t.global_step)
            warmup = 1 if self._end - self._start < 4 else 2
            self._first_measured = self._start + warmup + 1
            if self._end < self._first_measured:
                logger.info("plan check: %d steps left, fewer than a warm-up step and a measured one: off",
                            self._end - self._start)
                self.done = True
                return
            self._reset_memory()
        if t.global_step + 1 >= self._first_measured:
            t.runner.record_timing = True

    def after_step(self, step_time_s: float) -> None:
        t = self.trainer
        if self.done or self._start is None or t.global_step < self._first_measured:
            return
        self._timings.extend(t.runner.timings)
        self._step_s.append(step_time_s)
        self._pipeline_s.append(t.last_pipeline_s)
        if t.global_step >= self._end:
            t.runner.record_timing = False
            self.done = True
            self._finish()

    # -------------------------------------------------------------- measuring

    def _reset_memory(self) -> None:
        dev = self.trainer.device
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
            return
        try:  # [Note: CPU peak memory] "5" resets the peak RSS (VmHWM) to the current RSS
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._memory_base = _read_status("VmRSS")
        except OSError:
            self._memory_base = None

    def _peak_memory(self) -> float | None:
        """This rank's peak bytes over the steps since the reset (see [Note: CPU peak memory]).

        [Note: CPU peak memory] On CPU the peak is the growth of the process's peak resident set
        (VmHWM) over its size before the first step of this run, plus the bytes of this rank's
        parameters (which existed before): gradients, optimizer states and activations appear as
        growth. It includes allocator slack and anything else the process allocated meanwhile.
        """
        t = self.trainer
        if t.device.type == "cuda":
            return float(torch.cuda.max_memory_allocated(t.device))
        peak = _read_status("VmHWM")
        if peak is None or self._memory_base is None:
            return None
        params = sum(p.numel() * p.element_size() for p in t.params)
        return max(peak - self._memory_base, 0.0) + float(params)

    def _finish(self) -> None:
        from merak_pipe.timing import gather_timings, measured_costs

        t = self.trainer
        layout = t.layout
        timings = gather_timings(self._timings, group=layout.pp_group)
        memory = torch.full((layout.pp,), -1.0, dtype=torch.float64, device=t.device)
        mine = self._peak_memory()
        memory[layout.pp_rank] = -1.0 if mine is None else mine
        dist.all_reduce(memory, op=dist.ReduceOp.MAX)
        if dist.get_rank() != 0:
            return
        try:
            costs = measured_costs(timings, t.runner.schedule)
            measured = MeasuredStep(
                step_time_s=statistics.median(self._step_s), pipeline_s=statistics.median(self._pipeline_s),
                stage_forward_s=tuple(float(x) for x in costs.forward),
                stage_backward_s=tuple(float(x) for x in costs.backward),
                stage_peak_memory_bytes=tuple(None if v < 0 else float(v) for v in memory.tolist()),
                steps=len(self._step_s))
            self._report(measured)
        except Exception as exc:  # noqa: BLE001 - the check must never stop training
            logger.warning("plan check failed: %s: %s", type(exc).__name__, exc)

    # -------------------------------------------------------------- reporting (rank 0)

    def _report(self, measured: MeasuredStep) -> None:
        t, args, ctx = self.trainer, self.trainer.args, self.context
        kind, _ = args.recompute_mode
        predicted = predict_current(
            ctx, dp=t.layout.dp, tp=t.layout.tp, pp=t.layout.pp, schedule=t.schedule_name,
            num_microbatches=args.num_microbatches, micro_batch_size=args.micro_batch_size, recompute=kind,
            memory_budget=args.memory_budget if kind == "stage_aware" else None)
        self.comparison = compare(predicted, measured)
        logger.info("%s", self.comparison.table())
        record: dict[str, Any] = {"step": t.global_step, **self.comparison.to_record()}
        error = self.comparison.step_time_error
        if needs_replan(self.comparison, args.plan_error_threshold):
            self.replan = replan(ctx, predicted, measured,
                                 global_batch_size=args.global_batch_size(t.layout.dp))
            path = os.path.join(args.output_dir, "replanned.yaml")
            if self.replan.changed:
                self._write_job(path, self.replan.best.training_fields())
            text = self.replan.message(job_path=path, has_checkpoints=bool(args.save_steps))
            logger.warning("plan check: step-time error %+.1f%% is above plan_error_threshold=%g; %s",
                           100 * error, args.plan_error_threshold, text)
            record.update(replanned=text, replanned_changed=self.replan.changed)
        else:
            logger.info("plan check: step-time error %+.1f%% is within plan_error_threshold=%g",
                        100 * error, args.plan_error_threshold)
        if t.metrics.enabled:
            with open(t.metrics.path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def _write_job(self, out: str, fields: dict[str, Any]) -> None:
        """The job file with the suggested fields (the training section alone when the run has no job file)."""
        from merak_core.job import write_job

        write_job(self.context.job_file, out, fields, overrides=self.context.job_overrides)

