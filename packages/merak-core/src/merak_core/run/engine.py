"""The parallel step: one optimizer step of a composed model over the 3D layout.

:class:`ParallelEngine` owns what a step needs (the composed model, the pipeline runner, the DP
gradient sync, the optimizer and the learning-rate schedule) and nothing about the loop around it.
:meth:`ParallelEngine.step` runs one optimizer step on this rank's part of a global batch and
returns a :class:`StepResult` (the global mean loss, the pipeline seconds, the gradient norm, the
runner's timings when recorded, whether the update was skipped and whether a stop was agreed).

One optimizer step: the data loader hands this rank its part of the global batch (inputs on the
first stage, labels on the last, nothing in between); the pipeline runner splits it into
``num_microbatches`` and runs the schedule (gradients accumulate, scaled to the full-batch mean;
gradients of parameters shared across stages are summed over their copies); gradients are averaged
over the DP group in buckets; the global gradient norm (over DP, TP and PP, each logical parameter
counted once) is clipped; the optimizer (optionally ZeRO-1) steps; the learning-rate schedule
advances.

[Note: loss scaling] The loss of a step is the mean over microbatches and DP ranks of each
microbatch's ``loss_fn`` value (for token losses: the mean over that microbatch's counted tokens).
A single-process reference that splits the global batch into ``dp * num_microbatches`` equal chunks
and averages their losses computes exactly the same gradient (see ``tests/e2e``).

[Note: failures] Every group has the layout's timeout. When a peer dies or stalls, a step fails on
every other rank within that timeout with an error that names the rank, its (pp, dp, tp)
coordinates, the step and what it waited on: the pipeline runner's ``PipelineCommError`` (stage,
action, microbatch, peer) gains the global ranks of the pipeline; other collectives raise
:class:`TrainingStepError` naming the group's global ranks. Both add which ranks stopped answering
the heartbeat (:mod:`merak_core.run.stall`): the stalled or dead peer by global rank and coordinates.

[Note: non-finite steps and signals] The step's last all-reduce carries the loss and two flags (a
non-finite gradient, a stop signal), see :mod:`merak_core.run.nonfinite` and :mod:`merak_core.run.signals`:
``nonfinite: stop`` raises an error naming the step, the loss, the norm and the first bad gradient;
``skip`` drops the update; a signal ends training after the same step on every rank, with a
preemption checkpoint. The step reads none of it on the host where the optimizer can drop an update on
the device (fused AdamW, the default on CUDA, under ``nonfinite: stop``): the flags are read one step
later, the loss and the norm when the trainer logs ([Note: device-side skip] in ``nonfinite``).

Not done here: building the runner, the DP sync and the optimizer (``engine_setup.py``), the loop,
evaluation cadence, metrics and checkpoints (``trainer.py``), process groups, devices and preparing
the model (``bootstrap.py``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from merak_core.config import TrainingArguments, build_lr_scheduler
from merak_core.parallel.clip import global_grad_norm, scale_gradients_
from merak_core.parallel.compose import ParallelModel
from merak_core.parallel.data_parallel import DataParallelGradSync
from merak_core.parallel.devices import autocast
from merak_core.parallel.expert_parallel import ExpertParallelGradSync, expert_parameters
from merak_core.parallel.fsdp import SHARDED_ZERO_STAGES, ShardedDataParallel, warn_nothing_to_shard
from merak_core.parallel.layout import ParallelLayout
from merak_core.parallel.zero import ZeroOptimizer
from merak_core.run import nonfinite
from merak_core.run.engine_setup import (
    OptimizerFactory,
    build_dp_sync,
    build_optimizer,
    build_runner,
    check_loss_fn,
    schedule_name,
    shard_parallel_model,
)
from merak_core.run.stall import Heartbeat
from merak_core.run.step_values import (
    LateFlags,
    StepResult,
    StepValues,
    TrainingStepError,
    reduce_step_values,
)
from merak_core.run.watchdog import StepWatchdog
from merak_pipe import PipelineCommError
from merak_tp import VocabParallelEmbedding
from merak_tp.grad_sums import defer_grad_sums, sum_grads

LossFn = Callable[[Any, Any], torch.Tensor]

__all__ = [
    "LossFn",
    "ParallelEngine",
    "default_loss",
    "schedule_name",
    "shard_parallel_model",
]


def default_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy for classifiers (``[b, c]`` vs ``[b]``) and LMs (``[b, t, v]`` vs ``[b, t]``, -100 ignored).

    The logits are ``output`` itself, its ``logits`` (a ``ModelOutput`` or a dict), or the first element
    of a tuple; a dict without ``logits`` is a ``ValueError`` (pass a ``loss_fn`` that reads it).
    """
    if isinstance(output, Mapping) and "logits" in output:
        logits = output[
            "logits"
        ]  # a ModelOutput, or its rows as a plain dict (evaluation of a partial batch)
    elif isinstance(output, Mapping) and not hasattr(output, "logits"):
        raise ValueError(
            f"the model returns a dict with keys {sorted(map(str, output))} and no 'logits', so the default "
            "loss (cross-entropy over the logits) has nothing to read: return the logits under 'logits', or "
            "pass a loss_fn that reads this dict (a job's 'loss: file.py:function')"
        )
    else:
        logits = getattr(output, "logits", output)
    if isinstance(logits, (tuple, list)):
        logits = logits[0]  # a tuple output: its first element is the logits (the launch log says so)
    flat = logits.reshape(-1, logits.size(-1))
    if flat.dtype in (torch.float16, torch.bfloat16):
        flat = flat.float()  # low-precision logits: the softmax in float32; float64 stays float64
    return F.cross_entropy(flat, labels.reshape(-1), ignore_index=-100)


