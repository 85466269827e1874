"""The Trainer: 3D-parallel training of an ordinary model, Hugging Face style.

::

    trainer = Trainer(model, TrainingArguments(dp=2, tp=2, pp=2, ...), train_dataset, eval_dataset)
    trainer.train()
    metrics = trainer.evaluate()

The Trainer is the loop: it assembles a prepared run (:func:`merak_core.autoplan.prepare.prepare_run`:
the layout, the device, the composed model, the engine; :meth:`Trainer.from_prepared` takes one that
:func:`~merak_core.autoplan.prepare.prepare_job` built from a job file), hands each global batch to the step engine (:class:`merak_core.run.engine.ParallelEngine`:
one optimizer step, see [Note: loss scaling], [Note: failures] and [Note: non-finite steps and
signals] there), and keeps the cadence of evaluation, metrics and checkpoints
(:class:`merak_core.run.cadence.Cadence` says after which steps).

[Note: plan check] With ``layout: auto`` the builder first lets the planner choose the layout
(collective, :func:`merak_core.autoplan.auto.plan_for_job`; the Trainer never plans); with
``plan_check_steps`` the Trainer records
the runner's timings and the peak memory for a few steps and hands them to
:class:`merak_core.autoplan.check.PlanCheck`, which logs predicted against measured and re-plans.
The steps themselves are unchanged (only the pipeline part is timed).

Not done here: preparing the run (``autoplan/prepare.py``), the step (``run/engine.py``), start-up
(``run/bootstrap.py``), tracing and sharding (``parallel/compose.py``), the layout
(``parallel/layout.py``), data sharding (``data/loader.py``), the planner (``planner/``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from merak_core.autoplan.prepare import PreparedRun, RunOptions, prepare_run
from merak_core.checkpoint import CheckpointManager
from merak_core.checkpoint.parts import CheckpointParts, TrainState
from merak_core.config import TrainingArguments
from merak_core.data.batch_ids import sample_namer
from merak_core.data.loader import StageAwareDataLoader
from merak_core.generation.run_api import GenerateMixin
from merak_core.parallel.compose import ParallelModel, gather_full_state_dict
from merak_core.run import nonfinite
from merak_core.run.cadence import Cadence, StepRecords, count_tokens, training_steps
from merak_core.run.engine import (
    LossFn,
    default_loss,
    schedule_name,
)
from merak_core.run.evaluation import evaluate_loader, shapes_specialised
from merak_core.run.metrics import MetricsWriter
from merak_core.run.signals import StopRequest, TrainingPreempted
from merak_core.run.stall import Heartbeat
from merak_core.run.step_values import StepResult, TrainingStepError
from merak_core.run.trainer_views import EngineViews

if TYPE_CHECKING:
    from typing_extensions import Unpack

logger = logging.getLogger(__name__)

MetricsFn = Callable[[torch.Tensor, torch.Tensor], Mapping[str, torch.Tensor]]

__all__ = ["LossFn", "MetricsFn", "Trainer", "TrainingStepError", "default_loss", "schedule_name"]


class Trainer(GenerateMixin, EngineViews):
    """Train ``model`` with the 3D layout in ``args`` (see the module docstring).

    Args:
        model: an ordinary ``nn.Module``, identical on every rank (same seed), or built
            under ``merak_graph.empty_init()`` (then only this rank's stage is allocated).
        args: the run's :class:`TrainingArguments`.
        train_dataset, eval_dataset: map-style or iterable datasets whose collated batches
            split into ``(inputs, labels)`` (a dict with ``"labels"``, or a pair).
        loss_fn: ``loss_fn(output, labels) -> scalar``; default :func:`default_loss`.
        data_collator: the collate function (default: torch's ``default_collate``).
        compute_metrics: ``fn(output, labels) -> {name: per-example values}``, averaged by ``evaluate``.
        layout: an existing :class:`ParallelLayout` (default: :func:`merak_core.init` from ``args``).
        example_inputs: one microbatch of inputs for tracing (default: read from ``train_dataset``).
        init_fn: initialiser for a model built under ``empty_init()``.
        optimizer_factory: ``fn(param_groups) -> Optimizer`` (default: AdamW from ``args``).
        plan_context: the planner's profile and machine, for the plan check (``plan_check_steps``);
            ``layout: auto`` builds it (:func:`merak_core.autoplan.prepare.prepare_run` plans first).
        pretrained: a Hugging Face folder (``config.json`` + safetensors) whose weights the model starts
            from; ``model=None`` builds the model from its ``config.json`` on the meta device. Each rank
            reads only its TP slices of its own stage (:mod:`merak_core.hf`); ``export_hf_dir`` and
            ``merak export`` copy the folder's config and tokenizer files.
        lora: train low-rank adapters on the frozen model (:mod:`merak_core.lora`); ``export_hf_dir``
            then writes a PEFT adapter folder.
    """

    def __init__(
        self,
        model: nn.Module | None,
        args: TrainingArguments,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        loss_fn: LossFn | None = None,
        data_collator: Callable[[list[Any]], Any] | None = None,
        **options: Unpack[RunOptions],  # keyword-only: compute_metrics to lora (Args above)
    ) -> None:
        # plans first with layout: auto (the Trainer itself never plans)
        prepared = prepare_run(model, args, train_dataset, eval_dataset, loss_fn, data_collator, **options)
        self._assemble(prepared)

    @classmethod
    def from_prepared(cls, prepared: PreparedRun) -> Trainer:
        """The Trainer of a run :func:`~merak_core.autoplan.prepare.prepare_job` prepared from a job."""
        trainer = cls.__new__(cls)
        trainer._assemble(prepared)
        return trainer

    def _assemble(self, run: PreparedRun) -> None:
        """Take the prepared run's parts and add the loop's own state, metrics, checkpoints and plan check."""
        args = self.args = run.args
        self.layout, self.device, self.engine = run.layout, run.device, run.engine
        self.cp_run, self.loss_fn, self.id_ranges = run.cp_run, run.loss_fn, run.id_ranges
        self.samples = run.samples
        self.pretrained_path = run.pretrained_path
        """The Hugging Face folder the run started from (recorded in checkpoints for ``merak export``)."""
        self.compute_metrics = run.compute_metrics
        self.data_collator = run.data_collator
        self.train_dataset, self.eval_dataset = run.train_dataset, run.eval_dataset
        self.train_loader = run.train_loader
        plan_context = run.plan_context
        self.train_state = TrainState()
        self.skipped_steps = 0
        self.last_step_skipped = False
        self.stop_agreed = False
        self.last_result: StepResult | None = None
        self._stop = StopRequest()
        self.history: list[dict[str, float]] = []
        self.last_eval: dict[str, float] = {}
        self.metrics = MetricsWriter(
            args.output_dir, enabled=dist.get_rank() == 0, report_to=args.report_to, run_config=args.to_dict()
        )
        e = self.engine
        self.checkpoint_parts = CheckpointParts(
            args=args,
            layout=self.layout,
            device=self.device,
            model=e.model,
            optimizer=e.optimizer,
            lr_scheduler=e.lr_scheduler,
            train_loader=self.train_loader,
            train=self.train_state,
            pretrained=self.pretrained_path,
        )
        self.checkpoints = CheckpointManager(self.checkpoint_parts)
        from merak_core.autoplan.check import PlanCheck

        self.plan_context = plan_context
        self._eval_specialised: bool | None = None
        self.plan_check = PlanCheck.for_run(self.engine, plan_context, sink=self.metrics.append)

    # ------------------------------------------------------------------ the engine's parts

    @property
    def model(self) -> ParallelModel:
        """This rank's composed model."""
        return self.engine.model

    # ------------------------------------------------------------------ sizes

    def num_training_steps(self) -> int:
        return training_steps(self.args, self.train_loader)

    # ------------------------------------------------------------------ training

    def training_step(self, inputs: Any, labels: Any, *, record_timing: bool = False) -> float:
        """One optimizer step on this rank's part of a global batch; the global mean loss on every rank.

        See :meth:`merak_core.run.engine.ParallelEngine.step`: ``nonfinite: stop`` raises
        :class:`merak_core.run.nonfinite.NonFiniteError`; ``skip`` drops the update (``last_step_skipped``);
        a stop request on any rank sets ``stop_agreed`` after the update. The step's whole result
        is ``last_result``. Returning the loss reads it from the device (the loop reads it only when it logs).
        """
        return self._step(inputs, labels, record_timing=record_timing).loss

    def _step(
        self,
        inputs: Any,
        labels: Any,
        *,
        record_timing: bool,
        ids_checked: int | None = None,
        read_here: bool = False,
    ) -> StepResult:
        """:meth:`training_step` without reading the loss (see [Note: device-side skip] in run.nonfinite).

        ``read_here``: the batch holds this cp rank's tokens already (``ContextParallelRun.read_here``)."""
        step = self.global_step + 1
        cp_context: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        if self.cp_run is not None:  # this rank's tokens of the batch; attention over the cp group
            inputs, labels = self.cp_run.split(inputs, labels, read_here=read_here)
            cp_context = self.cp_run.active()
        with cp_context, self._rewind_on_nonfinite():
            result = self.engine.step(
                inputs,
                labels,
                step=step,
                stop_requested=self._stop.requested,
                record_timing=record_timing,
                ids_checked=ids_checked,
            )
        self.last_result = result
        self.stop_agreed = result.stop_agreed
        self.last_step_skipped = result.skipped
        if result.skipped:
            self.skipped_steps += 1
            if dist.get_rank() == 0:
                logger.warning(
                    "step %d skipped (nonfinite: skip): loss %r, gradient norm %r; %d step(s) skipped so far",
                    step,
                    result.loss,
                    result.grad_norm,
                    self.skipped_steps,
                )
        self.global_step += 1
        return result

    @contextlib.contextmanager
    def _rewind_on_nonfinite(self) -> Any:
        """A non-finite step found after later ones ran (their updates dropped on the device): the run is
        back at the step before it, as the parameters are (its records and the later ones dropped)."""
        try:
            yield
        except nonfinite.NonFiniteError as exc:
            if exc.step is not None and exc.step <= self.global_step:
                self.global_step = exc.step - 1
                self.history[:] = [h for h in self.history if h["step"] < exc.step]
            raise

    def _settle(self) -> None:
        """Before a step's numbers are logged, saved or evaluated: the engine reads the flags it has not read."""
        with self._rewind_on_nonfinite():
            self.stop_agreed = self.engine.settle() or self.stop_agreed

    def _describe_rank(self, rank: int) -> str:
        pp_rank, dp_rank, tp_rank = self.layout.coords_of(rank)
        return f"rank {rank} (pp_rank {pp_rank}, dp_rank {dp_rank}, tp_rank {tp_rank})"

    def train(self) -> list[dict[str, float]]:
        """Run ``max_steps`` (or ``num_train_epochs``) optimizer steps; returns the logged history.

        SIGTERM or SIGINT on any rank stops every rank after the same step, with a preemption
        checkpoint: :class:`merak_core.run.signals.TrainingPreempted` (see [Note: preemption]).
        """
        if self.train_loader is None:
            raise ValueError("Trainer.train() needs a train_dataset")
        total = self.num_training_steps()
        args = self.args
        self.checkpoints.check_fresh_start()  # a new run must not overwrite an earlier run's checkpoints
        if self.global_step >= total and dist.get_rank() == 0:  # e.g. a finished job resumed: nothing to do
            logger.warning(
                "nothing to train: the run is already at step %d of %d, the job is finished (raise "
                "training.max_steps to train longer)",
                self.global_step,
                total,
            )
        self.metrics.start(total, resumed_step=self.global_step)
        cadence = Cadence.of(args, evaluates=self.eval_dataset is not None)
        heartbeat = Heartbeat.for_timeout(
            dist.get_rank(),
            dist.get_world_size(),
            self.layout.timeout.total_seconds(),
            describe=self._describe_rank,
        )
        self.engine.heartbeat = heartbeat
        start_step = self.global_step
        try:
            with self._stop, heartbeat:
                self._train_loop(self.train_loader, total, cadence)
        finally:
            self.engine.heartbeat = None
        self._check_some_step_applied(start_step)
        if cadence.final_eval_due(self.global_step):
            self._evaluate_in_training(self.global_step)
        if cadence.final_save_due(self.global_step):
            self.checkpoints.save()
        if args.export_hf_dir is not None:
            from merak_core.hf import export_hf

            if self.model.lora is not None:
                from merak_core.hf.adapters import export_adapters

                export_adapters(self.model, args.export_hf_dir, base=self.pretrained_path)  # a PEFT folder
            else:
                export_hf(self.checkpoint_parts, args.export_hf_dir)  # the live parameters
        self.metrics.finish()
        return self.history

    def _train_loop(self, loader: StageAwareDataLoader, total: int, cadence: Cadence) -> None:
        iterator = iter(loader)  # resumes at the loader's restored position
        records = StepRecords(self.history)  # filled as the steps' numbers reach the host
        window_start, window_tokens = time.perf_counter(), 0
        read_here = self.cp_run is not None and self.cp_run.reads_here(loader.dataset)
        # the step's tokens per token a rank reads: dp ranks, and cp ranks when each reads its own tokens
        tokens_per_read = self.layout.dp * (self.layout.cp if read_here else 1)
        while self.global_step < total:
            try:
                batch = next(iterator)
            except StopIteration:
                iterator = iter(loader)
                continue
            checked = self.id_ranges.check(
                batch.inputs, batch.labels, self.global_step + 1, sample_namer(loader)
            )
            timed = self.plan_check is not None and self.plan_check.before_step(self.global_step, total)
            step_start = time.perf_counter()
            result = self._step(
                batch.inputs,
                batch.labels,
                record_timing=timed,
                ids_checked=self.id_ranges.vocab if checked else None,  # no id check on the device
                read_here=read_here,
            )
            step_time = time.perf_counter() - step_start
            if self.plan_check is not None:
                self.plan_check.after_step(self.global_step, self.last_result, step_time)
            window_tokens += count_tokens(batch.inputs) * tokens_per_read
            step = self.global_step
            records.add(
                result,
                step=step,
                lr=float(self.lr_scheduler.get_last_lr()[0]),
                step_time_s=step_time,
                skipped_steps=self.skipped_steps if self.last_step_skipped else None,
            )
            # first=1: the run's first step, not a resumed segment's (one run's cadence, resumed or not)
            log = cadence.log_due(step, first=1, total=total, skipped=self.last_step_skipped)
            if log or self.stop_agreed or cadence.reads_due(step, total=total):
                self._settle()  # the host reads the step's numbers here, not in the step
            record = records.flush(force=log or self.stop_agreed or step >= total)
            if log and record is not None:
                elapsed = time.perf_counter() - window_start
                record["tokens_per_s"] = window_tokens / elapsed if elapsed > 0 else 0.0
                self.metrics.log(record)
                window_start, window_tokens = time.perf_counter(), 0
            if self.samples is not None and self.samples.due(step, total) and not self.stop_agreed:
                from merak_core.run.samples import sample_in_training

                sample_in_training(self.samples, self, step, dist.get_rank())  # collective
            if cadence.eval_due(step) and not self.stop_agreed:
                self._evaluate_in_training(step)  # before the save: a non-finite evaluation commits nothing
            saved = None
            if cadence.save_due(step):
                saved = self.checkpoints.save()
            if self.stop_agreed:
                self._preempt(saved)

    def _check_some_step_applied(self, start_step: int) -> None:
        """``nonfinite: skip``: a run segment whose every step was skipped fails (nothing of it is saved)."""
        ran = self.global_step - start_step
        limit = self.args.nonfinite_max_consecutive_skips
        if (
            self.args.nonfinite == nonfinite.SKIP
            and limit > 0
            and ran > 0
            and self.engine.consecutive_skips >= ran
        ):
            raise nonfinite.all_skipped_error(
                first_step=start_step + 1, last_step=self.global_step, limit=limit
            )

    def _evaluate_in_training(self, step: int) -> None:
        """An evaluation of the training cadence, logged; a non-finite eval loss fails the run (every rank)."""
        self.last_eval = self.evaluate()
        self.metrics.log({"step": step, **self.last_eval})
        loss = self.last_eval.get("eval_loss")
        if loss is not None and not math.isfinite(loss):
            raise nonfinite.eval_error(step=step, loss=loss)

    def _preempt(self, saved: Any) -> None:
        """Every rank: write the preemption checkpoint (unless this step just saved one) and raise."""
        path = saved if saved is not None else self.checkpoints.save()
        self.metrics.finish()
        name = self._stop.signal_name or "a stop signal to another rank"
        raise TrainingPreempted(self.global_step, str(path) if path is not None else None, name)

    def resume(self, path: str = "latest") -> int:
        """Continue from a checkpoint (a directory, or ``latest`` in ``output_dir``); returns its step."""
        self.global_step = self.checkpoints.load(path)
        return self.global_step

    # ------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def evaluate(self, eval_dataset: Any = None) -> dict[str, float]:
        """Loss (and ``compute_metrics``) over ``eval_dataset``, averaged over every example; all ranks."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("Trainer.evaluate() needs an eval_dataset")
        num_micro = self.args.num_microbatches
        # Every sample counts once: the last partial batch is padded and masked ([Note: eval weighting]).
        loader = StageAwareDataLoader.from_training_args(
            dataset,
            self.args,
            self.layout,
            evaluation=True,
            collate_fn=self.data_collator,
            eval_micro_batch_size=self._eval_micro_batch_size(),
        )

        def run(batch: Any, return_outputs: bool) -> Any:
            return self.engine.evaluate_batch(batch.inputs, batch.labels, return_outputs=return_outputs)

        cp = self.cp_run  # this rank's tokens, each weighed by the default loss ([Note: cp evaluation])
        with cp.active() if cp is not None else contextlib.nullcontext():
            return evaluate_loader(
                loader if cp is None else cp.split_batches(loader, read_here=cp.reads_here(dataset)),
                run=run,
                loss_fn=self.loss_fn if cp is None else default_loss,
                compute_metrics=self.compute_metrics,
                num_microbatches=num_micro,
                tp_rank=self.layout.tp_rank,
                device=self.device,
                autocast=self.engine.autocast,
            )

    def _eval_micro_batch_size(self) -> int:
        """``per_device_eval_batch_size``, or the training microbatch for shape-specialised stages (once)."""
        if (
            self._eval_specialised is None
            and self.args.per_device_eval_batch_size != self.args.micro_batch_size
        ):
            self._eval_specialised = shapes_specialised(self.model.module, self.device, self.args)
        return self.args.micro_batch_size if self._eval_specialised else self.args.per_device_eval_batch_size

    # ------------------------------------------------------------------ export

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The unsharded parameters by logical name on global rank 0 (None elsewhere); collective."""
        return gather_full_state_dict(self.model)
