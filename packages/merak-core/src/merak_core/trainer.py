"""The Trainer: 3D-parallel training of an ordinary model, Hugging Face style.

::

    trainer = Trainer(model, TrainingArguments(dp=2, tp=2, pp=2, ...), train_dataset, eval_dataset)
    trainer.train()
    metrics = trainer.evaluate()

One optimizer step: the data loader hands this rank its part of the global batch
(inputs on the first stage, labels on the last, nothing in between); the
pipeline runner splits it into ``num_microbatches`` and runs the schedule
(gradients accumulate, scaled to the full-batch mean; gradients of parameters
shared across stages are summed over their copies); gradients are averaged over
the DP group in buckets; the global gradient norm (over DP, TP and PP, each
logical parameter counted once) is clipped; the optimizer (optionally ZeRO-1)
steps; the learning-rate schedule advances.

[Note: loss scaling] The loss of a step is the mean over microbatches and DP
ranks of each microbatch's ``loss_fn`` value (for token losses: the mean over
that microbatch's counted tokens). A single-process reference that splits the
global batch into ``dp * num_microbatches`` equal chunks and averages their
losses computes exactly the same gradient (see ``tests/e2e``).

[Note: failures] Every group has the layout's timeout. When a peer dies or stalls,
a step fails on every other rank within that timeout with an error that names the
rank, its (pp, dp, tp) coordinates, the step and what it waited on: the pipeline
runner's ``PipelineCommError`` (stage, action, microbatch, peer) gains the global
ranks of the pipeline; other collectives raise :class:`TrainingStepError` naming
the group's global ranks. Both add which ranks stopped answering the heartbeat
(:mod:`merak_core.stall`): the stalled or dead peer by global rank and coordinates.

[Note: non-finite steps and signals] The step's last all-reduce carries the loss and
two flags (a non-finite gradient, a stop signal), see :mod:`merak_core.nonfinite`
and :mod:`merak_core.signals`: ``nonfinite: stop`` raises an error naming the step,
the loss, the norm and the first bad gradient; ``skip`` drops the update; a signal
ends training after the same step on every rank, with a preemption checkpoint.

[Note: plan check] With ``layout: auto`` the Trainer first lets the planner choose the layout
(collective, :func:`merak_core.autoplan.plan_for_job`); with ``plan_check_steps`` it records
the runner's timings and the peak memory for a few steps and hands them to
:class:`merak_core.autoplan.PlanCheck`, which logs predicted against measured and re-plans.
The steps themselves are unchanged (only the pipeline part is timed).

Not done here: tracing and sharding (``compose.py``), the layout (``layout.py``),
data sharding (``data.py``), the planner (``planner/``, ``autoplan.py``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from merak_core import nonfinite
from merak_core.clip import global_grad_norm, scale_gradients_
from merak_core.compose import ParallelModel, build_parallel_model, gather_full_state_dict
from merak_core.config import TrainingArguments, build_lr_scheduler
from merak_core.data import StageAwareDataLoader
from merak_core.data_parallel import DataParallelGradSync
from merak_core.evaluation import evaluate_loader, shapes_specialised
from merak_core.layout import ParallelLayout, init, select_device
from merak_core.metrics import MetricsWriter
from merak_core.planner import PlanContext
from merak_core.signals import StopRequest, TrainingPreempted
from merak_core.stall import Heartbeat
from merak_core.zero import ZeroOptimizer

logger = logging.getLogger(__name__)

LossFn = Callable[[Any, Any], torch.Tensor]
MetricsFn = Callable[[torch.Tensor, torch.Tensor], Mapping[str, torch.Tensor]]


class TrainingStepError(RuntimeError):
    """A collective of a training step failed or timed out; the message names the rank, step and group."""


def default_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy for classifiers (``[b, c]`` vs ``[b]``) and LMs (``[b, t, v]`` vs ``[b, t]``, -100 ignored)."""
    logits = getattr(output, "logits", output)
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    flat = logits.reshape(-1, logits.size(-1))
    if flat.dtype in (torch.float16, torch.bfloat16):
        flat = flat.float()  # low-precision logits: the softmax in float32; float64 stays float64
    return F.cross_entropy(flat, labels.reshape(-1), ignore_index=-100)


