"""``layout: auto`` at start-up: profile the job's model, measure the machine, plan, and agree on every rank.

:func:`auto_layout` runs on every rank after the default process group exists and before
``init(dp, tp, pp)``: rank 0 profiles a copy of the job's model on one microbatch of the training
set (:func:`~merak_core.planner.profile_model`) and times the runtime's split backward on its first
block (:func:`~merak_core.planner.action_cost.measure_split_backward_scale`, broadcast), every rank takes part in
:func:`~merak_core.planner.measure_comm` and
:func:`~merak_core.planner.action_cost.measure_action_cost` on the world group, rank 0 plans for the world size
(:func:`~merak_core.planner.plan`, memory per device, the job's global batch, CPU cores shared by
the ranks) and broadcasts the choice; every rank returns the same :class:`TrainingArguments` with
dp, tp, pp, schedule, microbatches, recompute (and memory budget) set. See [Note: layout auto] in
:mod:`merak_core.config` for which fields fix the global batch.

:func:`plan_for_job` is what the Trainer and ``merak train`` call first: :func:`auto_layout` for
``layout: auto``, :func:`build_plan_context` (profile + communication, no planning) for a manual
layout with ``plan_check_steps``, nothing otherwise.

Not done here: the plan check of a running job (:mod:`merak_core.autoplan.check`), the TP probe
(:mod:`merak_core.autoplan.probe`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from merak_core.autoplan.givens import (
    auto_degrees_note,
    auto_global_batch,
    compute_slots,
    default_memory_per_device,
    model_degrees,
)
from merak_core.autoplan.probe import slowest_probe_note
from merak_core.autoplan.profiling import cast_floats, job_model_and_batch, profile_inputs, with_adapters
from merak_core.config import TrainingArguments
from merak_core.parallel.devices import autocast
from merak_core.planner import (
    Candidate,
    ModelProfile,
    PlanContext,
    format_plan,
    measure_comm,
    measure_contention,
    plan,
    profile_model,
)
from merak_core.planner.action_cost import (
    check_split_backward_scale,
    measure_action_cost,
    measure_split_backward_scale,
)
from merak_core.planner.choices import searched_virtual_stages
from merak_core.planner.context_cost import runnable_cp
from merak_core.planner.profile import tp_constraints
from merak_core.run.bootstrap import process_group

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_PLAN_CHECK_STEPS",
    "AutoLayout",
    "PlanInputs",
    "auto_layout",
    "build_plan_context",
    "cast_floats",
    "plan_for_job",
    "profile_for_plan",
    "profile_inputs",
    "with_adapters",
]

DEFAULT_PLAN_CHECK_STEPS = 5
"""``plan_check_steps`` of an auto layout when the job does not set it."""


@dataclasses.dataclass(frozen=True)
class AutoLayout:
    """What :func:`auto_layout` chose, the same on every rank."""

    args: TrainingArguments
    """The job's arguments with the chosen fields (``layout`` becomes ``manual``: the degrees are set)."""
    context: PlanContext
    """Profile, communication model and machine the plan was made from (for the plan check)."""
    chosen: Candidate
    """The planner's first candidate."""
    table: str
    """The ranked table (:func:`~merak_core.planner.format_plan`) with why the first wins."""


@dataclasses.dataclass(frozen=True)
class PlanInputs:
    """What planning reads of a job besides its arguments, model and training set (all optional)."""

    data_collator: Callable[[list[Any]], Any] | None = None
    device: torch.device | str | None = None
    job_file: str | None = None
    """The job file and its overrides, for the plan check's ``replanned.yaml``."""
    job_overrides: Sequence[str] = ()
    lora: Any = None
    """The job's :class:`~merak_core.LoraConfig`: the profiled copy gets its adapters."""
    loss_fn_given: bool = False
    """A custom loss or metrics: context parallelism refuses them, so ``layout: auto`` then keeps cp=1
    (unless the job's cp says otherwise and the run refuses it by name)."""
    compute_metrics_given: bool = False


def _relax_vocab(profile: ModelProfile, model: nn.Module, tp_plan: Any) -> ModelProfile:
    """A user TP plan that shards no ``nn.Embedding`` puts no constraint on the vocabulary
    (:func:`~merak_core.planner.profile.tp_constraints`)."""
    if profile.vocab_size is not None and tp_constraints(model, tp_plan)[2] is None:
        return dataclasses.replace(profile, vocab_size=None)
    return profile


def profile_for_plan(
    model: nn.Module,
    batch: Any,
    *,
    tp_plan: Any,
    bf16: bool = False,
    device: torch.device | None = None,
    cache_dir: str | None = None,
) -> ModelProfile:
    """The profile the planner plans from: ``profile_model`` (under the run's autocast), the vocabulary
    unconstrained when the job's own TP plan shards no embedding. ``merak plan`` and ``layout: auto`` both use it."""
    with autocast(bf16, device if device is not None else torch.device("cpu")):
        profile = profile_model(model, batch, cache_dir=cache_dir)
    return _relax_vocab(profile, model, tp_plan)


