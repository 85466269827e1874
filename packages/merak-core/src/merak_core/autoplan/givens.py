"""What a job fixes before ``layout: auto`` plans: the global batch its written degrees count, the
memory per device and the ranks that can compute at once on this node.

Pure functions of the job's arguments and the machine (no collective); :mod:`merak_core.autoplan.auto`
plans with them, ``merak train --dry-run`` and ``merak plan`` print them.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from merak_core.config import TrainingArguments

__all__ = [
    "auto_cp_degrees",
    "auto_degrees_note",
    "auto_global_batch",
    "compute_slots",
    "default_memory_per_device",
    "written_degrees",
]


def auto_cp_degrees(args: TrainingArguments, world_size: int) -> tuple[int, ...]:
    """The context-parallel degrees ``layout: auto`` searches: every divisor of the job's ``cp`` that divides
    ``world_size`` (the job's cp is the largest the planner may choose; its divisors pass the checks made
    before torchrun for it: the model's cp hook, Ulysses' heads, the sequence's ``2 * cp`` chunks); (1,)
    at cp=1: the planner does not turn context parallelism on by itself."""
    return tuple(c for c in range(1, args.cp + 1) if args.cp % c == 0 and world_size % c == 0)


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
