"""The plan check of a running job: predicted against measured, and a re-plan when they disagree.

:class:`PlanCheck` is the Trainer's hook (``plan_check_steps``): after warm-up it records the
pipeline runner's per-action timings and the peak memory for a few steps, gathers them to rank 0,
and hands them to :mod:`merak_core.planner.feedback` for the table and the re-plan. It gathers
numbers only; every decision lives in the feedback module.

Not done here: switching layouts in a running process (the re-plan writes a job file to restart
from the last checkpoint with).
"""

from __future__ import annotations

import logging
import os
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from merak_core.config.layout_choice import LayoutChoice
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
    """The Trainer's plan check (see the module docstring); build it with :meth:`for_run`.

    ``run`` is what the check reads about the job: ``args``, ``layout``, ``device``, ``schedule_name``,
    ``schedule`` (the runner's schedule) and ``param_bytes()`` (a :class:`merak_core.run.engine.ParallelEngine`).
    The caller drives it around each step: :meth:`before_step` says whether that step should record the
    runner's timings, :meth:`after_step` takes the step's :class:`~merak_core.run.step_values.StepResult`. The
    record of the check goes to ``sink`` (rank 0; e.g. the metrics file).
    """

    def __init__(
        self,
        run: Any,
        context: PlanContext,
        steps: int,
        *,
        sink: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.run, self.context, self.steps, self.sink = run, context, steps, sink
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
        self._meter: Any = None
        self._meter_bytes: float | None = None
        self.done = False

    @classmethod
    def for_run(
        cls, run: Any, context: PlanContext | None, *, sink: Callable[[dict[str, Any]], None] | None = None
    ) -> PlanCheck | None:
        """The check for ``run``'s ``plan_check_steps``, or None when it is off (no context, 0 steps, uniform)."""
        args = run.args
        steps = args.plan_check_steps or 0
        if context is None or steps == 0:
            if steps and dist.get_rank() == 0:
                logger.info(
                    "plan check: plan_check_steps=%d but no profile to predict from: pass "
                    "Trainer(plan_context=...) or use layout: auto",
                    steps,
                )
            return None
        kind, _ = args.recompute_mode
        if kind == "uniform":
            if dist.get_rank() == 0:
                logger.info(
                    "plan check: recompute=%r is not in the planner's model (none, full, stage_aware): off",
                    args.recompute,
                )
            return None
        return cls(run, context, steps, sink=sink)

    def before_step(self, step: int, total_steps: int) -> bool:
        """Before the step after ``step`` (the steps done so far): whether it should record timings."""
        if self.done:
            return False
        if self._start is None:
            self._start = step
            self._end = step + min(self.steps, total_steps - step)
            warmup = 1 if self._end - self._start < 4 else 2
            self._first_measured = self._start + warmup + 1
            if self._end < self._first_measured:
                logger.info(
                    "plan check: %d steps left, fewer than a warm-up step and a measured one: off",
                    self._end - self._start,
                )
                self.done = True
                return False
            self._reset_memory()
        if step + 1 == self._first_measured and self.run.device.type != "cuda":
            self._start_meter()
        return step + 1 >= self._first_measured

    def after_step(self, step: int, result: Any, step_time_s: float) -> None:
        """After step number ``step`` with its :class:`~merak_core.run.step_values.StepResult` (collective at the last)."""
        if self.done or self._start is None or step < self._first_measured:
            return
        if self._meter is not None:
            self._stop_meter()
        self._timings.extend(result.timings)
        self._step_s.append(step_time_s)
        self._pipeline_s.append(result.pipeline_s)
        if step >= self._end:
            self.done = True
            self._finish(step)

    # -------------------------------------------------------------- measuring

    def _stage_modules(self) -> dict[int, Any]:
        model = self.run.model
        return dict(model.stage_modules) or {self.run.layout.pp_rank: model.module}

    def _start_meter(self) -> None:
        from merak_core.planner.memory_meter import SavedActivationMeter

        self._meter = SavedActivationMeter(self._stage_modules())
        self._meter.start()

    def _stop_meter(self) -> None:
        """[Note: CPU peak memory] The first measured step's saved activations (peak over this rank's
        stages) plus the parameter, gradient and optimizer bytes held after it."""
        from merak_core.planner.memory_meter import measure_held_bytes

        meter, self._meter = self._meter, None
        meter.stop()
        held = measure_held_bytes(self._stage_modules(), getattr(self.run, "optimizer", None))
        self._meter_bytes = float(meter.rank_peak + sum(sum(v) for v in held.values()))

    def _reset_memory(self) -> None:
        dev = self.run.device
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

        [Note: CPU peak memory] On CPU the peak is counted, not read from the process: the bytes of
        the tensors autograd saved during the first measured step (saved-tensor hooks,
        :class:`merak_core.planner.memory_meter.SavedActivationMeter`) plus the parameters, gradients and
        optimizer states held after it, the terms the planner predicts. Where that count is missing,
        it is the growth of the process's peak resident set (VmHWM) over its size before the first
        step, plus the parameter bytes (allocator slack and anything else the process allocated
        included). On CUDA it is the allocator's peak (``torch.cuda.max_memory_allocated``).
        """
        dev = self.run.device
        if dev.type == "cuda":
            return float(torch.cuda.max_memory_allocated(dev))
        if self._meter_bytes is not None:
            return self._meter_bytes
        peak = _read_status("VmHWM")
        if peak is None or self._memory_base is None:
            return None
        return max(peak - self._memory_base, 0.0) + float(self.run.param_bytes())

    def _finish(self, step: int) -> None:
        from merak_pipe.timing import gather_timings, measured_costs

        run = self.run
        layout = run.layout
        timings = gather_timings(self._timings, group=layout.pp_group)
        memory = torch.full((layout.pp,), -1.0, dtype=torch.float64, device=run.device)
        mine = self._peak_memory()
        memory[layout.pp_rank] = -1.0 if mine is None else mine
        dist.all_reduce(memory, op=dist.ReduceOp.MAX)
        if dist.get_rank() != 0:
            return
        try:
            costs = measured_costs(timings, run.schedule)
            measured = MeasuredStep(
                step_time_s=statistics.median(self._step_s),
                pipeline_s=statistics.median(self._pipeline_s),
                stage_forward_s=tuple(float(x) for x in costs.forward),
                stage_backward_s=tuple(float(x) for x in costs.backward),
                stage_peak_memory_bytes=tuple(None if v < 0 else float(v) for v in memory.tolist()),
                steps=len(self._step_s),
            )
            self._report(measured, step)
        except Exception as exc:  # noqa: BLE001 - the check must never stop training
            logger.warning("plan check failed: %s: %s", type(exc).__name__, exc)

    # -------------------------------------------------------------- reporting (rank 0)

    def _report(self, measured: MeasuredStep, step: int) -> None:
        run, args, ctx = self.run, self.run.args, self.context
        kind, _ = args.recompute_mode
        as_set = {k: getattr(args, k) for k in ("virtual_stages", "zero_stage", "cp", "cp_mode", "ep")}
        batching: dict[str, Any] = dict(
            num_microbatches=args.num_microbatches, micro_batch_size=args.micro_batch_size
        )
        layout = run.layout
        running = LayoutChoice(
            dp=layout.dp,
            tp=layout.tp,
            pp=layout.pp,
            schedule=run.schedule_name,
            recompute=kind,
            **batching,
            **as_set,
        )
        predicted = predict_current(
            ctx, running, memory_budget=args.memory_budget if kind == "stage_aware" else None
        )
        self.comparison = compare(predicted, measured)
        logger.info("%s", self.comparison.table())
        record: dict[str, Any] = {"step": step, **self.comparison.to_record()}
        error = self.comparison.step_time_error
        if needs_replan(self.comparison, args.plan_error_threshold):
            self.replan = replan(
                ctx, predicted, measured, global_batch_size=args.global_batch_size(run.layout.dp)
            )
            path = os.path.join(args.output_dir, "replanned.yaml")
            if self.replan.changed:
                self._write_job(path, self.replan.best)
            text = self.replan.message(job_path=path, has_checkpoints=bool(args.save_steps))
            logger.warning(
                "plan check: step-time error %+.1f%% is above plan_error_threshold=%g; %s",
                100 * error,
                args.plan_error_threshold,
                text,
            )
            record.update(replanned=text, replanned_changed=self.replan.changed)
        else:
            logger.info(
                "plan check: step-time error %+.1f%% is within plan_error_threshold=%g",
                100 * error,
                args.plan_error_threshold,
            )
        if self.sink is not None:
            self.sink(record)

    def _write_job(self, out: str, choice: LayoutChoice) -> None:
        """The job file with the suggested choice (the training section alone when the run has no job file)."""
        from merak_core.job import write_job

        write_job(self.context.job_file, out, choice, overrides=self.context.job_overrides)
