"""Two sharded blocks besides linears and embeddings: fused mixture-of-experts weights and a norm.

``shard_experts``: a transformers experts module (per-expert weights stored as 3D
tensors ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``) keeps its own
forward; each expert's gate/up rows are split column-wise (two sections, gate and
up, split separately) and its down projection row-wise, so the module's output on
a rank is a partial sum. The module's class is swapped for a subclass whose
forward enters the TP region (the gradients of its inputs, tokens and routing
weights, all-reduced) and all-reduces the output, like a column -> row MLP.
Parameter names do not change.

``ShardedRMSNorm``: an RMSNorm applied to a column layer's sharded output (OLMo 2
normalises the whole q and k projections): the weight is split like the
features, and the mean square is summed over the TP ranks (forward and backward).

Neither imports transformers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from merak_tp._events import _GroupRef
from merak_tp._tp_module import _shard_param, _TPModule
from merak_tp.collectives import copy_to_tp_region, reduce_from_tp_region, tp_rank, tp_size
from merak_tp.module_spec import ModuleSpec, deepcopy_module, get_module_spec, set_module_spec

__all__ = ["ShardedRMSNorm", "TPExperts", "shard_experts"]


class TPExperts:
    """Mixin put in front of an experts class: the block's input and output cross the TP region.

    Its TP group is the module's ``ModuleSpec.experts_group`` (see [Note: module specs])."""

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return deepcopy_module(self, memo)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        group_ref = get_module_spec(self).experts_group  # type: ignore[arg-type]
        if group_ref is None:
            raise RuntimeError(f"{type(self).__name__} has no TP group: it is made by merak_tp.shard_experts")
        group = group_ref.group

        def enter(x: Any) -> Any:
            # Every differentiable input (the tokens and the routing weights) gets a partial gradient
            # from this rank's slice of the experts: all-reduced in backward.
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                return copy_to_tp_region(x, group)
            return x

        out = super().forward(*(enter(a) for a in args), **{k: enter(v) for k, v in kwargs.items()})  # type: ignore[misc]
        return reduce_from_tp_region(out, group)


_SUBCLASSES: dict[type, type] = {}


def _tp_class(cls: type) -> type:
    if issubclass(cls, TPExperts):
        return cls
    if cls not in _SUBCLASSES:
        _SUBCLASSES[cls] = type(f"TP{cls.__name__}", (TPExperts, cls), {"__module__": cls.__module__})
    return _SUBCLASSES[cls]


def shard_experts(module: nn.Module, name: str, *, group: ProcessGroup | None) -> nn.Module:
    """A copy of experts ``module`` holding this rank's shard of every expert (the original is untouched)."""
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    if not (
        isinstance(gate_up, nn.Parameter)
        and isinstance(down, nn.Parameter)
        and gate_up.ndim == 3
        and down.ndim == 3
        and gate_up.size(1) == 2 * down.size(2)
    ):
        raise ValueError(
            f"{name}: style 'experts' needs a transformers experts module with 3D parameters "
            f"gate_up_proj [E, 2I, H] and down_proj [E, H, I]; got {type(module).__name__} with "
            f"gate_up_proj={getattr(gate_up, 'shape', None)}, down_proj={getattr(down, 'shape', None)}"
        )
    if getattr(module, "down_proj_bias", None) is not None:
        raise ValueError(
            f"{name}: {type(module).__name__} has a down_proj_bias, which a row split would add once "
            "per TP rank; leave this block replicated (style 'replicate')"
        )
    world, rank = tp_size(group), tp_rank(group)
    inter = down.size(2)
    if inter % world:
        raise ValueError(
            f"{name}: the experts' intermediate size {inter} is not divisible by the tensor-parallel "
            f"size {world}; choose a TP degree that divides {inter}"
        )
    cls: Any = _tp_class(type(module))
    new = cls.__new__(cls)
    new.__dict__.update(module.__dict__)
    for key in ("_parameters", "_buffers", "_modules"):
        new.__dict__[key] = dict(module.__dict__[key])
    set_module_spec(new, ModuleSpec(experts_group=_GroupRef(group)))
    new.gate_up_proj = _shard_param(gate_up, 1, world, rank, 2)
    new.down_proj = _shard_param(down, 2, world, rank)
    bias = getattr(module, "gate_up_proj_bias", None)
    if isinstance(bias, nn.Parameter):
        new.gate_up_proj_bias = _shard_param(bias, 1, world, rank, 2)
    return new


class ShardedRMSNorm(_TPModule):
    """RMSNorm over features split across the TP ranks (weight split like them), computed in float32.

    ``y = w * x / sqrt(mean(x^2) + eps)`` where the mean runs over the *full* feature dim:
    every rank sums its squares and the sums are all-reduced (their gradient too).
    """

    def __init__(self, weight: torch.Tensor, eps: float, *, group: ProcessGroup | None) -> None:
        super().__init__()
        self._bind_group(group)
        self.full_size = weight.size(0)
        if self.full_size % self.tp_size:
            raise ValueError(
                f"ShardedRMSNorm: size {self.full_size} is not divisible by the tensor-parallel "
                f"size {self.tp_size}"
            )
        self.variance_epsilon = eps
        self.weight = _shard_param(weight, 0, self.tp_size, self.tp_rank)

    @classmethod
    def from_norm(cls, norm: nn.Module, name: str, *, group: ProcessGroup | None) -> ShardedRMSNorm:
        """From an RMSNorm module with a 1D ``weight`` and ``variance_epsilon`` (or ``eps``)."""
        weight = getattr(norm, "weight", None)
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        if (
            not isinstance(weight, nn.Parameter)
            or weight.ndim != 1
            or not isinstance(eps, float)
            or "RMSNorm" not in type(norm).__name__
            or getattr(norm, "bias", None) is not None
        ):
            raise ValueError(
                f"{name}: style 'sharded_norm' needs an RMSNorm (a 1D weight times x / rms(x), "
                f"variance_epsilon or eps), got {type(norm).__name__}"
            )
        return cls(weight, eps, group=group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        sq = h.pow(2).sum(-1, keepdim=True)
        if self.tp_size > 1:
            sq = copy_to_tp_region(reduce_from_tp_region(sq, self.group), self.group)
        h = h * torch.rsqrt(sq / self.full_size + self.variance_epsilon)
        return (self.weight * h).to(dtype)

    def extra_repr(self) -> str:
        return f"{self.full_size} (per rank {self.weight.size(0)}), eps={self.variance_epsilon}, tp={self.tp_size}"
