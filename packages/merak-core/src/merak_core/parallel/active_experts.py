"""An MoE block's cost as its active experts: the stand-in the cost annotators trace.

[Note: active-expert cost] Cost annotation runs a graph once (on meta tensors for the cluster planner,
on the example inputs for the partitioner) and counts the FLOPs it executes; an MoE block's real
forward cannot run there (the dropless routing is data-dependent, and an expert-parallel dispatch is
collective). Within :func:`active_expert_blocks` every protocol block's ``run_experts`` runs one of
its experts over the ``n * k`` rows its tokens send, the work of the active experts (``k`` of ``E``
per token) whatever the routing, and nothing collective; the blocks are traced whole (as leaves), so
each layer keeps all its experts' parameters. The classes are restored on exit.

Not here: the pricing of expert parallelism (:mod:`merak_core.planner.expert_cost`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from merak_core.parallel.expert_parallel import moe_blocks

__all__ = ["active_expert_blocks"]


class _ActiveExperts:
    """Mixin: the block's experts cost ``k`` experts per token (one expert over n * k rows)."""

    experts: Any

    def run_experts(
        self, x_nh: torch.Tensor, weights_nk: torch.Tensor, experts_nk: torch.Tensor
    ) -> torch.Tensor:
        n, k = experts_nk.shape
        experts = self.experts.values() if isinstance(self.experts, nn.ModuleDict) else self.experts
        expert = next(iter(experts))
        y_nkh = expert(x_nh.repeat_interleave(k, 0)).reshape(n, k, -1)
        return (y_nkh * weights_nk.unsqueeze(-1).to(y_nkh.dtype)).sum(1)


@contextlib.contextmanager
def active_expert_blocks(model: nn.Module) -> Iterator[list[str]]:
    """Within: every protocol MoE block of ``model`` costs its active experts ([Note: active-expert cost]);
    yields their module names, to trace as leaves."""
    blocks = moe_blocks(model)
    saved = [(m, type(m)) for _, m in blocks]
    try:
        for m, cls in saved:
            m.__class__ = type(f"Active{cls.__name__}", (_ActiveExperts, cls), {"__module__": cls.__module__})
        yield [name for name, _ in blocks]
    finally:
        for m, cls in saved:
            m.__class__ = cls
