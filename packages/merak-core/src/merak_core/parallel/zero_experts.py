"""ZeRO-2/3 of an expert-parallel model: the experts sharded by their own FSDP2 call, over their replica group.

[Note: ZeRO-2/3 with experts] At ep > 1 the dense parameters are the same on every DP rank and the
experts are the same on the ``dp / ep`` ranks of an expert-replica group (merak_core.parallel.layout,
[Note: expert-parallel groups]). :class:`merak_core.parallel.fsdp.ShardedDataParallel` therefore shards
each part over the ranks that hold it:

- the experts first: every *expert unit* (:func:`expert_units`: one module per protocol expert, or a
  transformers fused experts module) is its own ``fully_shard`` over a 1-D mesh of the replica group,
  with the stage's reshard rule; the dense units' later ``fully_shard`` calls leave those parameters to
  them (FSDP2 skips parameters a nested FSDP module manages);
- at ``dp == ep`` the replica group has one rank: nothing to shard, yet the experts are still
  FSDP2 parameters over that one-rank mesh (their all-gather is a local copy): an optimizer's
  multi-tensor kernels (AdamW's ``foreach``) refuse a mix of plain tensors and DTensors;
- the dense parameters over the DP group, as without experts.

Gradients ([Note: expert gradient normalisation] in merak_core.parallel.expert_parallel): after the
backwards an expert's holder has the sum over its EP group of the ranks' gradients (the all-to-all's
backward brings them home). FSDP2's reduce-scatter averages over the replica group: ``sum / (dp /
ep)``. :func:`finish_expert_gradients` divides by ``ep``, which gives ``sum over the DP group / dp``, the one-process gradient (the dense reduce-scatter
averages over DP already). Division by ``ep`` after the reduction, not FSDP2's divide factor: exact
for a power of two, and the same on a torch whose FSDP2 syncs every backward.

The gradient norm: every element of an expert's gradient shard sits on exactly one rank of the DP group
(the DP group is the EP group times the replica group, and the replica group's ranks hold disjoint
shards; at ``dp == ep`` the EP group is the DP group), like every dense shard, so the norm's terms are summed over the DP group alone
(:func:`merak_core.parallel.clip.global_grad_norm`). Checkpoints gather an expert over its replica
mesh (``DTensor.full_tensor``) and write it by its global name, as at ZeRO-0/1; a fused experts
parameter keeps its :class:`~merak_core.parallel.fused_experts.ExpertShard` record on the sharded
parameter (:func:`merak_core.parallel.fsdp.ShardedDataParallel` copies it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from merak_core.parallel.expert_parallel import expert_parameters
from merak_core.parallel.zero_tensors import local_tensor

__all__ = ["ExpertSharding", "expert_sharding", "expert_units", "finish_expert_gradients", "shard_experts"]


@dataclass(frozen=True)
class ExpertSharding:
    """How the experts of an EP model are sharded under ZeRO-2/3 (see [Note: ZeRO-2/3 with experts])."""

    replica_group: ProcessGroup
    """The ``dp / ep`` ranks that hold the same experts (``layout.expert_replica_group``)."""
    ep: int
    """The EP degree: the expert gradients are divided by it after their reduction."""


def expert_sharding(layout: Any) -> ExpertSharding | None:
    """The expert sharding of a :class:`~merak_core.parallel.layout.ParallelLayout` (None at ep == 1)."""
    if layout.ep == 1:
        return None
    assert layout.expert_replica_group is not None, "a layout with ep > 1 has expert-replica groups"
    return ExpertSharding(replica_group=layout.expert_replica_group, ep=layout.ep)


def expert_units(module: nn.Module, expert_ids: set[int]) -> list[nn.Module]:
    """The outermost modules below ``module`` (containers excepted) whose parameters are all experts'.

    A protocol block's experts (an ``nn.ModuleDict``, never called itself) give one unit per expert;
    a fused experts module (one forward for all its local experts) is one unit.
    """
    units: list[nn.Module] = []
    inside: set[int] = set()
    for sub in module.modules():
        if id(sub) in inside or isinstance(sub, nn.ModuleList | nn.ModuleDict):
            continue
        params = list(sub.parameters())
        if params and all(id(p) in expert_ids for p in params):
            units.append(sub)
            inside.update(id(m) for m in sub.modules())
    return units


def shard_experts(
    stages: Mapping[int, nn.Module],
    sharding: ExpertSharding,
    *,
    device_type: str,
    reshard_after_forward: Mapping[int, bool],
    mp_policy: Any,
    frozen: set[nn.Parameter],
) -> list[nn.Parameter]:
    """``fully_shard`` every expert unit of ``stages`` over the replica group (before the dense units).

    Returns the trainable expert parameters before sharding. No collective (FSDP2 gathers lazily).
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    experts = [p for module in stages.values() for p in expert_parameters(module) if p.requires_grad]
    group = sharding.replica_group
    mesh = DeviceMesh.from_group(group, device_type, mesh_dim_names=(f"ep_replica:{group.group_name}",))
    ids = {id(p) for p in experts}
    for index, module in stages.items():
        for unit in expert_units(module, ids):
            fully_shard(
                unit,
                mesh=mesh,
                reshard_after_forward=reshard_after_forward[index],
                mp_policy=mp_policy,
                ignored_params=frozen or None,
            )
    return experts


def finish_expert_gradients(params: Iterable[nn.Parameter], ep: int) -> None:
    """Divide the reduced expert gradients by ``ep`` (see [Note: ZeRO-2/3 with experts])."""
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                local_tensor(p.grad).div_(ep)
