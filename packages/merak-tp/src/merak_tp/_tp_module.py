"""What every sharded module of merak_tp shares: its TP group, its shard specs, its slicing.

``_TPModule`` holds the process group (through a ``_GroupRef``, so ``copy.deepcopy`` shares
it) with the group's size and this rank's index, and keeps the
:class:`~merak_tp.shard_spec.ShardSpec` of each parameter through ``copy.deepcopy``.
``_shard_param`` cuts this rank's block out of a full tensor and tags it. The layers
themselves live in ``linear.py``, ``embedding.py`` and ``moe_norm.py``; nothing here
communicates.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from merak_tp._events import _GroupRef
from merak_tp._exit import destroy_default_group_at_exit
from merak_tp.collectives import tp_rank, tp_size
from merak_tp.module_spec import deepcopy_module
from merak_tp.shard_spec import Sections, ShardSpec, set_shard_spec


def _mark(
    param: nn.Parameter, dim: int | None, sections: Sections = 1, *, transposed: bool = False
) -> nn.Parameter:
    return set_shard_spec(param, ShardSpec(dim, sections, transposed))  # type: ignore[return-value]


def _shard(full: torch.Tensor, dim: int, world: int, rank: int, sections: Sections = 1) -> torch.Tensor:
    """This rank's block of ``full`` along ``dim`` as a new tensor (see ``ShardSpec.slice``)."""
    out = ShardSpec(dim, sections).slice(full, world, rank)
    return out.clone() if out.device.type != "meta" else out.contiguous()


def _shard_param(
    source: torch.Tensor,
    dim: int,
    world: int,
    rank: int,
    sections: Sections = 1,
    *,
    transposed: bool = False,
    requires_grad: bool | None = None,
) -> nn.Parameter:
    """A new parameter holding this rank's block of ``source``, tagged.

    ``requires_grad`` defaults to the source's (pass the original parameter's where ``source``
    is a view of it, such as a transpose taken under ``torch.no_grad``).
    """
    block = _shard(source.detach(), dim, world, rank, sections)
    grad = source.requires_grad if requires_grad is None else requires_grad
    param = nn.Parameter(block, requires_grad=grad)
    return _mark(param, dim, sections, transposed=transposed)


def _divide(size: int, world: int, what: str, layer: str) -> int:
    if size % world:
        raise ValueError(
            f"{layer}: {what}={size} is not divisible by the tensor-parallel size {world}; "
            f"use a TP degree that divides {size} (or resize the layer)"
        )
    return size // world


class _KeepsShardTags:
    """``copy.deepcopy`` keeps the shard specs of the layer's parameters (see ``deepcopy_module``)."""

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return deepcopy_module(self, memo)


class _TPModule(_KeepsShardTags, nn.Module):
    """A module sharded over one TP process group: ``group``, ``tp_size`` and ``tp_rank``."""

    _group_ref: _GroupRef
    tp_size: int
    tp_rank: int

    @property
    def group(self) -> ProcessGroup | None:
        """The TP process group (None: the default group)."""
        return self._group_ref.group

    def _bind_group(self, group: ProcessGroup | None) -> None:
        self._group_ref = _GroupRef(group)
        self.tp_size = tp_size(group)
        self.tp_rank = tp_rank(group)
        destroy_default_group_at_exit()  # see [Note: groups at exit]
