"""The TP gradient sums of replicated parameters, once per optimizer step in flat buckets.

[Note: gradient sum hooks] in ``parallelize.py``: a replicated weight applied to this rank's heads only
(per-head q/k norms: Qwen3, Gemma 3) or to its tokens only (sequence parallelism) gets a partial
gradient, which a hook all-reduces over the TP group: one synchronous all-reduce per parameter per
microbatch. A training loop that accumulates gradients over microbatches can instead sum each
accumulated gradient once: the sum over ranks of a sum over microbatches is the sum over microbatches
of the sums over ranks (equal up to float rounding: the order of the additions changes).
:func:`defer_grad_sums` turns the hooks of some parameters into no-ops and returns what to sum;
:func:`sum_grads` then all-reduces one flat buffer per group, dtype and device (a fixed parameter
order: identical on every rank of a TP group, whose stages hold the same parameters).

Not done here: deciding when (the training engine calls :func:`sum_grads` after the backward of the
last microbatch, before the gradient norm), and FSDP2's replacement parameters (their hooks never run:
the wrapper sums with ``grad_sum_groups``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["defer_grad_sums", "sum_grads"]


def defer_grad_sums(params: Iterable[torch.Tensor]) -> list[tuple[torch.Tensor, ProcessGroup | None]]:
    """Turn off the per-microbatch sum hooks of ``params``; the (parameter, group) pairs the caller must sum
    with :func:`sum_grads` after accumulating (in ``params``' order)."""
    pairs: list[tuple[torch.Tensor, ProcessGroup | None]] = []
    for p in params:
        for hook in p.__dict__.get("_merak_grad_hooks", ()):  # recorded by _compat.register_grad_hook
            if hasattr(hook, "merak_tp_sum_group"):
                hook.merak_tp_deferred = True
                pairs.append((p, hook.merak_tp_sum_group))
    return pairs


def sum_grads(pairs: Sequence[tuple[torch.Tensor, ProcessGroup | None]]) -> int:
    """Sum each parameter's accumulated gradient over its group: one flat all-reduce per group, dtype and
    device (parameters without a gradient skipped, alike on every rank). Returns the number of all-reduces."""
    buckets: dict[tuple[int, torch.dtype, torch.device], tuple[ProcessGroup | None, list[torch.Tensor]]] = {}
    for p, group in pairs:
        if p.grad is not None:
            key = (id(group), p.grad.dtype, p.grad.device)
            buckets.setdefault(key, (group, []))[1].append(p.grad)
    for group, grads in buckets.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(part.view_as(g))
    return len(buckets)
