"""One way from a job to a run ready to train: :func:`prepare_job` and :func:`prepare_run`.

::

    prepared = prepare_job(job, job.build_datasets())     # merak train / eval / generate, benchmarks
    trainer = Trainer.from_prepared(prepared)
    trainer = Trainer(model, args, train_dataset)          # the Python API: prepare_run, then the same

:func:`prepare_run` does, once and in this order, everything before the loop: the layout (planning
first with ``layout: auto``, and the plan check's context with ``plan_check_steps``: the planner
runs here and nowhere else), the refusals that need only the model and the arguments (LoRA, context
and expert parallelism, sequence parallelism, training samples; before any process group), the
process groups and the device, the training loader, the example batch, the composed model with its
pretrained weights and adapters, and the step engine with its optimizer. The result,
:class:`PreparedRun`, is what :class:`~merak_core.trainer.Trainer` assembles; it never plans.
:func:`prepare_job` starts from a :class:`~merak_core.job.JobConfig`: the job's callables, its
model built under the job's seed once the layout is known, and the same :func:`prepare_run`.

Not done here: the loop, evaluation, checkpoints and metrics (the Trainer); torchrun's arrival and
the restarted process group (``merak_core.launch``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import torch
from torch import nn

from merak_core.config import TrainingArguments
from merak_core.data.batch_ids import IdRanges
from merak_core.data.loader import StageAwareDataLoader
from merak_core.lora import LoraConfig
from merak_core.parallel.context_parallel import check_cp_model, cp_run_for
from merak_core.parallel.fsdp import SHARDED_ZERO_STAGES
from merak_core.parallel.layout import ParallelLayout, init
from merak_core.planner import PlanContext
from merak_core.run import bootstrap
from merak_core.run.cadence import training_steps
from merak_core.run.engine import LossFn, ParallelEngine, default_loss

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["PreparedRun", "RunOptions", "prepare_job", "prepare_run"]


class RunOptions(TypedDict, total=False):
    """The keyword-only options of :func:`prepare_run` and :class:`~merak_core.trainer.Trainer` (documented
    there), spelled once."""

    compute_metrics: Any
    layout: ParallelLayout | None
    example_inputs: Mapping[str, Any] | Sequence[Any] | None
    init_fn: Callable[[nn.Module], Any] | None
    optimizer_factory: Callable[[list[dict[str, Any]]], torch.optim.Optimizer] | None
    device: torch.device | str | None
    plan_context: PlanContext | None
    pretrained: str | os.PathLike[str] | None
    lora: LoraConfig | None


@dataclass
class PreparedRun:
    """Everything the Trainer assembles (see the module docstring)."""

    args: TrainingArguments
    """The arguments trained with (``layout: auto`` resolved to the planned layout)."""
    layout: ParallelLayout
    device: torch.device
    engine: ParallelEngine
    """The step engine over this rank's composed model, with its optimizer and schedule."""
    train_loader: StageAwareDataLoader | None
    loss_fn: LossFn
    """The loss the engine uses (context parallelism's when cp > 1)."""
    cp_run: Any
    """The context-parallel run (splits batches, attention over the cp group), or None at cp=1."""
    id_ranges: IdRanges
    """The whole model's id sizes, checked on every batch."""
    samples: Any
    """The training samples' settings (:class:`merak_core.run.samples.TrainingSamples`)."""
    plan_context: PlanContext | None
    """The planner's profile and machine for the plan check, or None."""
    pretrained_path: str | None
    """The Hugging Face folder the run started from (recorded in checkpoints for ``merak export``)."""
    train_dataset: Any = None
    eval_dataset: Any = None
    data_collator: Callable[[list[Any]], Any] | None = None
    compute_metrics: Any = None


def _plan(
    model: nn.Module,
    args: TrainingArguments,
    train_dataset: Any,
    *,
    layout: ParallelLayout | None,
    plan_context: PlanContext | None,
    data_collator: Callable[[list[Any]], Any] | None,
    device: torch.device | str | None,
    lora: LoraConfig | None,
    given: tuple[bool, bool],
) -> tuple[TrainingArguments, PlanContext | None]:
    """``layout: auto`` and the plan check's context (collective: see [Note: layout auto] in config);
    ``given``: whether a custom loss and metrics are given (context parallelism refuses them)."""
    if not (args.layout == "auto" or (args.plan_check_steps and plan_context is None)):
        return args, plan_context
    if args.layout == "auto" and layout is not None:
        raise ValueError("layout='auto' chooses dp/tp/pp itself: do not pass layout= (or use layout: manual)")
    from merak_core.autoplan.auto import PlanInputs, plan_for_job

    inputs = PlanInputs(
        data_collator=data_collator,
        device=device,
        lora=lora,
        loss_fn_given=given[0],
        compute_metrics_given=given[1],
    )
    return plan_for_job(args, model, train_dataset, inputs)


