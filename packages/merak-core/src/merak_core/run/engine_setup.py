"""Setting up a parallel step: the schedule and its pipeline runner, the DP gradient sync, the optimizer.

:class:`merak_core.run.engine.ParallelEngine` builds its parts here, each from explicit inputs (the
composed model, the layout, the run's arguments), in this order: the schedule is named
(:func:`schedule_name`; the arguments and the layout were checked together by
:func:`merak_core.run.bootstrap.check_layout`); ZeRO-2/3 shards the model over DP
(:func:`shard_parallel_model`); the pipeline runner is built with the schedule and its
recomputation plan (:func:`build_runner`); the DP gradient sync (:func:`build_dp_sync`) and the
optimizer (:func:`build_optimizer`: AdamW by default, ZeRO-1 over DP when asked) follow.

Not done here: running a step (``engine.py``), composing the model (``compose.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from merak_core.config import TrainingArguments
from merak_core.parallel.compose import ParallelModel
from merak_core.parallel.data_parallel import DataParallelGradSync
from merak_core.parallel.expert_parallel import ExpertParallelGradSync
from merak_core.parallel.fsdp import ShardedDataParallel
from merak_core.parallel.layout import ParallelLayout
from merak_core.parallel.zero import ZeroOptimizer
from merak_core.parallel.zero_experts import expert_sharding
from merak_graph import PARAM_MEMORY_FACTOR
from merak_pipe import schedule_info

OptimizerFactory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]

__all__ = [
    "OptimizerFactory",
    "build_dp_sync",
    "build_optimizer",
    "build_runner",
    "check_loss_fn",
    "schedule_name",
    "shard_parallel_model",
]


def schedule_name(args: TrainingArguments) -> str:
    """The merak-pipe schedule for ``args.schedule`` (``auto``: shifted critical path with a budget, else 1F1B)."""
    name = args.schedule
    if name == "auto":
        name = "shifted-critical-path" if args.memory_budget is not None else "1f1b"
    return schedule_info(name).name


# ---------------------------------------------------------------------------- the runner


def build_runner(
    model: ParallelModel,
    layout: ParallelLayout,
    args: TrainingArguments,
    *,
    schedule_name: str,
    device: torch.device,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    sharded: bool,
) -> Any:
    """The pipeline runner of ``model`` (a :class:`merak_pipe.PipelineRunner`): its schedule, stages and recomputation.

    ``sharded``: ZeRO-2/3 sums the copies of shared parameters on the gradient shards
    (:meth:`ShardedDataParallel.finish`), so the runner is given none.
    """
    from merak_pipe import PipelineRunner, PipelineStage, build_schedule

    recompute = _recompute_plan(model, layout, args, schedule_name)
    num_stages = model.num_stages  # pp * virtual_stages
    schedule = build_schedule(
        schedule_name,
        num_stages=num_stages,
        num_ranks=layout.pp,
        num_microbatches=args.num_microbatches,
        recompute=recompute,
    )
    modules = model.stage_modules or {layout.pp_rank: model.module}
    if args.compile:  # after TP, the cut and ZeRO made the modules ([Note: compiled stages])
        from merak_core.parallel.compile import compile_stages

        modules = compile_stages(dict(modules), args, recompute=recompute, schedule=schedule_name)
    stages = [
        PipelineStage(module, stage_index=s, num_stages=num_stages, group=layout.pp_group, device=device)
        for s, module in sorted(modules.items())
    ]
    return PipelineRunner(
        stages,
        schedule,
        loss_fn=loss_fn,
        group=layout.pp_group,
        shared_parameters=model.shared_parameters if not sharded else [],
        timeout=layout.timeout,
    )


def _recompute_plan(
    model: ParallelModel, layout: ParallelLayout, args: TrainingArguments, schedule_name: str
) -> Any:
    from merak_pipe import RecomputePlan

    mode, fraction = args.recompute_mode
    pp = model.num_stages
    if mode == "none":
        return None
    if mode == "full":
        return RecomputePlan.full(pp)
    if mode == "uniform":
        return RecomputePlan.uniform(pp, float(fraction or 0.0))
    return _stage_aware_plan(model, layout, args, schedule_name)


def _stage_aware_plan(
    model: ParallelModel, layout: ParallelLayout, args: TrainingArguments, schedule_name: str
) -> Any:
    from merak_pipe import build_schedule, stage_aware_plan

    part = model.partition
    if part is None or args.memory_budget is None:
        raise ValueError(
            "recompute='stage_aware' needs pp > 1 and memory_budget (bytes per rank, e.g. '2GiB'): "
            f"got pp={layout.pp}, memory_budget={args.memory_budget}"
        )
    layer_bytes = []
    for info in part.stage_info:
        lo, hi = info.shard_range
        n = max(1, hi - lo)
        layer_bytes.append([info.activation_bytes / n] * n)
    probe = build_schedule(
        schedule_name,
        num_stages=model.num_stages,
        num_ranks=layout.pp,
        num_microbatches=args.num_microbatches,
    )
    static = [info.param_bytes * PARAM_MEMORY_FACTOR for info in part.stage_info]  # as the partitioner counts
    return stage_aware_plan(
        layer_activation_bytes=layer_bytes,
        memory_budget=float(args.memory_budget),
        static_bytes=static,
        schedule=probe,
    )


def check_loss_fn(model: ParallelModel, loss_fn: Callable[[Any, Any], torch.Tensor], labels: Any) -> None:
    """With pp > 1, try ``loss_fn`` on meta tensors shaped like the model's output and one microbatch of labels.

    Every rank does it, so labels the loss cannot take fail here, on all ranks, instead of in the
    last stage alone while the other stages wait for its gradients until the timeout. Only a model
    whose output is one tensor is checked; errors caused by the meta device itself are ignored.
    """
    part = model.partition
    if part is None or not isinstance(labels, torch.Tensor) or len(part.stage_info[-1].outputs) != 1:
        return
    out = part.stage_info[-1].outputs[0]
    if out.dtype is None:
        return
    output = torch.empty(out.shape, dtype=out.dtype, device="meta")
    try:
        loss_fn(output, labels.to("meta"))
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


# ---------------------------------------------------------------------------- DP sync and the optimizer


def build_dp_sync(
    model: ParallelModel, layout: ParallelLayout, sharded: ShardedDataParallel | None, *, zero_stage: int = 0
) -> DataParallelGradSync | ShardedDataParallel | None:
    """The DP gradient sync: the ZeRO-2/3 sharding, else bucketed all-reduces (None without DP).

    ZeRO-1 at dp > 1 (cp = 1): the buckets are reduce-scattered to their owners
    ([Note: ZeRO-1 reduce-scatter] in :mod:`merak_core.parallel.data_parallel`); give the sync to
    :func:`build_optimizer`.
    """
    if sharded is not None:
        return sharded
    if layout.dp * layout.cp == 1:
        return None
    if layout.ep > 1:  # dense over DP, experts over their replica group (merak_core.parallel.expert_parallel)
        return ExpertParallelGradSync(
            model.module,
            layout,
            deferred_params=[p for p, _ in model.shared_parameters],
            shard_gradients=zero_stage == 1,  # [Note: ZeRO-1 with experts]
        )  # type: ignore[return-value]  # the same interface
    # Shared (tied) parameters get their cross-stage sum after the backward: reduce them last.
    # CP ranks hold the same parameters: the sync averages over DP x CP (merak_core.parallel.context_parallel).
    return DataParallelGradSync(
        model.module,
        layout.grad_sync_group,
        deferred_params=[p for p, _ in model.shared_parameters],
        shard_gradients=zero_stage == 1 and layout.dp > 1 and layout.cp == 1,
    )


def build_optimizer(
    named: Sequence[tuple[str, nn.Parameter]],
    layout: ParallelLayout,
    args: TrainingArguments,
    *,
    device: torch.device,
    factory: OptimizerFactory | None = None,
    grad_sync: DataParallelGradSync | ExpertParallelGradSync | None = None,
) -> torch.optim.Optimizer:
    """``factory`` (default: AdamW from ``args``) over the decay groups; ZeRO-1 shards it over DP.

    ``grad_sync``: the DP sync, which under ZeRO-1 reduce-scatters to the parameters' owners.
    """
    groups = _decay_groups(named, args.weight_decay)
    make = factory or (lambda g: _adamw(g, args, device))
    if args.zero_stage == 1 and layout.dp > 1:
        return ZeroOptimizer(groups, make, group=layout.dp_group, grad_sync=grad_sync)
    return make(groups)


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


def _adamw(groups: list[dict[str, Any]], a: TrainingArguments, device: torch.device) -> torch.optim.Optimizer:
    # Fused kernels on CUDA; the multi-tensor path on CPU (bit-identical to the per-parameter loop).
    fused = device.type == "cuda"
    return torch.optim.AdamW(
        groups,
        lr=a.learning_rate,
        betas=(a.adam_beta1, a.adam_beta2),
        eps=a.adam_epsilon,
        weight_decay=a.weight_decay,
        foreach=not fused,
        fused=fused,
    )


def shard_parallel_model(
    model: ParallelModel,
    *,
    zero_stage: int,
    device: torch.device,
    param_dtype: torch.dtype | None = None,
) -> tuple[ShardedDataParallel, ParallelModel]:
    """Shard this rank's part of ``model`` over its DP group (DP x CP at cp > 1: ``layout.grad_sync_group``,
    the ranks holding the same parameters); the sharded object and the updated model.

    The returned :class:`~merak_core.parallel.compose.ParallelModel` is ``model`` with its shared-parameter
    lists pointing at the sharded parameters (the modules are sharded in place). Give the pipeline
    runner no shared parameters: :meth:`ShardedDataParallel.finish` sums their copies.
    """
    layout = model.layout
    stages = dict(model.stage_modules) or {layout.pp_rank if layout.pp > 1 else 0: model.module}
    sharded = ShardedDataParallel(
        stages,
        layout.grad_sync_group,
        zero_stage=zero_stage,
        device_type=device.type,
        num_stages=model.num_stages,
        shared_parameters=model.shared_parameters,
        param_dtype=param_dtype,
        experts=expert_sharding(layout),  # ep > 1: experts over their replica group (parallel.zero_experts)
    )
    owner = {sharded.param_map.get(id(p), p): stage for p, stage in model.shared_owner.items()}
    return sharded, dataclasses.replace(
        model, shared_parameters=sharded.shared_parameters, shared_owner=owner
    )
