"""The DTensors of ZeRO-2/3 as plain tensors: a rank's shard, the whole tensor, a shard of a whole one.

A ZeRO-2/3 parameter (:mod:`merak_core.parallel.fsdp`), its gradient and its optimizer states are
``DTensor`` s sharded on dim 0 over a 1-D mesh: the DP group, or an expert's replica group under
expert parallelism ([Note: ZeRO-2/3 with experts] in :mod:`merak_core.parallel.zero_experts`). Every
helper here works on the tensor's own mesh, and takes any other tensor as it is.
"""

from __future__ import annotations

import torch


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def is_sharded(tensor: torch.Tensor) -> bool:
    """True for a DTensor (a ZeRO-2/3 parameter, its gradient or its optimizer state)."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def full_local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DP-sharded DTensor (collective over its mesh); others as they are."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def copy_into_shard_(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of ``full`` into ``target`` (a DP-sharded DTensor or a plain tensor)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(target, DTensor):
        target.copy_(full)
        return
    if tuple(full.shape) != tuple(target.shape):
        raise ValueError(
            f"cannot load a tensor of shape {tuple(full.shape)} into a parameter of shape "
            f"{tuple(target.shape)}"
        )
    source = distribute_tensor(
        full.to(device=target.device, dtype=target.dtype),
        target.device_mesh,
        target.placements,
        src_data_rank=None,
    )
    target.to_local().copy_(source.to_local())


def shard_like(like: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """A new tensor sharded like ``like`` (a DTensor) holding this rank's part of ``full``."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(like, DTensor):
        return full
    return distribute_tensor(
        full.to(device=like.device), like.device_mesh, like.placements, src_data_rank=None
    )


__all__ = ["copy_into_shard_", "full_local_tensor", "is_sharded", "local_tensor", "shard_like"]