def _refuse_before_groups(
    model: nn.Module,
    args: TrainingArguments,
    *,
    layout: ParallelLayout | None,
    lora: LoraConfig | None,
    loss_fn_given: bool,
    compute_metrics_given: bool,
) -> None:
    """What the model and the arguments alone refuse, on every rank alike, before any process group."""
    if lora is not None:
        bootstrap.check_lora(model, args, layout, lora)
    if args.cp > 1:  # merak_core.parallel.context_parallel
        check_cp_model(
            model, args, lora=lora, loss_fn_given=loss_fn_given, compute_metrics_given=compute_metrics_given
        )
    if args.ep > 1 or args.moe_capacity_factor is not None:  # merak_core.parallel.expert_parallel
        from merak_core.parallel.expert_parallel import check_ep_model

        check_ep_model(model, args, lora=lora)
    from merak_core.parallel.router_aux import check_router_aux  # [Note: global router aux loss]

    check_router_aux(
        model,
        layout.pp if layout is not None else args.pp,
        layout.cp if layout is not None else args.cp,
        args.recompute_mode[0],
    )
    if args.sequence_parallel and (layout.tp if layout is not None else args.tp) > 1:
        from merak_core.checks.tp_check import check_sequence_parallel

        check_sequence_parallel(model, args.tp_plan)


def _train_loader(
    args: TrainingArguments,
    layout: ParallelLayout,
    device: torch.device,
    train_dataset: Any,
    data_collator: Callable[[list[Any]], Any] | None,
) -> StageAwareDataLoader | None:
    if train_dataset is None:
        return None
    return StageAwareDataLoader.from_training_args(
        train_dataset, args, layout, collate_fn=data_collator, device=device
    )


def prepare_run(
    model: nn.Module | None,
    args: TrainingArguments,
    train_dataset: Any = None,
    eval_dataset: Any = None,
    loss_fn: LossFn | None = None,
    data_collator: Callable[[list[Any]], Any] | None = None,
    **options: Unpack[RunOptions],
) -> PreparedRun:
    """The run of ``model`` under ``args``, ready to train (the Trainer's arguments; see the module doc)."""
    unknown = sorted(set(options) - set(RunOptions.__annotations__))
    if unknown:
        raise TypeError(
            f"unexpected keyword arguments {unknown}; expected some of {sorted(RunOptions.__annotations__)}"
        )
    compute_metrics, layout = options.get("compute_metrics"), options.get("layout")
    device, plan_context, lora = options.get("device"), options.get("plan_context"), options.get("lora")
    init_fn, pretrained = options.get("init_fn"), options.get("pretrained")
    example_inputs, optimizer_factory = options.get("example_inputs"), options.get("optimizer_factory")
    model, weights, init_fn = bootstrap.pretrained_start(model, args, pretrained, init_fn)
    pretrained_path = None if pretrained is None else str(Path(pretrained).resolve())
    args, plan_context = _plan(
        model,
        args,
        train_dataset,
        layout=layout,
        plan_context=plan_context,
        data_collator=data_collator,
        device=device,
        lora=lora,
        given=(loss_fn is not None, compute_metrics is not None),
    )
    _refuse_before_groups(
        model,
        args,
        layout=layout,
        lora=lora,
        loss_fn_given=loss_fn is not None,
        compute_metrics_given=compute_metrics is not None,
    )
    from merak_core.run.samples import TrainingSamples

    samples = TrainingSamples.prepare(  # before any process group: refusals on every rank alike
        args, model, layout.pp if layout is not None else args.pp, pretrained_path
    )
    layout = bootstrap.run_layout(args, layout, device)
    run_device = bootstrap.run_device(layout, device)
    cp_run = None if layout.cp == 1 else cp_run_for(model, layout, args.cp_mode)
    if cp_run is not None:  # each rank reads only its tokens, where the data can (the text data)
        train_dataset, eval_dataset = cp_run.read_here(train_dataset), cp_run.read_here(eval_dataset)
    run_loss = cp_run.loss if cp_run is not None else (loss_fn or default_loss)
    id_ranges = IdRanges.of(model, default_loss=loss_fn is None)  # the whole model's sizes
    train_loader = _train_loader(args, layout, run_device, train_dataset, data_collator)
    example_labels, read_here = None, False
    if example_inputs is None:
        source = train_dataset if train_dataset is not None else eval_dataset
        read_here = cp_run is not None and cp_run.reads_here(source)
        example_inputs, example_labels = bootstrap.example_batch(
            source,
            data_collator,
            args.micro_batch_size,
            labels=args.labels,  # every rank checks them, before any collective
        )
    if cp_run is not None:  # the model is composed on this rank's tokens
        example_inputs, example_labels = cp_run.split(example_inputs, example_labels, read_here=read_here)
    composed = bootstrap.compose(
        model, args, layout, run_device, example_inputs=example_inputs, init_fn=init_fn, lora=lora
    )
    # ZeRO-2/3: the weights go into the shards FSDP2 cuts in the engine, each rank reading only its rows.
    load_sharded = weights is not None and args.zero_stage in SHARDED_ZERO_STAGES
    if weights is not None and not load_sharded:
        weights.load_into(composed)  # this rank's slices, before the optimizer sees the parameters
    if lora is not None:
        from merak_core.hf.adapters import start_adapters

        start_adapters(composed, lora, seed=args.seed)  # drawn like PEFT, or read from lora.from_dir
    from merak_core.parallel.router_aux import with_router_aux_loss

    engine = ParallelEngine(
        composed,
        layout,
        args,
        device=run_device,
        loss_fn=with_router_aux_loss(model, run_loss, layout.dp_group, example_inputs),  # router aux over DP
        num_training_steps=training_steps(args, train_loader),
        example_labels=example_labels,
        optimizer_factory=optimizer_factory,
    )
    if weights is not None and load_sharded:  # the engine read no parameter's value before this
        weights.load_into(engine.model)  # [Note: bounded checkpoint loads]
    return PreparedRun(
        args=args,
        layout=layout,
        device=run_device,
        engine=engine,
        train_loader=train_loader,
        loss_fn=run_loss,
        cp_run=cp_run,
        id_ranges=id_ranges,
        samples=samples,
        plan_context=plan_context,
        pretrained_path=pretrained_path,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        data_collator=data_collator,
        compute_metrics=compute_metrics,
    )


