"""How a rank's local tensors map to the full logical tensors a checkpoint stores.

See [Note: checkpoint keys] in ``merak_core.checkpoint``: a TP-sharded parameter is
written as a ``DTensor`` over the TP mesh (each rank writes its block), a fused
parameter (several sections) is gathered over TP and written whole, replicated
parameters are plain tensors. Optimizer states shaped like their parameter follow
the parameter's spec; other states (AdamW's 0-d ``step``) are plain tensors.

Not done here: reading or writing files (``save.py``, ``load.py``), verification (``integrity.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from merak_core.parallel.fsdp import full_local_tensor
from merak_core.parallel.fused_experts import expert_shard

if TYPE_CHECKING:
    from merak_core.checkpoint.parts import CheckpointParts


class TensorSpec:
    """How one local parameter relates to its full logical tensor (see [Note: checkpoint keys])."""

    def __init__(self, param: torch.Tensor, tp: int, tp_rank: int) -> None:
        from merak_tp.shard_spec import get_shard_spec

        self.shard = get_shard_spec(param)  # merak-tp's metadata, in the parameter's orientation
        dim = self.shard.dim if tp > 1 else None
        self.transposed = self.shard.transposed and param.ndim == 2
        self.sections = self.shard.num_sections
        self.tp, self.tp_rank = tp, tp_rank
        local_shape = list(param.shape) if dim is None else list(self.shard.full_shape(param.shape, tp))
        if self.transposed:
            local_shape.reverse()
            dim = None if dim is None else 1 - dim
        self.dim: int | None = dim  # the sharded dim in the checkpoint's orientation
        self.full_shape = tuple(local_shape)
        self.expert = expert_shard(param)  # fused experts: dim 0 over the EP mesh (parallel.fused_experts)
        if self.expert is not None:
            self.dim, self.full_shape = 0, self.expert.full_shape(param.shape)

    def mesh(self, parts: CheckpointParts) -> Any:
        """The 1-D device mesh this tensor is sharded over (EP for fused experts, else TP)."""
        return self.expert.mesh if self.expert is not None else parts.layout.mesh["tp"]

    @classmethod
    def plain(cls, tensor: torch.Tensor) -> TensorSpec:
        """The spec of a tensor stored as it is (no TP sharding, no transpose)."""
        return cls(tensor.detach().new_empty(tensor.shape, device="meta"), 1, 0)

    @property
    def whole(self) -> bool:
        """Saved and loaded as one full tensor (replicated, or fused sections gathered over TP)."""
        return self.dim is None or self.sections > 1

    def oriented(self, local: torch.Tensor) -> torch.Tensor:
        return local.t() if self.transposed else local

    def slice_full(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the full tensor, in the parameter's own orientation (a view where possible)."""
        local = full.t() if self.transposed else full
        if self.expert is not None:
            return self.expert.slice(local)
        return local if self.dim is None else self.shard.slice(local, self.tp, self.tp_rank)


def tensor_specs(parts: CheckpointParts) -> dict[str, tuple[nn.Parameter, TensorSpec]]:
    layout = parts.layout
    out: dict[str, tuple[nn.Parameter, TensorSpec]] = {}
    for name, p in parts.model.named_parameters():
        out.setdefault(name, (p, TensorSpec(p, layout.tp, layout.tp_rank)))
    return out


def model_fingerprint(parts: CheckpointParts) -> dict[str, tuple[int, ...]]:
    """Every logical parameter name with its full shape, over all stages (collective: every rank calls it)."""
    local = {name: spec.full_shape for name, (_, spec) in tensor_specs(parts).items()}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    merged: dict[str, tuple[int, ...]] = {}
    for part in gathered:
        merged.update(part)
    return dict(sorted(merged.items()))


def _to_checkpoint(
    parts: CheckpointParts, tensor: torch.Tensor, spec: TensorSpec, like: nn.Parameter
) -> torch.Tensor | None:
    """What this rank writes for ``tensor`` (a parameter or a state shaped like it); collective over TP.

    A ZeRO-2/3 tensor (sharded over DP) is gathered over DP first (collective there too), so every
    ZeRO stage writes the same checkpoint and any other one reads it.
    """
    layout = parts.layout
    tensor = full_local_tensor(tensor)
    if spec.dim is None:
        return spec.oriented(tensor.detach())
    if spec.sections > 1:
        import merak_tp

        full = merak_tp.gather_tensor(tensor.detach(), like=like, group=layout.tp_group)
        return spec.oriented(full) if layout.tp_rank == 0 else None
    from torch.distributed.tensor import DTensor, Shard

    local = spec.oriented(tensor.detach())
    return DTensor.from_local(
        local,
        spec.mesh(parts),
        [Shard(spec.dim)],
        run_check=False,
        shape=torch.Size(spec.full_shape),
        stride=_contiguous_stride(spec.full_shape),
    )


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(1, size)
    return tuple(reversed(stride))


def named_optimizer_params(
    inner: torch.optim.Optimizer, specs: Mapping[str, Any]
) -> list[tuple[nn.Parameter, str]]:
    """The optimizer's parameters that this rank's model names, in the optimizer's order (save and load)."""
    names = {id(p): name for name, (p, _) in specs.items()}
    return [(p, names[id(p)]) for group in inner.param_groups for p in group["params"] if id(p) in names]
