"""Version-dependent torch.distributed entry points, in one place.

torch 2.13 renamed ``all_gather_into_tensor``/``reduce_scatter_tensor`` to
``all_gather_single``/``reduce_scatter_single`` (the old names warn). Both
gather or scatter along dim 0 of contiguous tensors.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

_all_gather_single: Any = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single: Any = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_dim0(
    out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup | None, async_op: bool = False
) -> dist.Work | None:
    """All-gather ``inp`` from every rank of ``group`` into ``out`` along dim 0."""
    return _all_gather_single(out, inp, group=group, async_op=async_op)


def reduce_scatter_dim0(
    out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup | None, async_op: bool = False
) -> dist.Work | None:
    """Sum ``inp`` over ``group`` and keep this rank's dim-0 slice in ``out``."""
    return _reduce_scatter_single(out, inp, group=group, async_op=async_op)
