"""transformers' fused experts modules under expert parallelism: recognised, checked, their shard record (pure).

transformers 5 stores the experts of Mixtral, Qwen3-MoE and DeepSeek-V3 (``MixtralExperts``,
``Qwen3MoeExperts``, ``DeepseekV3Experts``) as one module with 3-D parameters ``gate_up_proj
[E, 2I, H]`` and ``down_proj [E, H, I]`` and ``forward(hidden_states, top_k_index, top_k_weights)``;
the block around it (``MixtralSparseMoeBlock``, ...) routes with its ``gate`` and calls it. At ep > 1
:mod:`merak_core.parallel.expert_hf` keeps this rank's rows ``[j * E / ep, (j + 1) * E / ep)`` of both
parameters and swaps the experts module's forward for the EP dispatch; the routing stays the model's.

[Note: expert shard record] A parameter so sliced carries an :class:`ExpertShard` (attribute
``_merak_expert_shard``): the global expert count, ep, this rank's EP index, the EP group and a 1-D
device mesh over it. Checkpoints write it as a ``DTensor`` sharded on dim 0 over that mesh (the
one-process name and full shape, so a checkpoint loads at any ep), the full state dict and the
Hugging Face export gather it over the EP group, and the EP gradient sync treats it as an expert
parameter (:func:`merak_core.parallel.expert_parallel.expert_parameters`).

This module imports neither transformers nor :mod:`merak_core.parallel.expert_parallel`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from merak_core.parallel.router_aux import FAMILIES, check_router_aux

__all__ = [
    "ExpertShard",
    "check_fused_experts",
    "expert_shard",
    "fused_experts",
    "fused_forward_problem",
    "is_fused_experts",
    "set_expert_shard",
]

_ATTR = "_merak_expert_shard"


@dataclass(frozen=True)
class ExpertShard:
    """How a local ``[E / ep, ...]`` slice of a fused expert parameter sits in the full ``[E, ...]`` one."""

    num_experts: int
    ep: int
    ep_rank: int
    group: Any = None
    mesh: Any = None

    @property
    def num_local(self) -> int:
        return self.num_experts // self.ep

    @property
    def first(self) -> int:
        return self.ep_rank * self.num_local

    def full_shape(self, local_shape: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
        return (self.num_experts, *tuple(local_shape)[1:])

    def slice(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the full tensor (a view)."""
        return full.narrow(0, self.first, self.num_local)


def expert_shard(tensor: torch.Tensor) -> ExpertShard | None:
    """The :class:`ExpertShard` of ``tensor``, None for any other tensor."""
    record = getattr(tensor, _ATTR, None)
    return record if isinstance(record, ExpertShard) else None


def set_expert_shard(tensor: torch.Tensor, record: ExpertShard) -> torch.Tensor:
    setattr(tensor, _ATTR, record)
    return tensor


def is_fused_experts(module: nn.Module) -> bool:
    """A module of fused experts: 3-D ``gate_up_proj`` and ``down_proj`` parameters and ``num_experts``."""
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    return (
        isinstance(gate_up, nn.Parameter)
        and isinstance(down, nn.Parameter)
        and gate_up.ndim == 3
        and down.ndim == 3
        and gate_up.size(0) == down.size(0)
        and isinstance(getattr(module, "num_experts", None), int)
    )


def fused_experts(model: nn.Module) -> list[tuple[str, Any]]:
    """The fused experts modules of ``model`` (name, module), in module order."""
    return [(name, m) for name, m in model.named_modules() if is_fused_experts(m)]


def _layout_problem(module: Any) -> str | None:
    """Why the EP forward cannot reproduce ``module``'s own (None: it can)."""
    gate_up, down = module.gate_up_proj, module.down_proj
    if gate_up.size(0) != module.num_experts:
        return f"it holds {gate_up.size(0)} experts but says num_experts={module.num_experts}"
    if gate_up.size(1) != 2 * down.size(2) or gate_up.size(2) != down.size(1):
        return (
            f"its weights are not gate_up_proj [E, 2I, H] and down_proj [E, H, I] (got {list(gate_up.shape)} "
            f"and {list(down.shape)})"
        )
    flags = (
        (getattr(module, "is_transposed", False), "transposed weights"),
        (not getattr(module, "is_concatenated", True), "interleaved gate/up rows"),
        (getattr(module, "has_bias", False), "biases"),
        (getattr(module, "has_post_expert_norm", False), "a post-expert norm"),
        (not getattr(module, "has_gate", True), "no gate projection"),
        (getattr(module, "gate_up_proj_bias", None) is not None, "a gate_up_proj_bias"),
        (getattr(module, "down_proj_bias", None) is not None, "a down_proj_bias"),
        (not callable(getattr(module, "act_fn", None)), "no act_fn"),
    )
    for bad, what in flags:
        if bad:
            return f"it has {what}"
    return None


def fused_forward_problem(module: Any) -> str | None:
    """Why Merak's dispatch (at ep > 1, or with a capacity) cannot reproduce ``module``'s own forward (None: it can)."""
    return _layout_problem(module)


def check_fused_experts(model: nn.Module, args: Any) -> list[str]:
    """The fused experts modules ``args.ep > 1`` shards (names); ValueError for one it cannot (pure)."""
    ep = args.ep
    found = fused_experts(model)
    if not found:
        return []
    # The model's router aux loss: over the global batch (merak_core.parallel.router_aux), pp and cp refused.
    check_router_aux(model, getattr(args, "pp", 1), getattr(args, "cp", 1))
    config: Any = getattr(model, "config", None)
    aux = getattr(config, "output_router_logits", False) and getattr(config, "router_aux_loss_coef", 0)
    if aux and getattr(config, "model_type", None) not in FAMILIES:
        raise ValueError(
            f"ep={ep}: {type(model).__name__} adds a router auxiliary loss (output_router_logits=True), which "
            f"Merak computes over the global batch for {', '.join(FAMILIES)} only (model_type "
            f"{getattr(config, 'model_type', None)!r}): set output_router_logits: false, or ep: 1"
        )
    for name, module in found:
        problem = _layout_problem(module)
        if problem is not None:
            raise ValueError(
                f"ep={ep}: {type(module).__name__} at {name!r} cannot be sharded over EP: {problem}. Set ep: 1"
            )
        if module.num_experts % ep:
            raise ValueError(
                f"ep={ep} does not divide the {module.num_experts} experts of {name!r}: choose an ep dividing "
                f"{module.num_experts}"
            )
    return [name for name, _ in found]
