"""What a job fixes before ``layout: auto`` plans: the global batch its written degrees count, the
memory per device and the ranks that can compute at once on this node.

Pure functions of the job's arguments and the machine (no collective); :mod:`merak_core.autoplan.auto`
plans with them, ``merak train --dry-run`` and ``merak plan`` print them.
"""

from __future__ import annotations

import copy
import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from merak_core.config import TrainingArguments

logger = logging.getLogger(__name__)

__all__ = [
    "auto_degrees_note",
    "auto_global_batch",
    "compute_slots",
    "default_memory_per_device",
    "model_degrees",
    "model_cp_degrees",
    "model_ep_degrees",
    "written_degrees",
]


def _degrees_passing(world_size: int, check: Any) -> tuple[int, ...]:
    """1 and every divisor d > 1 of ``world_size`` for which ``check(d)`` raises nothing: a refusal
    (ValueError) or a check that cannot read the model or batch leaves d out of the search, never in."""
    out = [1]
    for d in range(2, world_size + 1):
        if world_size % d:
            continue
        try:
            check(d)
        except Exception as exc:  # noqa: BLE001 - not offered; the run would refuse it by name
            logger.debug("layout auto: degree %d left out: %s: %s", d, type(exc).__name__, exc)
            continue
        out.append(d)
    return tuple(out)


def model_cp_degrees(
    model: nn.Module,
    batch: Any,
    args: TrainingArguments,
    world_size: int,
    *,
    lora: Any = None,
    loss_fn_given: bool = False,
    compute_metrics_given: bool = False,
) -> tuple[int, ...]:
    """The context-parallel degrees ``layout: auto`` may choose, whatever the job's cp (issue 28: cp for long
    sequences): 1, and every cp > 1 dividing ``world_size`` that the run's refusals accept for ``model`` (its
    attention hook, LoRA dropout, a custom loss or metrics, Ulysses' heads at ``args.cp_mode``:
    :func:`~merak_core.parallel.context_parallel.check_cp_model`; a router auxiliary loss:
    :func:`~merak_core.parallel.router_aux.check_router_aux`) and for ``batch``, a training batch
    (its length in ``2 * cp`` chunks for the ring, ``cp`` for Ulysses, no padding mask:
    :func:`~merak_core.parallel.context_parallel.check_cp_batch`). Pure: no collective. What depends on the
    candidate's tp (Ulysses' heads per TP rank) the planner's candidates go through:
    :func:`merak_core.planner.context_cost.runnable_cp`."""
    from merak_core.parallel.context_parallel import check_cp_batch, check_cp_model
    from merak_core.parallel.router_aux import check_router_aux

    def check(cp: int) -> None:
        probe = copy.copy(
            args
        )  # the job's fields at this cp (no validation of the rest: nothing else changes)
        probe.cp, probe.tp, probe.pp = cp, 1, 1
        check_cp_model(
            model, probe, lora=lora, loss_fn_given=loss_fn_given, compute_metrics_given=compute_metrics_given
        )
        check_cp_batch(batch, None, cp, args.cp_mode)
        check_router_aux(model, 1, cp)  # a router aux loss over the global batch needs whole sequences

    return _degrees_passing(world_size, check)


def model_ep_degrees(
    model: nn.Module, args: TrainingArguments, world_size: int, *, lora: Any = None
) -> tuple[int, ...]:
    """The expert-parallel degrees ``layout: auto`` may choose (issue 29): 1, and every ep > 1 dividing
    ``world_size`` that :func:`~merak_core.parallel.expert_parallel.check_ep_model` accepts for ``model`` with
    the job's other fields (its MoE blocks, router losses, LoRA, the ZeRO stage; read at run time, so the
    search follows what the run refuses). Pure: no collective. What depends on the chosen layout (ep
    dividing dp and the experts, virtual stages, cp) the planner checks per candidate
    (:func:`merak_core.planner.search.ep_refusal`)."""
    from merak_core.parallel.expert_parallel import check_ep_model

    def check(ep: int) -> None:
        probe = copy.copy(args)
        probe.ep, probe.dp, probe.tp, probe.pp, probe.cp, probe.virtual_stages = ep, None, 1, 1, 1, 1
        probe.layout = "manual"  # the planner chooses ep here
        check_ep_model(model, probe, lora=lora)

    return _degrees_passing(world_size, check)


