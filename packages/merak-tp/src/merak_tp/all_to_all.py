"""A differentiable all-to-all with uneven splits, for expert-parallel token dispatch.

``all_to_all_uneven(x, out_splits, in_splits, group)`` sends the first ``in_splits[0]`` rows of
``x`` to group rank 0, the next ``in_splits[1]`` to group rank 1, and so on, and returns the rows
received, ``out_splits[j]`` from group rank j, in group-rank order (``torch.distributed.
all_to_all_single`` along dim 0). Its backward is the reverse all-to-all of the gradient (splits
swapped), so the gradient of a row comes back to the rank that sent it.

Every rank of ``group`` must call it (a collective), with splits that agree: what rank i sends to
rank j (``in_splits[j]`` on i) is what rank j expects from i (``out_splits[i]`` on j); the caller
exchanges the counts first (``exchange_counts``). Zero-row splits are allowed (a rank that sends or
receives nothing still takes part). gloo (CPU) and NCCL (CUDA) both run uneven splits; on NCCL the
tensors, the counts included, must be on the rank's GPU (DESIGN.md), which is where ``x`` lives.

Not done here: choosing the splits (routing) or permuting rows (merak_core.parallel.expert_parallel).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["all_to_all_uneven", "exchange_counts"]


def _exchange(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: ProcessGroup | None
) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group)
    return out


class _AllToAllUneven(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: ProcessGroup | None
    ) -> torch.Tensor:
        ctx.splits = (out_splits, in_splits)
        ctx.group = group
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        # The reverse exchange: what was received from rank j goes back to rank j.
        return _exchange(grad, in_splits, out_splits, ctx.group), None, None, None


def _check_splits(x: torch.Tensor, out_splits: list[int], in_splits: list[int], world: int) -> None:
    for name, splits in (("out_splits", out_splits), ("in_splits", in_splits)):
        if len(splits) != world or any(s < 0 for s in splits):
            raise ValueError(
                f"{name}={splits} must hold {world} non-negative row counts (one per rank of the group)"
            )
    if sum(in_splits) != x.size(0):
        raise ValueError(
            f"in_splits={in_splits} sum to {sum(in_splits)} rows but x has {x.size(0)}: the splits cut x along dim 0"
        )


def all_to_all_uneven(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: ProcessGroup | None
) -> torch.Tensor:
    """Rows of ``x`` cut by ``in_splits`` sent to the group's ranks; rows received, cut by ``out_splits``.

    Differentiable (backward: the reverse all-to-all). Collective over ``group``.
    """
    world = dist.get_world_size(group)
    _check_splits(x, out_splits, in_splits, world)
    return _AllToAllUneven.apply(x, list(out_splits), list(in_splits), group)


def exchange_counts(counts: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """All-to-all of equal blocks of an integer vector: block j of ``counts`` goes to rank j.

    ``counts`` has ``world * c`` entries (e.g. tokens for each of the ``c`` experts of each rank);
    the result has block i = what rank i sent to this rank. Not differentiable. Collective.
    """
    world = dist.get_world_size(group)
    if counts.dim() != 1 or counts.numel() % world:
        raise ValueError(
            f"counts has shape {list(counts.shape)}: a vector whose length is a multiple of the group size {world}"
        )
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out