def schedule_name(args: TrainingArguments) -> str:
    """The merak-pipe schedule for ``args.schedule`` (``auto``: shifted critical path with a budget, else 1F1B)."""
    name = args.schedule
    if name == "auto":
        name = "shifted_critical_path" if args.memory_budget is not None else "1f1b"
    return name.replace("_", "-")


def _decay_groups(named: Sequence[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: matrices decay, biases and norm weights (1-D) do not."""
    seen: set[int] = set()
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for _, p in named:
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class Trainer:
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
            ``layout: auto`` builds it (:func:`merak_core.autoplan.auto_layout` runs here first).
    """

    def __init__(
        self,
        model: nn.Module,
        args: TrainingArguments,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        loss_fn: LossFn | None = None,
        data_collator: Callable[[list[Any]], Any] | None = None,
        *,
        compute_metrics: MetricsFn | None = None,
        layout: ParallelLayout | None = None,
        example_inputs: Mapping[str, Any] | Sequence[Any] | None = None,
        init_fn: Callable[[nn.Module], Any] | None = None,
        optimizer_factory: Callable[[list[dict[str, Any]]], torch.optim.Optimizer] | None = None,
        device: torch.device | str | None = None,
        plan_context: PlanContext | None = None,
    ) -> None:
        if args.layout == "auto" or (args.plan_check_steps and plan_context is None):
            if args.layout == "auto" and layout is not None:
                raise ValueError("layout='auto' chooses dp/tp/pp itself: do not pass layout= (or use layout: manual)")
            from merak_core.autoplan import plan_for_job  # collective: see [Note: layout auto] in config

            args, plan_context = plan_for_job(args, model, train_dataset, data_collator=data_collator, device=device)
        self.args = args
        self.layout = layout if layout is not None else init(dp=args.dp, tp=args.tp, pp=args.pp, device=device,
                                                                timeout=args.comm_timeout)
        _check_layout(args, self.layout)
        self.device = select_device(device) if device is not None else self.layout.device
        self.loss_fn = loss_fn or default_loss
        self.compute_metrics = compute_metrics
        self.data_collator = data_collator
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        num_micro = args.num_microbatches
        per_rank_batch = args.micro_batch_size * num_micro
        self.schedule_name = schedule_name(args)
        if self.schedule_name.startswith("interleaved"):
            raise ValueError(
                f"schedule={args.schedule!r} places several stages on one rank, which the Trainer does not "
                "do yet: use 1f1b, gpipe, zb_h1 or shifted_critical_path (merak_pipe runs interleaved schedules "
                "over hand-split stages)"
            )
        if self.layout.pp > 1 and num_micro < self.layout.pp:
            raise ValueError(
                f"gradient_accumulation_steps={num_micro} microbatches is fewer than pp={self.layout.pp} stages: "
                f"the pipeline would idle; use at least {self.layout.pp} microbatches"
            )
        self.train_loader = (
            StageAwareDataLoader(train_dataset, batch_size=per_rank_batch, layout=self.layout,
                                 collate_fn=data_collator, seed=args.seed, shuffle=True,
                                 num_workers=args.dataloader_num_workers)
            if train_dataset is not None else None
        )
        if example_inputs is None:
            example_inputs = self._example_inputs(train_dataset if train_dataset is not None else eval_dataset)
        if not _is_meta(model):
            model.to(dtype=args.torch_dtype)
        if args.tp_check and self.layout.tp > 1:
            self._check_tp_plan(model, example_inputs)
        # One default stream on every rank: dropout of replicated activations agrees across TP ranks.
        # At pp == 1 sharded activations (the plan's rng regions) draw from the TP stream, seeded per TP
        # rank and derived from the default generator, so recomputation and resumes replay it
        # (merak_tp.rng). Traced stages (pp > 1) keep the modules unwrapped: there, sharded dropout uses
        # the default stream too (the same masks for the heads of every rank).
        torch.manual_seed(args.seed + 1)
        tp_rng = None
        if self.layout.tp > 1 and self.layout.pp == 1:
            import merak_tp

            tp_rng = merak_tp.RNGTracker(self.device)
            tp_rng.add("tp", merak_tp.tp_seed(args.seed, self.layout.tp_group), derived=True)
        self.model: ParallelModel = build_parallel_model(
            model, self.layout, example_inputs=example_inputs, tp_plan=args.tp_plan,
            overlap_chunks=args.overlap_chunks, device=self.device, init_fn=init_fn, rng_tracker=tp_rng,
        )
        self._check_loss_fn()
        self.runner = self._build_runner()
        named = self.model.named_parameters()
        params = [p for _, p in named]
        # Shared (tied) parameters get their cross-stage sum after the backward: reduce them last.
        self.dp_sync = (DataParallelGradSync(self.model.module, self.layout.dp_group,
                                             deferred_params=[p for p, _ in self.model.shared_parameters])
                        if self.layout.dp > 1 else None)
        groups = _decay_groups(named, args.weight_decay)
        factory = optimizer_factory or self._adamw
        self.optimizer: torch.optim.Optimizer = (
            ZeroOptimizer(groups, factory, group=self.layout.dp_group) if args.zero_stage == 1 and self.layout.dp > 1
            else factory(groups)
        )
        self.lr_scheduler = build_lr_scheduler(self.optimizer, args, self.num_training_steps())
        self.params = params
        self.global_step = 0
        self.skipped_steps = 0
        self.last_grad_norm: float | None = None
        self.last_step_skipped = False
        self.stop_agreed = False
        self._stop = StopRequest()
        self._heartbeat: Heartbeat | None = None
        self.history: list[dict[str, float]] = []
        self.last_eval: dict[str, float] = {}
        # A merak_tp.RNGTracker the model forks for dropout on TP-sharded activations, if any:
        # checkpoints save and restore its states per rank (see merak_core.checkpoint.state).
        self.rng_tracker: Any = None
        self.metrics = MetricsWriter(args.output_dir, enabled=dist.get_rank() == 0)
        from merak_core.checkpoint import CheckpointManager

        self.checkpoints = CheckpointManager(self)
        from merak_core.autoplan import PlanCheck

        self.last_pipeline_s = 0.0
        self.plan_context = plan_context
        self._eval_specialised: bool | None = None
        self.plan_check = PlanCheck.for_trainer(self, plan_context)

    # ------------------------------------------------------------------ set-up

    def _adamw(self, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        a = self.args
        # Fused kernels on CUDA; the multi-tensor path on CPU (bit-identical to the per-parameter loop).
        fused = self.device.type == "cuda"
        return torch.optim.AdamW(groups, lr=a.learning_rate, betas=(a.adam_beta1, a.adam_beta2),
                                 eps=a.adam_epsilon, weight_decay=a.weight_decay, foreach=not fused, fused=fused)

    def _example_inputs(self, dataset: Any) -> Any:
        if dataset is None:
            raise ValueError("Trainer needs a train_dataset, an eval_dataset or example_inputs to trace the model")
        from merak_core.data import split_inputs_labels

        collate = self.data_collator or torch.utils.data.default_collate
        it = iter(dataset) if not hasattr(dataset, "__getitem__") else (dataset[i] for i in range(len(dataset)))
        samples = [next(it) for _ in range(self.args.micro_batch_size)]
        inputs, self._example_labels = split_inputs_labels(collate(samples))
        return inputs

    def _check_tp_plan(self, model: nn.Module, example_inputs: Any) -> None:
        """``training.tp_check``: every module the plan shards against the unsharded one (merak_core.tp_check)."""
        if _is_meta(model):
            raise ValueError("training.tp_check=true needs a model with real weights (this one is on the meta "
                             "device); run `merak check JOB.yaml` on a machine where it fits, or set tp_check=false")
        import merak_tp
        from merak_core.tp_check import check_before_training

        plan: Any = self.args.tp_plan
        plan = None if plan in (None, "auto") else merak_tp.plan_from_mapping(plan) if isinstance(plan, dict) else plan
        check_before_training(model, example_inputs, plan=plan, group=self.layout.tp_group)

    def _check_loss_fn(self) -> None:
        """With pp > 1, try ``loss_fn`` on meta tensors shaped like the model's output and one microbatch of labels.

        Every rank does it, so labels the loss cannot take fail here, on all ranks, instead of in the
        last stage alone while the other stages wait for its gradients until the timeout. Only a model
        whose output is one tensor is checked; errors caused by the meta device itself are ignored.
        """
        part, labels = self.model.partition, getattr(self, "_example_labels", None)
        if part is None or not isinstance(labels, torch.Tensor) or len(part.stage_info[-1].outputs) != 1:
            return
        out = part.stage_info[-1].outputs[0]
        if out.dtype is None:
            return
        output = torch.empty(out.shape, dtype=out.dtype, device="meta")
        try:
            self.loss_fn(output, labels.to("meta"))
        except (AttributeError, KeyError, TypeError, NotImplementedError):
            return  # the output is not a plain tensor for this loss, or the loss needs real values
        except Exception as exc:  # noqa: BLE001 - any other failure is the labels' or the loss's
            if "meta" in str(exc):
                return
            raise ValueError(
                f"loss_fn cannot take the model's output (shape {list(out.shape)}, {out.dtype}) with labels of "
                f"shape {list(labels.shape)} and dtype {labels.dtype}: {type(exc).__name__}: {exc}. Fix the labels "
                "the dataset or collate function returns (e.g. integer class ids for cross-entropy) or the loss_fn"
            ) from exc

    def _build_runner(self) -> Any:
        from merak_pipe import PipelineRunner, PipelineStage, build_schedule

        layout, args = self.layout, self.args
        recompute = self._recompute_plan()
        schedule = build_schedule(self.schedule_name, num_stages=layout.pp,
                                  num_microbatches=args.num_microbatches, recompute=recompute)
        stage = PipelineStage(self.model.module, stage_index=layout.pp_rank, num_stages=layout.pp,
                              group=layout.pp_group, device=self.device)
        return PipelineRunner([stage], schedule, loss_fn=self.loss_fn, group=layout.pp_group,
                              shared_parameters=self.model.shared_parameters, timeout=layout.timeout)

    def _recompute_plan(self) -> Any:
        from merak_pipe import RecomputePlan

        mode, fraction = self.args.recompute_mode
        pp = self.layout.pp
        if mode == "none":
            return None
        if mode == "full":
            return RecomputePlan.full(pp)
        if mode == "uniform":
            return RecomputePlan.uniform(pp, float(fraction or 0.0))
        return self._stage_aware_plan()

    def _stage_aware_plan(self) -> Any:
        from merak_pipe import build_schedule, stage_aware_plan

        part = self.model.partition
        if part is None or self.args.memory_budget is None:
            raise ValueError(
                "recompute='stage_aware' needs pp > 1 and memory_budget (bytes per rank, e.g. '2GiB'): "
                f"got pp={self.layout.pp}, memory_budget={self.args.memory_budget}"
            )
        layer_bytes = []
        for info in part.stage_info:
            lo, hi = info.shard_range
            n = max(1, hi - lo)
            layer_bytes.append([info.activation_bytes / n] * n)
        probe = build_schedule(self.schedule_name, num_stages=self.layout.pp,
                               num_microbatches=self.args.num_microbatches)
        static = [info.param_bytes * 4.0 for info in part.stage_info]
        return stage_aware_plan(layer_activation_bytes=layer_bytes, memory_budget=float(self.args.memory_budget),
                                static_bytes=static, schedule=probe)

    # ------------------------------------------------------------------ sizes

    def num_training_steps(self) -> int:
        if self.args.max_steps > 0:
            return self.args.max_steps
        if self.train_loader is None:
            return 0
        try:
            per_epoch = len(self.train_loader)
        except TypeError:
            raise ValueError("an iterable train_dataset has no length: set max_steps") from None
        return max(1, math.ceil(per_epoch * self.args.num_train_epochs))

    # ------------------------------------------------------------------ training

    def _stage_inputs(self, inputs: Any) -> Any:
        if inputs is None:
            return None
        if isinstance(inputs, Mapping):
            keys = self.model.input_keys
            if keys is None or set(keys) != set(inputs):
                raise ValueError(f"batch inputs have keys {sorted(inputs)} but the model was traced with "
                                 f"{keys}: every batch must carry the same input keys")
            if self.model.by_keyword and self.layout.pp == 1:
                return {k: inputs[k].to(self.device) for k in keys}
            return tuple(inputs[k].to(self.device) for k in keys)
        if isinstance(inputs, torch.Tensor):
            return inputs.to(self.device)
        return tuple(x.to(self.device) for x in inputs)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.args.bf16:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def training_step(self, inputs: Any, labels: Any) -> float:
        """One optimizer step on this rank's part of a global batch; the global mean loss on every rank.

        A non-finite loss or gradient norm, and a stop signal on any rank, are known to every rank
        after the step's last all-reduce (see [Note: step flags] in :mod:`merak_core.nonfinite`):
        ``nonfinite: stop`` raises :class:`merak_core.nonfinite.NonFiniteError`; ``skip`` drops the
        update (optimizer and learning-rate schedule unchanged, ``last_step_skipped``); a stop
        request sets ``stop_agreed`` after the update.
        """
        for p in self.params:
            p.grad = None
        labels = labels.to(self.device) if isinstance(labels, torch.Tensor) else labels
        layout = self.layout
        if self.dp_sync is not None:
            # Buckets are all-reduced during the backward of the last microbatch, as their gradients
            # become final (each parameter's gradient accumulates once per microbatch).
            self.dp_sync.prepare_step(self.args.num_microbatches)
        with self._phase(f"pipeline step over global ranks {layout.pp_ranks} (pipeline rank i = the i-th)"):
            with self._autocast():
                start = time.perf_counter()
                loss = self.runner.step(self._stage_inputs(inputs), labels)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)  # the time of the GPU work, not of queuing it
                self.last_pipeline_s = time.perf_counter() - start
        if self.dp_sync is not None:
            with self._phase(f"DP gradient all-reduce over global ranks {layout.dp_ranks}"):
                self.dp_sync.finish()
        self._fill_missing_grads()
        norm = None
        if self.args.max_grad_norm > 0:
            with self._phase(f"gradient-norm all-reduce over the TP and PP groups (global ranks {layout.tp_ranks} "
                             f"and {layout.pp_ranks})"):
                norm = global_grad_norm(self.params, layout=layout, shared_params=self.model.shared_owner)
            bad = not bool(torch.isfinite(norm))
        else:
            bad = nonfinite.local_grads_nonfinite(self.params)
        with self._phase("loss all-reduce over all ranks"):
            loss_value, any_bad, self.stop_agreed = self._reduce_step(loss, bad)
        self.last_grad_norm = float(norm) if norm is not None else None
        self.last_step_skipped = any_bad or not math.isfinite(loss_value)
        if self.last_step_skipped:
            self._nonfinite_step(loss_value)
            self.global_step += 1
            return loss_value
        if norm is not None:
            scale_gradients_(self.params, self.args.max_grad_norm, norm)
        zero = isinstance(self.optimizer, ZeroOptimizer)
        with self._phase(f"optimizer step (ZeRO-1 broadcasts over global ranks {layout.dp_ranks})" if zero
                         else "optimizer step (local, no communication)"):
            self.optimizer.step()
        self.lr_scheduler.step()
        self.global_step += 1
        return loss_value

    def _reduce_step(self, loss: torch.Tensor | None, bad: bool) -> tuple[float, bool, bool]:
        """The step's loss averaged over DP, and whether any rank saw a non-finite gradient or a stop signal."""
        value = torch.zeros(nonfinite.STEP_VECTOR_SIZE, dtype=torch.float64, device=self.device)
        if loss is not None and self.layout.tp_rank == 0:
            value[nonfinite.LOSS] += float(loss)
        value[nonfinite.NONFINITE] = float(bad)
        value[nonfinite.STOP_REQUESTED] = float(self._stop.requested)
        dist.all_reduce(value)
        return (float(value[nonfinite.LOSS]) / self.layout.dp, bool(value[nonfinite.NONFINITE] > 0),
                bool(value[nonfinite.STOP_REQUESTED] > 0))

    def _nonfinite_step(self, loss: float) -> None:
        """Apply the ``nonfinite`` policy to a step whose loss or gradients are not finite (on every rank)."""
        step = self.global_step + 1
        if self.args.nonfinite == nonfinite.STOP:
            raise nonfinite.nonfinite_error(step=step, loss=loss, grad_norm=self.last_grad_norm,
                                            named=self.model.named_parameters(), layout=self.layout)
        self.skipped_steps += 1
        if dist.get_rank() == 0:
            logger.warning("step %d skipped (nonfinite: skip): loss %r, gradient norm %r; %d step(s) skipped so far",
                           step, loss, self.last_grad_norm, self.skipped_steps)

    @contextlib.contextmanager
    def _phase(self, what: str) -> Iterator[None]:
        """Re-raise a communication failure with this rank, its coordinates, the step and what it waited on.

        See [Note: failures]: a pipeline error keeps its class (``PipelineCommError``); any
        other ``RuntimeError`` (gloo/NCCL errors and timeouts) becomes :class:`TrainingStepError`.
        ``ValueError`` (bad input) passes through unchanged.
        """
        try:
            yield
        except RuntimeError as exc:
            layout = self.layout
            where = (f"rank {layout.rank} (pp_rank {layout.pp_rank}, dp_rank {layout.dp_rank}, "
                     f"tp_rank {layout.tp_rank}), step {self.global_step + 1}: {what} failed "
                     f"(timeout {layout.timeout.total_seconds():g} s; {self._stall_diagnosis()})")
            if type(exc).__name__ in ("PipelineCommError", "PipelineTimeoutError"):
                raise type(exc)(f"{where}: {exc}") from exc
            raise TrainingStepError(f"{where}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                                    ) from exc

    def _stall_diagnosis(self) -> str:
        """Which ranks stopped answering (see [Note: heartbeats] in :mod:`merak_core.stall`)."""
        if self._heartbeat is None:
            return "a peer died or stalled?"
        return self._heartbeat.diagnosis()

    def _describe_rank(self, rank: int) -> str:
        pp_rank, dp_rank, tp_rank = self.layout.coords_of(rank)
        return f"rank {rank} (pp_rank {pp_rank}, dp_rank {dp_rank}, tp_rank {tp_rank})"

    def _fill_missing_grads(self) -> None:
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)

    def train(self) -> list[dict[str, float]]:
        """Run ``max_steps`` (or ``num_train_epochs``) optimizer steps; returns the logged history.

        SIGTERM or SIGINT on any rank stops every rank after the same step, with a preemption
        checkpoint: :class:`merak_core.signals.TrainingPreempted` (see [Note: preemption]).
        """
        if self.train_loader is None:
            raise ValueError("Trainer.train() needs a train_dataset")
        total = self.num_training_steps()
        args = self.args
        if args.save_steps and self.global_step == 0:
            earlier = self.checkpoints.checkpoints()
            if earlier:
                from merak_core.checkpoint import CheckpointError

                raise CheckpointError(
                    f"output_dir {args.output_dir!r} already holds checkpoints {[p.name for p in earlier]} of an "
                    f"earlier run, which this run (not resumed, save_steps={args.save_steps}) would overwrite: "
                    "resume it with trainer.resume('latest') (merak train --resume latest), or choose a new output_dir"
                )
        self.metrics.start(total, resumed_step=self.global_step)
        self._heartbeat = Heartbeat.for_timeout(dist.get_rank(), dist.get_world_size(),
                                                self.layout.timeout.total_seconds(), describe=self._describe_rank)
        try:
            with self._stop, self._heartbeat:
                self._train_loop(self.train_loader, total)
        finally:
            self._heartbeat = None
        if self.eval_dataset is not None and (not args.eval_steps or self.global_step % args.eval_steps):
            self.last_eval = self.evaluate()
            self.metrics.log({"step": self.global_step, **self.last_eval})
        if args.save_steps and self.global_step % args.save_steps:
            self.checkpoints.save()  # the final state, unless the last step just saved it
        self.metrics.finish()
        return self.history

    def _train_loop(self, loader: StageAwareDataLoader, total: int) -> None:
        args = self.args
        iterator = iter(loader)  # resumes at the loader's restored position
        window_start, window_tokens = time.perf_counter(), 0
        first_step = self.global_step + 1
        while self.global_step < total:
            try:
                batch = next(iterator)
            except StopIteration:
                iterator = iter(loader)
                continue
            if self.plan_check is not None:
                self.plan_check.before_step(total)
            step_start = time.perf_counter()
            loss = self.training_step(batch.inputs, batch.labels)
            step_time = time.perf_counter() - step_start
            if self.plan_check is not None:
                self.plan_check.after_step(step_time)
            window_tokens += _count_tokens(batch.inputs) * self.layout.dp
            record: dict[str, Any] = {"step": self.global_step, "loss": loss,
                                      "lr": float(self.lr_scheduler.get_last_lr()[0]), "step_time_s": step_time}
            if self.last_step_skipped:
                record.update(skipped=True, skipped_steps=self.skipped_steps)
            self.history.append(record)
            step = self.global_step
            if step % args.logging_steps == 0 or step in (total, first_step) or self.last_step_skipped:
                elapsed = time.perf_counter() - window_start
                record["tokens_per_s"] = window_tokens / elapsed if elapsed > 0 else 0.0
                self.metrics.log(record)
                window_start, window_tokens = time.perf_counter(), 0
            saved = None
            if args.save_steps and step % args.save_steps == 0:
                saved = self.checkpoints.save()
            if self.stop_agreed:
                self._preempt(saved)
            if args.eval_steps and self.eval_dataset is not None and step % args.eval_steps == 0:
                self.last_eval = self.evaluate()
                self.metrics.log({"step": step, **self.last_eval})

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
        loader = StageAwareDataLoader(dataset, batch_size=self._eval_micro_batch_size() * num_micro,
                                      layout=self.layout, collate_fn=self.data_collator, shuffle=False,
                                      seed=self.args.seed, drop_last=False)

        def run(batch: Any, return_outputs: bool) -> Any:
            labels = batch.labels.to(self.device) if batch.labels is not None else None
            with self._autocast():
                return self.runner.evaluate(self._stage_inputs(batch.inputs), labels, return_outputs=return_outputs)

        return evaluate_loader(loader, run=run, loss_fn=self.loss_fn, compute_metrics=self.compute_metrics,
                               num_microbatches=num_micro, tp_rank=self.layout.tp_rank, device=self.device,
                               autocast=self._autocast)

    def _eval_micro_batch_size(self) -> int:
        """``per_device_eval_batch_size``, or the training microbatch for shape-specialised stages (once)."""
        if self._eval_specialised is None and self.args.per_device_eval_batch_size != self.args.micro_batch_size:
            self._eval_specialised = shapes_specialised(self.model.module, self.device, self.args)
        return self.args.micro_batch_size if self._eval_specialised else self.args.per_device_eval_batch_size

    # ------------------------------------------------------------------ export

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The unsharded parameters by logical name on global rank 0 (None elsewhere); collective."""
        return gather_full_state_dict(self.model)


def _count_tokens(inputs: Any) -> int:
    if inputs is None:
        return 0
    if isinstance(inputs, Mapping):
        inputs = next(iter(inputs.values()))
    if isinstance(inputs, (tuple, list)):
        inputs = inputs[0]
    return int(inputs.numel()) if isinstance(inputs, torch.Tensor) and not inputs.is_floating_point() \
        else int(inputs.shape[0])


def _is_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def _check_layout(args: TrainingArguments, layout: ParallelLayout) -> None:
    for name in ("tp", "pp"):
        if getattr(args, name) != getattr(layout, name):
            raise ValueError(f"TrainingArguments.{name}={getattr(args, name)} but the layout has "
                             f"{name}={getattr(layout, name)}: build both from the same degrees")
    if args.dp is not None and args.dp != layout.dp:
        raise ValueError(f"TrainingArguments.dp={args.dp} but the layout has dp={layout.dp}: build both from "
                         "the same degrees, or set dp=None to take the layout's")
