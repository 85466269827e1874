"""Start-up: the process group, this rank's device, and preparing a run before its first step.

Every start-up path goes through here: the Trainer, the planner (``layout: auto``, the TP probe)
and the CLI. Process groups and devices themselves are created by :mod:`merak_core.parallel.layout`
(:func:`~merak_core.parallel.layout.ensure_process_group`, :func:`~merak_core.parallel.layout.select_device`,
[Note: one device]); this module is where a run asks for them:

- :func:`process_group` — the default process group (if nobody made it) and this rank's device;
- :func:`run_layout` / :func:`run_device` — the layout a run trains on and the device it computes on;
- :func:`autocast` — the one bf16 autocast context of a step, an evaluation or a profile;
- :func:`first_samples` / :func:`example_batch` — the first samples of a dataset (for tracing and
  profiling), one microbatch of them split into inputs and labels;
- :func:`pretrained_start` — the model and the matched weights of a run started from a Hugging Face folder;
- :func:`compose` — the model in the run's dtype, its TP plan checked, composed for this rank.

Not done here: the step itself (``engine.py``) and the loop (``trainer.py``).
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from merak_core.config import TrainingArguments
from merak_core.lora import LoraConfig
from merak_core.parallel.compose import ParallelModel, build_parallel_model
from merak_core.parallel.devices import select_device
from merak_core.parallel.layout import ParallelLayout, ensure_process_group, init
from merak_core.parallel.virtual_stages import stage_placement

__all__ = [
    "check_layout",
    "check_lora",
    "compose",
    "example_batch",
    "first_samples",
    "is_meta",
    "pretrained_start",
    "process_group",
    "run_device",
    "run_layout",
]


def configure_rank_process() -> int:
    """Set up a torchrun rank's process (``merak train``, ``eval`` and ``generate``): this rank's logging
    (INFO on rank 0, WARNING elsewhere, each line prefixed with the rank) and torch's thread count from
    ``OMP_NUM_THREADS``. Returns the global rank torchrun gave."""
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"[rank {rank}] %(asctime)s %(name)s %(levelname)s %(message)s",
    )
    if "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    return rank


def process_group(device: torch.device | str | None = None) -> torch.device:
    """The default process group (created as :func:`merak_core.init` does, if nobody did) and this rank's device."""
    return ensure_process_group(device)


def is_meta(model: nn.Module) -> bool:
    """Whether ``model`` was built on the meta device (``merak_graph.empty_init``)."""
    return any(p.is_meta for p in model.parameters())


def check_layout(args: TrainingArguments, layout: ParallelLayout) -> None:
    """ValueError when ``args``' degrees disagree with ``layout``'s, or its microbatches cannot fill the pipeline.

    (Whether the schedule runs ``args.virtual_stages`` stages per rank is checked with the arguments
    themselves and where the stages are placed, :mod:`merak_core.parallel.virtual_stages`.)
    """
    for name in ("tp", "pp", "cp", "ep"):
        if getattr(args, name) != getattr(layout, name):
            raise ValueError(
                f"TrainingArguments.{name}={getattr(args, name)} but the layout has "
                f"{name}={getattr(layout, name)}: build both from the same degrees"
            )
    if args.dp is not None and args.dp != layout.dp:
        raise ValueError(
            f"TrainingArguments.dp={args.dp} but the layout has dp={layout.dp}: build both from "
            "the same degrees, or set dp=None to take the layout's"
        )
    num_micro = args.num_microbatches
    if layout.pp > 1 and num_micro < layout.pp:
        raise ValueError(
            f"gradient_accumulation_steps={num_micro} microbatches is fewer than pp={layout.pp} stages: "
            f"the pipeline would idle; use at least {layout.pp} microbatches"
        )


def run_layout(
    args: TrainingArguments, layout: ParallelLayout | None = None, device: torch.device | str | None = None
) -> ParallelLayout:
    """``layout``, or :func:`merak_core.init` from ``args``' degrees; checked against ``args``."""
    if layout is None:
        layout = init(
            dp=args.dp,
            tp=args.tp,
            pp=args.pp,
            cp=args.cp,
            ep=args.ep,
            device=device,
            timeout=args.comm_timeout,
        )
    check_layout(args, layout)
    return layout


def run_device(layout: ParallelLayout, device: torch.device | str | None = None) -> torch.device:
    """The device a run computes on: ``device`` when given (through ``select_device``), else the layout's."""
    return select_device(device) if device is not None else layout.device


def first_samples(dataset: Any, count: int) -> list[Any]:
    """Up to ``count`` samples from the start of ``dataset`` (map-style by index, else by iterating)."""
    if hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"):
        return [dataset[i] for i in range(min(count, len(dataset)))]
    return list(itertools.islice(iter(dataset), count))


def example_batch(
    dataset: Any, collate: Callable[[list[Any]], Any] | None, batch_size: int, *, labels: str = "shifted"
) -> tuple[Any, Any]:
    """The first ``batch_size`` samples of ``dataset``, collated and split into ``(inputs, labels)`` under the
    label convention ``labels`` (``TrainingArguments.labels``)."""
    if dataset is None:
        raise ValueError(
            "Trainer needs a train_dataset, an eval_dataset or example_inputs to trace the model"
        )
    from merak_core.data.loader import label_split

    samples = first_samples(dataset, batch_size)
    if len(samples) < batch_size:
        raise ValueError(
            f"the dataset has {len(samples)} samples, fewer than one microbatch of {batch_size} "
            "(per_device_train_batch_size): use a smaller microbatch or more samples"
        )
    return label_split(labels)((collate or torch.utils.data.default_collate)(samples))


