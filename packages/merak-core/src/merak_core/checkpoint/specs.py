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


def _load_target(
    parts: CheckpointParts,
    spec: TensorSpec,
    local: torch.Tensor,
    dtype: torch.dtype,
    *,
    into_local: bool = False,
) -> tuple[Any, torch.Tensor]:
    """(object DCP loads into, tensor that receives the full data) for a local tensor shaped like a param.

    [Note: bounded checkpoint loads] DCP reads a checkpoint item by item: each item's bytes pass
    through host memory once and are copied into the tensor it is loaded into. So host memory stays
    at the largest item when every target is where the tensor will live: a replicated parameter
    that holds the whole tensor (a plain tensor of the full shape, as at tp=1 or ZeRO-0/1) is
    loaded into itself (``into_local``: ``local`` is the target, the caller skips the copy), and an
    optimizer state of such a parameter into a new tensor on the parameter's device. Only a tensor
    of which this rank keeps a part of the whole (fused sections gathered over TP, a ZeRO-2/3
    shard) is still staged whole in host memory, all such tensors at once. Before, every
    whole tensor and state was staged in host memory at once: the model and its AdamW states,
    ~84 GB per rank for 7B at tp=1.
    """
    if spec.whole:
        if _holds_the_whole(spec, local):
            if into_local and dtype == local.dtype:  # the parameter itself
                view = spec.oriented(local.detach())
                return view, view
            buf = torch.empty(spec.full_shape, dtype=dtype, device=local.device)  # a state, in place
            return buf, buf
        # A part of a whole tensor (fused sections, a ZeRO-2/3 shard) is staged in host memory and
        # only this rank's slice is copied to the device: never the unsharded tensor on the GPU.
        full = torch.empty(spec.full_shape, dtype=dtype, device="cpu")
        return full, full
    from torch.distributed.tensor import DTensor, Shard

    buf = torch.empty(spec.oriented(local).shape, dtype=dtype, device=local.device)
    dt = DTensor.from_local(
        buf,
        spec.mesh(parts),
        [Shard(spec.dim or 0)],
        run_check=False,
        shape=torch.Size(spec.full_shape),
        stride=_contiguous_stride(spec.full_shape),
    )
    return dt, buf


def _holds_the_whole(spec: TensorSpec, local: torch.Tensor) -> bool:
    """Whether ``local`` is a plain tensor holding all of the whole tensor ``spec`` saves (no slice of it)."""
    from torch.distributed.tensor import DTensor

    if isinstance(local, DTensor) or spec.sections > 1 or spec.expert is not None or spec.dim is not None:
        return False
    return tuple(spec.oriented(local).shape) == spec.full_shape


def loaded_in_place(received: torch.Tensor, param: torch.Tensor) -> bool:
    """Whether DCP loaded straight into ``param`` (see [Note: bounded checkpoint loads])."""
    return received.data_ptr() == param.data_ptr() and received.numel() == param.numel()


def _from_loaded(spec: TensorSpec, loaded: torch.Tensor) -> torch.Tensor:
    """The local shard (parameter orientation) from what ``_load_target`` received."""
    if spec.whole:
        return spec.slice_full(loaded)
    return spec.oriented(loaded)


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
