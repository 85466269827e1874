"""ZeRO-1's flat layout: which DP rank owns each parameter, and where it sits in a padded bucket.

Pure functions (no process group) plus the two dim-0 collectives the layout is made for.
Parameters are owned whole (so an owner's optimizer state is the unsharded optimizer's state
of those parameters, and checkpoints keep one entry per parameter). A bucket of parameters
is laid out owner by owner, each owner's segment padded with zeros to the largest one, so a
``reduce_scatter_tensor`` hands rank ``r`` exactly the parameters it owns and an
``all_gather_into_tensor`` of equal segments returns them to everyone: NCCL's rules (device
tensors, equal sizes) and gloo's (no uneven all-gather) both hold.

Not here: the buckets themselves (:mod:`merak_core.parallel.data_parallel`) and the optimizer step
(:mod:`merak_core.parallel.zero`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


def partition_parameters(numels: Sequence[int], num_shards: int) -> list[int]:
    """Owner shard of each parameter: greedy largest-first onto the least-loaded shard.

    Pure and deterministic (ties go to the lower index), so every rank computes the
    same partition.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    loads = [0] * num_shards
    owners = [0] * len(numels)
    for index in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        shard = min(range(num_shards), key=lambda s: (loads[s], s))
        owners[index] = shard
        loads[shard] += numels[index]
    return owners


@dataclass(frozen=True)
class OwnerLayout:
    """A bucket laid out owner by owner: ``order[k]`` is the k-th parameter placed, at ``offsets[k]``."""

    order: list[int]
    owners: list[int]
    """Owner of each placed parameter (``owners[k]`` for ``order[k]``)."""
    offsets: list[int]
    segment_numel: int
    """Elements per owner's padded segment; the bucket holds ``segment_numel * num_shards``."""


def lay_out_by_owner(
    numels: Sequence[int], num_shards: int, owners: Sequence[int] | None = None
) -> OwnerLayout:
    """Place parameters of ``numels`` owner by owner (``owners``: given, else balanced greedily)."""
    owned = list(owners) if owners is not None else partition_parameters(numels, num_shards)
    order = sorted(range(len(numels)), key=lambda i: (owned[i], i))
    loads = [0] * num_shards
    for i, n in enumerate(numels):
        loads[owned[i]] += n
    segment = max(loads) if loads else 0
    fill = [0] * num_shards
    offsets = []
    for i in order:
        offsets.append(owned[i] * segment + fill[owned[i]])
        fill[owned[i]] += numels[i]
    return OwnerLayout(order, [owned[i] for i in order], offsets, segment)


def reduce_scatter_dim0(
    out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup | None, *, op: dist.ReduceOp.RedOpType
) -> dist.Work | None:
    """Asynchronous reduce-scatter along dim 0 (torch 2.13's name, else the older one)."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, op=op, group=group, async_op=True)


def all_gather_dim0(out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup | None) -> dist.Work | None:
    """Asynchronous all-gather along dim 0 (torch 2.13's name, else the older one)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=True)


__all__ = [
    "OwnerLayout",
    "all_gather_dim0",
    "lay_out_by_owner",
    "partition_parameters",
    "reduce_scatter_dim0",
]