def _cpu_compute_slots(
    args: TrainingArguments, built: tuple[nn.Module, Any] | None, device: torch.device
) -> float | None:
    """CPU ranks: world size / how much slower the real model runs with every rank at once (collective).

    ``built`` is this rank's model copy and microbatch (None when building it failed). Falls back to
    cores // threads per rank when any rank has none (every rank then agrees, so none waits in the
    measurement). GPUs: None (a device per rank).
    """
    slots = compute_slots(device)
    world = dist.get_world_size()
    if slots is None or world < 2:
        return slots
    flag = torch.tensor([1.0 if built is None else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() > 0 or built is None:
        return slots
    with autocast(args.bf16, device):
        contention = measure_contention(*built)
    return max(world / contention, 1.0)


def _profile_and_measure(
    args: TrainingArguments,
    model: nn.Module | Callable[[], nn.Module],
    train_dataset: Any,
    inputs: PlanInputs,
    what: str,
    decide: Callable[[ModelProfile, Any, float, float | None, dict[str, Any]], dict[str, Any]] | None = None,
    probe_tp: bool = False,
    per_action_s: float | None = None,
    split_backward_scale: float | None = None,
) -> tuple[dict[str, Any], Any]:
    """Rank 0 profiles, every rank measures communication, rank 0 ``decide``s; the payload on every rank.

    ``per_action_s`` and ``split_backward_scale`` are the ``CommModel`` terms to plan with; None:
    measured (every rank, :func:`~merak_core.planner.action_cost.measure_action_cost`; rank 0 on its
    model copy, :func:`~merak_core.planner.action_cost.measure_split_backward_scale`, then broadcast).

    ``decide`` gets the profile, the communication model, the memory per device, the compute slots and
    the cp and ep degrees the model allows (:func:`_model_degrees`, on rank 0's copy). Errors on rank 0
    (profiling, the planner's ValueError) are broadcast and raised on every rank as ValueError, so no
    rank waits for one that failed.
    """
    if train_dataset is None:
        raise ValueError(f"{what} profiles the model on the training set: pass train_dataset")
    dev = process_group(inputs.device)
    rank = dist.get_rank()
    profile: ModelProfile | None = None
    error = ""
    built: tuple[nn.Module, Any] | None = None
    degrees: dict[str, Any] = {}
    try:  # one copy of the model per rank: rank 0 profiles it, every rank times it for the contention
        built = job_model_and_batch(args, model, train_dataset, inputs.data_collator, dev, inputs.lora)
        if rank == 0:
            profile = profile_for_plan(*built, tp_plan=args.tp_plan, bf16=args.bf16, device=dev)
            if split_backward_scale is None and dist.get_world_size() > 1:
                with autocast(args.bf16, dev):
                    split_backward_scale = measure_split_backward_scale(*built)
            if decide is not None:
                degrees = _model_degrees(args, *built, inputs)
    except Exception as exc:  # noqa: BLE001 - reported on every rank below, so none waits forever
        if rank == 0:
            logger.exception("%s: profiling failed", what)
            error = f"{what}: profiling the model failed: {type(exc).__name__}: {exc}"
    slots = _cpu_compute_slots(args, built, dev)
    built = None  # the copy is not needed any more
    comm = measure_comm()
    # the pipeline runtime's own seconds per action, measured on these ranks unless given
    # ([Note: per-action measurement]); the planner prices it per action of a pipelined step
    measured = measure_action_cost(device=dev) if per_action_s is None else per_action_s
    split = _rank0_scale(split_backward_scale, dev)  # [Note: split backward measurement]
    comm = dataclasses.replace(comm, per_action_s=measured, split_backward_scale=split)
    probed: dict[int, tuple[float, int]] = {}
    if probe_tp:
        profile, error, probed = _with_tp_scale(
            args, model, train_dataset, inputs.data_collator, profile, error, comm, slots
        )
    payload: dict[str, Any] = {"error": error, "probe": probed}
    if rank == 0 and not error:
        assert profile is not None
        memory = float(args.memory_per_device or default_memory_per_device(dev))
        payload.update(profile=profile, memory=memory, slots=slots)
        if decide is not None:
            try:
                payload.update(decide(profile, comm, memory, slots, degrees))
            except ValueError as exc:
                payload["error"] = f"{what}: {exc}"
    box = [payload]
    dist.broadcast_object_list(box, src=0)
    payload = box[0]
    if payload["error"]:
        raise ValueError(payload["error"])
    return payload, comm


def _rank0_scale(scale: float | None, device: torch.device) -> float:
    """Rank 0's ``split_backward_scale`` on every rank (collective); 1 when it has none (one rank, no
    pipeline to split; or its profiling failed, which every rank raises next)."""
    box = torch.tensor([math.nan if scale is None else scale], dtype=torch.float64, device=device)
    dist.broadcast(box, src=0)
    value = float(box)
    return value if math.isfinite(value) else 1.0


def _model_degrees(
    args: TrainingArguments, model: nn.Module, batch: Any, inputs: PlanInputs
) -> dict[str, Any]:
    """The cp and ep degrees ``layout: auto`` searches for ``model`` (rank 0's copy) and ``batch`` (one
    training microbatch) on the world's ranks (:func:`~merak_core.autoplan.givens.model_degrees`, as
    ``merak plan``), and the model under ``"model"``."""
    flags = dict(loss_fn_given=inputs.loss_fn_given, compute_metrics_given=inputs.compute_metrics_given)
    degrees: dict[str, Any] = dict(
        model_degrees(model, batch, args, dist.get_world_size(), lora=inputs.lora, **flags)
    )
    degrees["model"] = model  # the built copy: the planner's candidates go through the run's checks with it
    return degrees


def _with_tp_scale(
    args: TrainingArguments,
    model: nn.Module | Callable[[], nn.Module],
    train_dataset: Any,
    data_collator: Any,
    profile: ModelProfile | None,
    error: str,
    comm: Any,
    slots: float | None,
) -> tuple[ModelProfile | None, str, dict[int, tuple[float, int]]]:
    """Every rank gets rank 0's profile; then the probe runs (collective) add ``tp_scale`` and
    ``overhead_scale`` to it. Skipped (on every rank alike) when profiling failed or for one rank.
    Also returns what the probe measured (:attr:`~merak_core.autoplan.probe.ProbeResult.measured`).
    """
    from merak_core.autoplan.probe import measure_tp_scale

    box = [(profile, error)]
    dist.broadcast_object_list(box, src=0)
    profile, error = box[0]
    world = dist.get_world_size()
    if error or profile is None or world < 2:
        return profile, error, {}
    result = measure_tp_scale(args, model, train_dataset, profile, comm, slots, data_collator=data_collator)
    return result.apply(profile), error, dict(result.measured)


def build_plan_context(
    args: TrainingArguments,
    model: nn.Module | Callable[[], nn.Module],
    train_dataset: Any,
    inputs: PlanInputs = PlanInputs(),
) -> PlanContext:
    """The plan check's :class:`PlanContext` for a manual layout (collective: call on every rank).

    Rank 0 profiles a copy of ``model`` (or what the function builds; with ``inputs.lora`` its adapters)
    on one microbatch of ``train_dataset``; every rank measures communication on the world group.
    """
    payload, comm = _profile_and_measure(args, model, train_dataset, inputs, "plan check")
    return _context(args, payload, comm, inputs)


def _context(
    args: TrainingArguments, payload: Mapping[str, Any], comm: Any, inputs: PlanInputs
) -> PlanContext:
    """The plan check's context from what :func:`_profile_and_measure` agreed on every rank."""
    return PlanContext(
        profile=payload["profile"],
        comm=comm,
        memory_per_device=payload["memory"],
        compute_slots=payload["slots"],
        zero_stage=args.zero_stage,
        virtual_stages=searched_virtual_stages(payload["slots"]),
        job_file=inputs.job_file,
        job_overrides=tuple(inputs.job_overrides),
    )


def auto_layout(
    args: TrainingArguments,
    model: nn.Module | Callable[[], nn.Module],
    train_dataset: Any,
    inputs: PlanInputs = PlanInputs(),
    *,
    per_action_s: float | None = None,
    split_backward_scale: float | None = None,
) -> AutoLayout:
    """Choose the layout for ``layout: auto`` (collective: call on every rank; see the module docstring).

    ``model`` is the job's model (rank 0 profiles a deep copy) or a function that builds one; with
    ``inputs.lora`` (a :class:`~merak_core.LoraConfig`) the copy gets the adapters and its frozen weights
    are planned as weights only. The search includes every cp and ep the model and the first training
    batch allow (:func:`_model_degrees`), whatever the job's cp and ep: an axis wins where the plan
    predicts it faster or where nothing fits without it. ``per_action_s`` is the pipeline runtime's seconds per action to plan
    with (``CommModel.per_action_s``); None: measured on the ranks (:func:`~merak_core.planner.action_cost.measure_action_cost`).
    ``split_backward_scale`` is the runtime's split backward against a full one, ``(I + W) / B``
    (``CommModel.split_backward_scale``, what ZB-H1 and ZB-V pay); None: measured on rank 0's copy
    of the model and broadcast (:func:`~merak_core.planner.action_cost.measure_split_backward_scale`).
    Degrees the job writes (dp/tp/pp) are replaced by the plan's, keeping the global batch they give
    (:func:`auto_global_batch`; one line says so). Raises ValueError before any collective when ``args``
    is not an auto layout or its global batch is not defined, and on every rank when nothing fits (the
    planner's message).
    """
    if args.layout != "auto":
        raise ValueError(f"auto_layout: layout={args.layout!r}; expected 'auto' (set training.layout: auto)")
    if train_dataset is None:
        raise ValueError("layout='auto' profiles the model on the training set: pass train_dataset")
    if split_backward_scale is not None:
        split_backward_scale = check_split_backward_scale("auto_layout", split_backward_scale)
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    gbs, _ = auto_global_batch(args, world)
    note = auto_degrees_note(args, world)
    if note is not None and dist.is_initialized() and dist.get_rank() == 0:
        logger.warning("%s", note)

    def decide(
        profile: ModelProfile, comm: Any, memory: float, slots: float | None, degrees: dict[str, Any]
    ) -> dict[str, Any]:
        try:
            cands = plan(
                profile,
                world_size=world,
                memory_per_device=memory,
                global_batch_size=gbs,
                comm=comm,
                zero_stage=args.zero_stage,
                compute_slots=slots,
                virtual_stages=searched_virtual_stages(slots),
                cp_degrees=degrees["cp"],
                cp_mode=args.cp_mode,
                ep_degrees=degrees["ep"],
            )
            cands = runnable_cp(cands, degrees.get("model", model))
        except ValueError as exc:
            raise ValueError(f"for {world} ranks, global batch {gbs}: {exc}") from None
        return {
            # cp and ep at 1 too: they replace the job's
            "fields": {**cands[0].training_fields(), "cp": cands[0].cp, "ep": cands[0].ep},
            "chosen": cands[0],
            "table": format_plan(cands),
            "count": len(cands),
        }

    payload, comm = _profile_and_measure(
        args,
        model,
        train_dataset,
        inputs,
        "layout='auto'",
        decide,
        args.plan_probe_tp,
        per_action_s,
        split_backward_scale,
    )
    checks = args.plan_check_steps if args.plan_check_steps is not None else DEFAULT_PLAN_CHECK_STEPS
    fields = dict(payload["fields"])
    new_args = dataclasses.replace(args, layout="manual", plan_check_steps=checks, **fields)
    if math.isfinite(payload["memory"]) and args.memory_per_device is None:
        new_args = dataclasses.replace(new_args, memory_per_device=int(payload["memory"]))
    context = _context(args, payload, comm, inputs)
    if dist.get_rank() == 0:
        replaced = {
            k: getattr(args, k)
            for k in fields
            if k not in ("dp", "tp", "pp") and getattr(args, k) != fields[k]
        }
        logger.info(
            "layout auto: %d feasible configurations for %d ranks, %.4g MiB per device, global batch %d, "
            "compute slots %.3g, runtime %.3g ms per action, split backward (I + W) / B %.3g "
            "(profile: %d layers on %s)\n%s",
            payload["count"],
            world,
            payload["memory"] / 2**20,
            gbs,
            payload["slots"],
            comm.per_action_s * 1e3,
            comm.split_backward_scale,
            context.profile.num_layers,
            context.profile.device,
            payload["table"],
        )
        logger.info(
            "layout auto: training with %s%s",
            " ".join(f"{k}={v}" for k, v in fields.items()),
            f" (replacing the job's {replaced})" if replaced else "",
        )
        slowest = slowest_probe_note(payload["chosen"], payload["probe"])
        if slowest is not None:
            logger.warning("%s", slowest)
    return AutoLayout(args=new_args, context=context, chosen=payload["chosen"], table=payload["table"])


def plan_for_job(
    args: TrainingArguments,
    model: nn.Module | Callable[[], nn.Module],
    train_dataset: Any,
    inputs: PlanInputs = PlanInputs(),
) -> tuple[TrainingArguments, PlanContext | None]:
    """What the Trainer and ``merak train`` do first (collective): the arguments to train with and the check's context.

    ``layout: auto``: :func:`auto_layout`. A manual layout with ``plan_check_steps``: the same
    arguments and :func:`build_plan_context` (when that fails, on every rank alike, a warning and
    no check). Otherwise the arguments unchanged and no context (nothing is communicated).
    """
    if args.layout == "auto":
        auto = auto_layout(args, model, train_dataset, inputs)
        return auto.args, auto.context
    if not args.plan_check_steps:
        return args, None
    try:
        return args, build_plan_context(args, model, train_dataset, inputs)
    except ValueError as exc:
        logger.warning("plan check off: %s", exc)
        return args, None