def model_degrees(
    model: nn.Module,
    batch: Any,
    args: TrainingArguments,
    world_size: int,
    *,
    lora: Any = None,
    loss_fn_given: bool = False,
    compute_metrics_given: bool = False,
) -> dict[str, tuple[int, ...]]:
    """The cp and ep degrees the planner searches for ``model`` and ``batch`` (one training microbatch) on
    ``world_size`` ranks, ``{"cp": ..., "ep": ...}``: :func:`model_cp_degrees` and :func:`model_ep_degrees`
    (``layout: auto`` and ``merak plan`` alike)."""
    flags = dict(loss_fn_given=loss_fn_given, compute_metrics_given=compute_metrics_given)
    return {
        "cp": model_cp_degrees(model, batch, args, world_size, lora=lora, **flags),
        "ep": model_ep_degrees(model, args, world_size, lora=lora),
    }


def written_degrees(args: TrainingArguments) -> dict[str, int]:
    """The degrees the job sets away from their defaults (``dp`` not null, ``tp``/``pp``/``cp`` not 1)."""
    given = {} if args.dp is None else {"dp": args.dp}
    given.update({n: v for n, v in (("tp", args.tp), ("pp", args.pp), ("cp", args.cp)) if v != 1})
    return given


def auto_global_batch(args: TrainingArguments, world: int) -> tuple[int, str]:
    """The global batch ``layout: auto`` plans for on ``world`` ranks, and how it was counted.

    The job's own: ``per_device_train_batch_size x gradient_accumulation_steps x dp`` with dp as the
    job writes it, or, when dp is null, as a manual layout would infer it (``world / (cp*tp*pp)``; with
    no degree written, every rank). The planner replaces the degrees, not the batch: see [Note: layout
    auto] in :mod:`merak_core.config`. Raises ValueError (before any collective) when dp is null and
    the written tp*pp does not divide ``world``: the job then fixes no global batch.
    """
    per, accum = args.per_device_train_batch_size, args.gradient_accumulation_steps
    head = f"per_device_train_batch_size {per} x gradient_accumulation_steps {accum}"
    if args.dp is not None:
        return per * accum * args.dp, f"{head} x dp {args.dp} as written"
    rest = args.cp * args.tp * args.pp
    if world % rest:
        raise ValueError(
            f"layout='auto' keeps the job's global batch (per_device_train_batch_size x "
            f"gradient_accumulation_steps x dp), but dp is null and the written "
            f"cp*tp*pp={rest} does not divide the {world} ranks: set training.dp to the data-parallel "
            f"degree the global batch counts, or training.tp=1 training.pp=1 (dp = the {world} ranks)"
        )
    if rest == 1:
        return per * accum * world, f"{head} x {world} ranks"
    return per * accum * (world // rest), f"{head} x dp {world // rest} (= {world} ranks / cp*tp*pp {rest})"


def auto_degrees_note(args: TrainingArguments, world: int) -> str | None:
    """The one line ``layout: auto`` says about the degrees the job writes (None when it writes none)."""
    given = written_degrees(args)
    if not given:
        return None
    gbs, how = auto_global_batch(args, world)
    return (
        f"layout auto: the job's {' '.join(f'{k}={v}' for k, v in given.items())} are replaced by the plan's "
        f"(layout: manual keeps them); they fix the global batch at {gbs} ({how})"
    )


def default_memory_per_device(device: torch.device, *, ranks: int | None = None) -> int:
    """CUDA: the device's free memory now less a margin; CPU: the machine's RAM divided by the ranks on this node.

    On CUDA the free memory (``torch.cuda.mem_get_info``) already leaves out the CUDA context and
    what other processes hold; the margin (8% of the device, at least 1 GiB) is for NCCL's buffers
    and the caching allocator's fragmentation. ``ranks``: the CPU ranks on this node (default:
    ``LOCAL_WORLD_SIZE``, else the world size; ``merak plan`` passes ``--world-size``).
    """
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        margin = max(int(0.08 * total), 1 << 30)
        return max(int(free) - margin, 0)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    local = ranks or int(
        os.environ.get("LOCAL_WORLD_SIZE") or (dist.get_world_size() if dist.is_initialized() else 1)
    )
    return int(ram // max(local, 1))


def compute_slots(device: torch.device) -> int | None:
    """Ranks that can compute at once on this node: CPU cores // threads per rank on CPU; None on GPUs."""
    if device.type == "cuda":
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(cores // max(torch.get_num_threads(), 1), 1)
