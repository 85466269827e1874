"""Which modules of a model are MoE blocks following [Note: the MoE block protocol]
(:mod:`merak_core.parallel.expert_parallel`): a leaf of the parallel folder, so that the expert dispatch,
the router aux loss and the planner can all find the blocks without importing each other."""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["is_moe_block", "moe_blocks"]


def is_moe_block(module: nn.Module) -> bool:
    """Whether ``module`` follows [Note: the MoE block protocol]."""
    return (
        callable(getattr(module, "run_experts", None))
        and isinstance(getattr(module, "num_experts", None), int)
        and isinstance(getattr(module, "experts", None), nn.ModuleList | nn.ModuleDict)
    )


def moe_blocks(model: nn.Module) -> list[tuple[str, Any]]:
    """The MoE blocks of ``model`` (name, module: a protocol block, typed Any), in module order."""
    return [(name, m) for name, m in model.named_modules() if is_moe_block(m)]
