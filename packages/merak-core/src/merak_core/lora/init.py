"""The adapters' first values: A Kaiming-uniform (as PEFT and ``nn.Linear`` draw it), B zero.

Each A is drawn whole from a generator seeded by the run's seed and the adapter's logical name,
and every rank keeps its block (``ShardSpec.slice``): the initial adapters are the same at every
layout, whatever the order in which stages build their modules. B = 0 makes the first forward
equal the base model's.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable

import torch
from torch import nn

from merak_core.lora.apply import is_adapter_name

__all__ = ["full_initial_adapter", "initialise_adapters"]


def full_initial_adapter(
    name: str, full_shape: tuple[int, ...], *, seed: int, dtype: torch.dtype
) -> torch.Tensor:
    """The whole initial value of adapter ``name`` (CPU): A Kaiming-uniform(a=sqrt(5)), B zero."""
    if name.endswith(".lora_B.weight"):
        return torch.zeros(full_shape, dtype=dtype)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    full = torch.empty(full_shape, dtype=dtype)
    nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=gen)
    return full


@torch.no_grad()
def initialise_adapters(
    named: Iterable[tuple[str, nn.Parameter]], *, tp: int, tp_rank: int, seed: int
) -> int:
    """Fill every adapter among ``named`` (logical name, local parameter) with its block; returns how many."""
    from merak_tp.shard_spec import get_shard_spec

    count = 0
    for name, p in named:
        if not is_adapter_name(name):
            continue
        spec = get_shard_spec(p)
        full = full_initial_adapter(name, spec.full_shape(p.shape, tp), seed=seed, dtype=p.dtype)
        p.copy_(spec.slice(full, tp, tp_rank).to(p.device))
        count += 1
    return count