class ParallelEngine:
    """One optimizer step of ``model`` over ``layout`` (see the module docstring).

    Args:
        model: the composed model of this rank (:func:`merak_core.parallel.compose.build_parallel_model`).
        layout: the parallel layout the model was composed for (``args`` checked against it:
            :func:`merak_core.run.bootstrap.check_layout`).
        args: the run's :class:`TrainingArguments`.
        device: this rank's device.
        loss_fn: ``loss_fn(output, labels) -> scalar``.
        num_training_steps: the length of the learning-rate schedule.
        example_labels: one microbatch of labels, to try ``loss_fn`` on before the first step.
        optimizer_factory: ``fn(param_groups) -> Optimizer`` (default: AdamW from ``args``).
    """

    def __init__(
        self,
        model: ParallelModel,
        layout: ParallelLayout,
        args: TrainingArguments,
        *,
        device: torch.device,
        loss_fn: LossFn,
        num_training_steps: int,
        example_labels: Any = None,
        optimizer_factory: OptimizerFactory | None = None,
    ) -> None:
        self.model, self.layout, self.args, self.device, self.loss_fn = model, layout, args, device, loss_fn
        self.schedule_name = schedule_name(args)
        self.sharded: ShardedDataParallel | None = None
        # ZeRO-2/3 shard over DP x CP (the CP ranks hold the same parameters), ZeRO-1 over DP.
        shard_ranks = layout.dp * layout.cp if args.zero_stage in SHARDED_ZERO_STAGES else layout.dp
        warn_nothing_to_shard(args.zero_stage, shard_ranks)  # ZeRO-1/2/3 with one rank to shard over: ZeRO-0
        if args.zero_stage in SHARDED_ZERO_STAGES and shard_ranks > 1:
            # ZeRO-2/3: FSDP2 over layout.grad_sync_group replaces the parameters (merak_core.parallel.fsdp).
            # bf16: FSDP2 gathers bf16 parameters, reduces float32 ([Note: bf16 parameter gathers] in fsdp).
            self.sharded, self.model = shard_parallel_model(
                model,
                zero_stage=args.zero_stage,
                device=device,
                param_dtype=torch.bfloat16 if args.bf16 else None,
            )
        check_loss_fn(self.model, loss_fn, example_labels)
        self.runner = build_runner(
            self.model,
            layout,
            args,
            schedule_name=self.schedule_name,
            device=device,
            loss_fn=loss_fn,
            sharded=self.sharded is not None,
        )
        named = self.model.named_parameters()
        self.named = list(named)
        self.params = [p for _, p in named]
        self.vocab_tables = [m for m in self.model.module.modules() if isinstance(m, VocabParallelEmbedding)]
        """This rank's vocab-parallel embeddings (their per-forward id check: ``step(ids_checked=...)``)."""
        self.tp_sums = defer_grad_sums(self.params) if self.sharded is None and layout.tp > 1 else []
        """Replicated parameters whose partial gradients are summed over TP once per step (merak_tp.grad_sums)."""
        self.expert_params = expert_parameters(self.model.module) if layout.ep > 1 else []
        """Parameters sharded over the EP group (merak_core.parallel.expert_parallel): the norm sums them over it."""
        self.dp_sync: DataParallelGradSync | ShardedDataParallel | None = build_dp_sync(
            self.model, layout, self.sharded, zero_stage=args.zero_stage
        )
        zero1 = (
            self.dp_sync if isinstance(self.dp_sync, DataParallelGradSync | ExpertParallelGradSync) else None
        )
        self.grad_shard_group = layout.dp_group if zero1 is not None and zero1.shards_gradients else None
        """ZeRO-1 reduce-scatter: each rank holds its owned parameters' gradients only (the norm sums over it)."""
        self.optimizer: torch.optim.Optimizer = build_optimizer(
            named, layout, args, device=device, factory=optimizer_factory, grad_sync=zero1
        )
        self.lr_scheduler = build_lr_scheduler(self.optimizer, args, num_training_steps)
        target = nonfinite.device_skip_target(self.optimizer) if self.sharded is None else None
        self.late_flags = (
            LateFlags(target, named=self.named, layout=layout)
            if target is not None and args.nonfinite == nonfinite.STOP
            else None
        )
        """[Note: device-side skip]: the optimizer drops a non-finite update on the device and the host reads
        the flags one step later; None: every step reads its flags (``nonfinite: skip``, other optimizers)."""
        self.last_result: StepResult | None = None
        self.heartbeat: Heartbeat | None = None
        self.watchdog = StepWatchdog(
            timeout_s=layout.timeout.total_seconds(),
            who=f"rank {layout.rank} (pp_rank {layout.pp_rank}, dp_rank {layout.dp_rank}, tp_rank {layout.tp_rank})",
            diagnose=self._stall_diagnosis,
        )
        """Logs where this rank waits before the timeout ends the job ([Note: step watchdog] in merak_core.run.watchdog)."""
        """The running loop's heartbeat: a failed step names the ranks that stopped answering it."""
        self.last_pipeline_s = 0.0
        self.consecutive_skips = 0
        """Steps skipped in a row just before the next one (``nonfinite: skip``; reset by an applied step)."""

    # ------------------------------------------------------------------ inputs

    def stage_inputs(self, inputs: Any) -> Any:
        """This stage's inputs on the device, in the order (or by the keywords) the model was traced with."""
        if inputs is None:
            return None
        if isinstance(inputs, Mapping):
            keys = self.model.input_keys
            if keys is None or set(keys) != set(inputs):
                raise ValueError(
                    f"batch inputs have keys {sorted(inputs)} but the model was traced with "
                    f"{keys}: every batch must carry the same input keys"
                )
            if self.model.by_keyword and self.layout.pp == 1:
                return {k: self._to_device(inputs[k]) for k in keys}
            return tuple(self._to_device(inputs[k]) for k in keys)
        if isinstance(inputs, torch.Tensor):
            return self._to_device(inputs)
        return tuple(self._to_device(x) for x in inputs)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on this device; from the loader's pinned memory (CUDA) without blocking the host."""
        return t.to(self.device, non_blocking=True)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """bf16 autocast on this device when ``args.bf16``, else nothing."""
        return autocast(self.args.bf16, self.device)

    # ------------------------------------------------------------------ the step

    @property
    def schedule(self) -> Any:
        """The schedule the runner runs (a merak-pipe schedule: actions per stage)."""
        return self.runner.schedule

    def param_bytes(self) -> int:
        """Bytes of this rank's parameters."""
        return sum(p.numel() * p.element_size() for p in self.params)

    def step(
        self,
        inputs: Any,
        labels: Any,
        *,
        step: int,
        stop_requested: bool = False,
        record_timing: bool = False,
        ids_checked: int | None = None,
    ) -> StepResult:
        """Optimizer step number ``step`` on this rank's part of a global batch (collective).

        ``record_timing``: the runner records every action's timing (``StepResult.timings``).
        ``ids_checked``: the caller checked every input id of this batch against a vocabulary of this
        size on the host (the trainer, :mod:`merak_core.data.batch_ids`): the vocab-parallel embeddings
        of that size skip their own check, a host read per first-stage forward at TP > 1.
        A non-finite loss or gradient norm, and a stop request on any rank, are known to every rank
        after the step's last all-reduce (see [Note: step flags] in :mod:`merak_core.run.nonfinite`):
        ``nonfinite: stop`` raises :class:`merak_core.run.nonfinite.NonFiniteError`; ``skip`` drops the
        update (optimizer and learning-rate schedule unchanged, ``StepResult.skipped``).
        """
        for p in self.params:
            p.grad = None
        labels = self._to_device(labels) if isinstance(labels, torch.Tensor) else labels
        layout = self.layout
        if self.dp_sync is not None:
            # Buckets are all-reduced during the backward of the last microbatch, as their gradients
            # become final (each parameter's gradient accumulates once per microbatch).
            self.dp_sync.prepare_step(self.args.num_microbatches)
        with self._phase(
            f"pipeline step over global ranks {layout.pp_ranks} (pipeline rank i = the i-th)",
            step,
            position=getattr(self.runner, "describe_position", None),
        ):
            with self.autocast(), self._ids_checked(ids_checked):
                self.runner.record_timing = record_timing
                start = time.perf_counter()
                loss = self.runner.step(self.stage_inputs(inputs), labels)
                if record_timing and self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)  # the time of the GPU work, not of queuing it
                self.last_pipeline_s = time.perf_counter() - start
        timings = tuple(self.runner.timings) if record_timing else ()
        if self.dp_sync is not None:
            what = (
                "all-reduce"
                if self.sharded is None and self.grad_shard_group is None
                else f"reduce-scatter (ZeRO-{self.args.zero_stage})"
            )
            with self._phase(f"DP gradient {what} over global ranks {layout.dp_ranks}", step):
                self.dp_sync.finish()
        if self.tp_sums:  # after the DP sync: the sums commute with its average
            with self._phase(f"TP gradient sums over global ranks {layout.tp_ranks}", step):
                sum_grads(self.tp_sums)
        self._fill_missing_grads()
        norm = None
        if self.args.max_grad_norm > 0:
            with self._phase(
                f"gradient-norm all-reduce over the TP and PP groups (global ranks {layout.tp_ranks} "
                f"and {layout.pp_ranks})",
                step,
            ):
                norm = global_grad_norm(
                    self.params,
                    layout=layout,
                    shared_params=self.model.shared_owner,
                    # ZeRO-1: each expert's gradient is on one DP rank already ([Note: ZeRO-1 with experts])
                    expert_params=self.expert_params if self.grad_shard_group is None else (),
                    grad_shard_group=self.grad_shard_group,
                )
            bad = ~torch.isfinite(norm)
        else:
            bad = nonfinite.local_grads_nonfinite_flag(self.params, self.device)
        late = self.late_flags is not None  # then the device finds the first bad gradient of every step
        grads = [(n, g) for n, p in self.named if (g := p.grad) is not None] if late else []
        with self._phase("loss all-reduce over all ranks", step):
            values = reduce_step_values(
                loss,
                bad,
                stop_requested,
                add_loss=layout.tp_rank == 0,
                norm=norm,
                first_bad=nonfinite.first_nonfinite_code([g for _, g in grads], self.device)
                if late
                else None,
                device=self.device,
                loss_divisor=layout.dp * layout.cp,  # [Note: cp loss]
                names=[n for n, _ in grads],
            )
        if self.late_flags is not None:
            return self._step_on_device(values, norm, step, timings)
        result = StepResult(
            values=values,
            pipeline_s=self.last_pipeline_s,
            skipped=values.nonfinite,
            stop_agreed=values.stop_requested,
            timings=timings,
        )
        self.last_result = result
        if result.skipped:
            limit = self.args.nonfinite_max_consecutive_skips
            over_limit = 0 < limit <= self.consecutive_skips
            if self.args.nonfinite == nonfinite.STOP or over_limit:
                skip_limit = limit if self.args.nonfinite != nonfinite.STOP else None
                raise nonfinite.nonfinite_error(step, values, self.named, self.layout, skip_limit=skip_limit)
            self.consecutive_skips += 1
            return result
        self.consecutive_skips = 0
        self._apply_update(norm, step)
        return result

    def _apply_update(self, norm: torch.Tensor | None, step: int) -> None:
        """Clip, step the optimizer and the learning-rate schedule."""
        if norm is not None:
            scale_gradients_(self.params, self.args.max_grad_norm, norm)
        zero = isinstance(self.optimizer, ZeroOptimizer)
        with self._phase(
            f"optimizer step (ZeRO-1 {'all-gathers' if self.grad_shard_group else 'broadcasts'} over global "
            f"ranks {self.layout.dp_ranks})"
            if zero
            else "optimizer step (local, no communication)",
            step,
        ):
            self.optimizer.step()
        self.lr_scheduler.step()

    def _step_on_device(
        self, values: StepValues, norm: torch.Tensor | None, step: int, timings: tuple[Any, ...]
    ) -> StepResult:
        """The update without a host read ([Note: device-side skip] in :mod:`merak_core.run.nonfinite`):
        the optimizer drops it on the device when needed; the host reads the previous step's flags."""
        assert self.late_flags is not None
        self.late_flags.arm(values)
        self._apply_update(norm, step)
        stop = self.late_flags.check(self.late_flags.swap(step, values))
        result = StepResult(values=values, pipeline_s=self.last_pipeline_s, stop_agreed=stop, timings=timings)
        self.last_result = result
        return result

    def settle(self) -> bool:
        """Read the flags of the last step not read yet, now (waits for the device to finish it).

        Raises :class:`merak_core.run.nonfinite.NonFiniteError` naming that step when it was not finite;
        returns whether a stop was agreed in it. Nothing to read (the flags are read in the step) is False.
        The trainer calls it before it logs, saves, evaluates or ends (collective when it raises).
        """
        return False if self.late_flags is None else self.late_flags.check(self.late_flags.take())

    @property
    def last_grad_norm(self) -> float | None:
        """The last step's gradient norm before clipping (read from the device when asked)."""
        return None if self.last_result is None else self.last_result.grad_norm

    @contextlib.contextmanager
    def _ids_checked(self, vocab: int | None) -> Iterator[None]:
        """The vocab-parallel embeddings of ``vocab`` rows skip their id check (done on the host already)."""
        tables = [m for m in self.vocab_tables if vocab is not None and m.num_embeddings == vocab]
        for table in tables:
            table.check_ids = False
        try:
            yield
        finally:
            for table in tables:
                table.check_ids = True

    @contextlib.contextmanager
    def _phase(self, what: str, step: int, *, position: Callable[[], str] | None = None) -> Iterator[None]:
        """Re-raise a communication failure with this rank, its coordinates, the step and what it waited on.

        The watchdog logs the same before the timeout (``position``: this rank's pipeline position).

        See [Note: failures]: a pipeline error keeps its class (``PipelineCommError``); any
        other ``RuntimeError`` (gloo/NCCL errors and timeouts) becomes :class:`TrainingStepError`.
        ``ValueError`` (bad input) passes through unchanged.
        """
        try:
            with self.watchdog.watch(what, step, position or _no_position):
                yield
        except RuntimeError as exc:
            layout = self.layout
            where = (
                f"rank {layout.rank} (pp_rank {layout.pp_rank}, dp_rank {layout.dp_rank}, "
                f"tp_rank {layout.tp_rank}), step {step}: {what} failed "
                f"(timeout {layout.timeout.total_seconds():g} s; {self._stall_diagnosis()})"
            )
            if isinstance(exc, PipelineCommError):  # PipelineTimeoutError included
                raise type(exc)(f"{where}: {exc}") from exc
            raise TrainingStepError(
                f"{where}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            ) from exc

    def _stall_diagnosis(self) -> str:
        """Which ranks stopped answering (see [Note: heartbeats] in :mod:`merak_core.run.stall`)."""
        if self.heartbeat is None:
            return "a peer died or stalled?"
        return self.heartbeat.diagnosis()

    def _fill_missing_grads(self) -> None:
        if self.grad_shard_group is not None:
            return  # ZeRO-1 reduce-scatter: the sync gave every owned parameter a gradient, the others none
        for p in self.params:
            if p.grad is None and p.requires_grad:  # frozen (LoRA's base weights): no gradient buffer
                p.grad = torch.zeros_like(p)

    # ------------------------------------------------------------------ evaluation

    def evaluate_batch(self, inputs: Any, labels: Any, *, return_outputs: bool) -> Any:
        """The runner's forward-only pass over one batch (collective over the pipeline)."""
        labels = labels.to(self.device) if labels is not None else None
        with self.autocast():
            return self.runner.evaluate(self.stage_inputs(inputs), labels, return_outputs=return_outputs)


def _no_position() -> str:
    return ""