def _check_tp_plan(
    args: TrainingArguments, layout: ParallelLayout, model: nn.Module, example_inputs: Any
) -> None:
    """``training.tp_check``: every module the plan shards against the unsharded one (merak_core.checks.tp_check)."""
    if is_meta(model):
        raise ValueError(
            "training.tp_check=true needs a model with real weights (this one is on the meta "
            "device); run `merak check JOB.yaml` on a machine where it fits, or set tp_check=false"
        )
    import merak_tp
    from merak_core.checks.tp_check import check_before_training

    plan: Any = args.tp_plan
    plan = (
        None
        if plan in (None, "auto")
        else merak_tp.plan_from_mapping(plan)
        if isinstance(plan, dict)
        else plan
    )
    check_before_training(model, example_inputs, plan=plan, group=layout.tp_group)


def compose(
    model: nn.Module,
    args: TrainingArguments,
    layout: ParallelLayout,
    device: torch.device,
    *,
    example_inputs: Mapping[str, Any] | Sequence[Any] | Any,
    init_fn: Callable[[nn.Module], Any] | None = None,
    lora: LoraConfig | None = None,
) -> ParallelModel:
    """``model`` in ``args.torch_dtype``, its TP plan checked (``tp_check``), composed for this rank
    (with ``lora``: adapters on its targets, the rest frozen; the caller fills the adapters)."""
    if not is_meta(model):
        model.to(dtype=args.torch_dtype)
    if args.tp_check and layout.tp > 1:
        _check_tp_plan(args, layout, model, example_inputs)
    # One default stream on every rank: dropout of replicated activations agrees across TP ranks.
    # At pp == 1 sharded activations (the plan's rng regions) draw from the TP stream, seeded per TP
    # rank and derived from the default generator, so recomputation and resumes replay it
    # (merak_tp.rng). Traced stages (pp > 1) keep the modules unwrapped: there, sharded dropout uses
    # the default stream too (the same masks for the heads of every rank).
    torch.manual_seed(args.seed + 1)
    tp_rng = None
    if layout.tp > 1 and layout.pp == 1:
        import merak_tp

        tp_rng = merak_tp.RNGTracker(device)
        tp_rng.add("tp", merak_tp.tp_seed(args.seed, layout.tp_group), derived=True)
    if args.moe_capacity_factor is not None:  # [Note: expert capacity] in merak_core.parallel.moe_capacity
        from merak_core.parallel.expert_hf import set_fused_capacity
        from merak_core.parallel.expert_parallel import set_moe_capacity

        set_moe_capacity(model, args.moe_capacity_factor, ep=layout.ep)
        set_fused_capacity(model, args.moe_capacity_factor, ep=layout.ep)  # transformers' fused experts
    return build_parallel_model(
        model,
        layout,
        example_inputs=example_inputs,
        tp_plan=args.tp_plan,
        overlap_chunks=args.overlap_chunks,
        device=device,
        init_fn=init_fn,
        rng_tracker=tp_rng,
        stage_to_rank=stage_placement(args.schedule, layout.pp, args.virtual_stages),
        sequence_parallel=args.sequence_parallel and layout.tp > 1,
        lora=lora,
    )


def check_lora(
    model: nn.Module, args: TrainingArguments, layout: ParallelLayout | None, lora: LoraConfig
) -> None:
    """ValueError before any process group: ``lora``'s targets against ``model`` (unsharded) and the
    run options LoRA does not compute exactly yet (:func:`merak_core.lora.check_lora_arguments`)."""
    from merak_core.lora import check_lora_arguments
    from merak_core.lora.apply import check_targets

    tp = layout.tp if layout is not None else args.tp
    dp = layout.dp if layout is not None else args.dp
    check_lora_arguments(tp=tp, dp=dp, args=args, config=lora)
    check_targets(model, lora)


def pretrained_start(
    model: nn.Module | None,
    args: TrainingArguments,
    pretrained: str | os.PathLike[str] | None,
    init_fn: Callable[[nn.Module], Any] | None,
) -> tuple[nn.Module, Any, Any]:
    """(model, matched weights or None, init_fn) for ``Trainer(..., pretrained=PATH)``.

    The folder is matched to the model by name and shape here, on every rank alike, before any
    collective; a meta model is cast to the run's dtype and materialised without initialisation
    (every parameter is then loaded).
    """
    if pretrained is None:
        if model is None:
            raise ValueError(
                "Trainer needs a model, or pretrained=PATH (a Hugging Face folder) to build it from"
            )
        return model, None, init_fn
    from merak_core.hf import PretrainedWeights, pretrained_model, skip_init

    if model is None:
        model = pretrained_model(pretrained, dtype=args.torch_dtype)
    elif is_meta(model):
        model.to(dtype=args.torch_dtype)
    return model, PretrainedWeights.match(model, pretrained), init_fn or skip_init
