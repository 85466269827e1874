"""An expert capacity for MoE blocks (``training.moe_capacity_factor``): the size rule and the drop policy.

[Note: expert capacity] Dropless by default (``moe_capacity_factor: null``). With a factor ``c`` each
expert of a block takes at most ``C = ceil(c * T * k / E)`` (token, expert) pairs per forward, where
``T`` is the number of tokens entering that forward's dispatch: the microbatch's tokens on every rank of
the EP group (this rank's alone at ep=1), ``k`` the block's top-k and ``E`` its experts. ``c`` counts as the
decimal written (``1.1`` is 11/10, no binary rounding can push ``C`` past an integer). An expert keeps its
first ``C`` pairs in position order: the EP ranks' tokens concatenated in EP-rank order, by token, then
by the token's choice (its ``k`` column); the rest are dropped: their expert output is zero (no
gradient through that expert), while the token keeps its other choices and the residual the block's
caller adds. This is what one process computes running the block, with the same rule, on those ``T``
tokens: a run at dp = ep and one microbatch per step equals one process on the global batch. At
dp > ep or with several microbatches, the capacity is per EP group and microbatch (as the capacity of
GShard-style layers is per group), so which pairs are dropped depends on those sizes.

Not here: the dispatch that applies it (:func:`merak_core.parallel.expert_parallel.dispatch`).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import torch
from torch import nn

__all__ = ["check_capacity_factor", "expert_capacity", "run_with_capacity"]


def check_capacity_factor(value: Any) -> None:
    """ValueError unless ``value`` is None (dropless) or a finite number > 0."""
    if value is None:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(
            f"moe_capacity_factor={value!r} is invalid: expected a number > 0 (each expert takes at most "
            "ceil(factor * tokens * top_k / experts) pairs), or null for dropless dispatch"
        )


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, factor: float) -> int:
    """``ceil(factor * num_tokens * top_k / num_experts)``, ``factor`` taken as its decimal."""
    return math.ceil(Fraction(repr(float(factor))) * num_tokens * top_k / num_experts)


def run_with_capacity(expert: nn.Module, rows_sh: torch.Tensor, capacity: int | None) -> torch.Tensor:
    """``expert`` over its first ``capacity`` rows (all without one); zero outputs for the dropped rows."""
    if capacity is None or rows_sh.size(0) <= capacity:
        return expert(rows_sh)
    kept_sh = expert(rows_sh[:capacity])
    dropped = kept_sh.new_zeros((rows_sh.size(0) - capacity, *kept_sh.shape[1:]))
    return torch.cat([kept_sh, dropped], 0)