def prepare_job(
    job: Any,
    datasets: tuple[Any, Any],
    *,
    args: TrainingArguments | None = None,
    job_file: str | None = None,
    job_overrides: Sequence[str] = (),
    load_pretrained: bool = True,
    plan_context: PlanContext | None = None,
) -> PreparedRun:
    """The run of a :class:`~merak_core.job.JobConfig` on the world's ranks (collective).

    ``datasets``: the (train, eval) datasets to use (``job.build_datasets()``, or one of them for
    ``merak eval`` / ``merak generate``); ``args``: the job's training arguments as the command
    adjusts them (default ``job.training``); ``job_file`` and ``job_overrides`` go to the plan check
    (its ``replanned.yaml``); ``load_pretrained=False`` (a run that loads a checkpoint next) skips
    reading ``model.pretrained``'s weights; ``plan_context``: the plan check's context when the caller
    has one (a manual layout: nothing is profiled then). ``layout: auto`` is planned here, once; then the process
    groups are made, the model is built under the job's seed and :func:`prepare_run` does the rest.
    """
    from merak_core.autoplan.auto import PlanInputs, plan_for_job

    targs = job.training if args is None else args
    train_data, eval_data = datasets
    collate = job.optional("collate")
    if plan_context is None or targs.layout == "auto":
        inputs = PlanInputs(
            data_collator=collate,
            job_file=job_file,
            job_overrides=tuple(job_overrides),
            lora=job.model.lora,
            loss_fn_given=job.optional("loss") is not None,
            compute_metrics_given=job.optional("metrics") is not None,
        )
        targs, plan_context = plan_for_job(targs, job.build_model, train_data, inputs)
    layout = init(dp=targs.dp, tp=targs.tp, pp=targs.pp, cp=targs.cp, ep=targs.ep, timeout=targs.comm_timeout)
    torch.manual_seed(targs.seed)
    return prepare_run(
        job.build_model(),
        targs,
        train_data,
        eval_data,
        loss_fn=job.optional("loss"),
        data_collator=collate,
        compute_metrics=job.optional("metrics"),
        layout=layout,
        plan_context=plan_context,
        pretrained=job.model.pretrained if load_pretrained else None,
        lora=job.model.lora,  # a LoRA run's checkpoint holds the adapters too
    )
