"""The buckets of :class:`merak_core.parallel.data_parallel.DataParallelGradSync` and how parameters fill them.

Owns the bucket record (its parameters, their offsets in the flat buffer, the launch state and, for
ZeRO-1, each parameter's owning DP rank), the owner-by-owner placement of a bucket (see [Note: ZeRO-1
reduce-scatter] in :mod:`merak_core.parallel.data_parallel`), the default reduction dtype (see [Note: reduction
precision and memory] there) and the deduplicated list of named parameters a sync covers. The
hooks, the collectives and the write-back stay in :mod:`merak_core.parallel.data_parallel`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from merak_core.parallel.zero_layout import lay_out_by_owner


@dataclass(eq=False)
class _Bucket:
    index: int
    params: list[nn.Parameter]
    offsets: list[int]
    numel: int
    dtype: torch.dtype
    device: torch.device
    buffer: torch.Tensor | None = None
    pending: int = 0
    launched: bool = False
    work: dist.Work | None = None
    ready: list[bool] = field(default_factory=list)
    fires: list[int] = field(default_factory=list)
    owners: list[int] = field(default_factory=list)  # [Note: ZeRO-1 reduce-scatter]: each param's DP rank
    shard_numel: int = 0  # elements of each owner's padded segment (numel = shard_numel * dp)
    shard: torch.Tensor | None = None


def _place_by_owner(bucket: _Bucket, world_size: int) -> None:
    """Reorder the bucket owner by owner, segments padded (see [Note: ZeRO-1 reduce-scatter])."""
    placed = lay_out_by_owner([p.numel() for p in bucket.params], world_size)
    bucket.params = [bucket.params[i] for i in placed.order]
    bucket.owners, bucket.offsets = placed.owners, placed.offsets
    bucket.shard_numel = placed.segment_numel
    bucket.numel = placed.segment_numel * world_size


def _default_reduce_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half-precision gradients (see [Note: reduction precision and memory]), else ``dtype``."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _named_params(params: Iterable[nn.Parameter] | nn.Module) -> list[tuple[str, nn.Parameter]]:
    if isinstance(params, nn.Module):
        candidates = list(params.named_parameters())  # deduplicates tied parameters
    else:
        candidates = [(f"params[{i}]", p) for i, p in enumerate(params)]
    seen: set[int] = set()
    out = []
    for name, p in candidates:
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        out.append((name, p))
    return out


__all__: list[str] = []  # the bucket internals of merak_core.parallel.data_parallel
