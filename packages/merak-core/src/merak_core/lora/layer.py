"""``LoraLinear``: a linear (of any kind) plus a low-rank adapter, ``y = base(x) + s * B A dropout(x)``.

The base layer is kept whole as the child ``base_layer`` (its parameters' logical names drop that
segment, :func:`merak_core.lora.apply.logical_name`); the adapters are ``lora_A.weight`` (r x in)
and ``lora_B.weight`` (out x r), PEFT's layout for ``nn.Linear`` and ``Conv1D`` alike.

[Note: adapters under TP] The adapters follow the base layer's TP sharding, and the one
collective each needs is on the r-wide intermediate ``h = A x`` (tokens x r, small):

- column-parallel base (W split on its output): A is whole (replicated), B is split on its output
  like W (with W's sections for a fused projection). Forward needs nothing: x is replicated.
  Backward: this rank's ``dh = B_r^T dy_r`` is one term of ``dh = sum_r B_r^T dy_r``; the
  identity-forward / all-reduce-backward region on h sums them, so A's gradient ``dh^T x`` and the
  adapter's input gradient ``dh A`` are the full ones, identical on every TP rank (A stays
  replicated). The base layer all-reduces its own input-gradient term; the two terms add.
- row-parallel base (W split on its input, x arrives split): A is split on its input like W, B is
  whole. ``A_r x_r`` is one term of ``h``: the all-reduce-forward / identity-backward region sums
  it, then ``B h`` is the same on every rank (the base's output is all-reduced too). Backward:
  ``dy`` is replicated, so B's gradient ``dy^T h`` is whole on every rank and A_r's gradient
  ``(B^T dy)^T x_r`` is this rank's block; ``dx_r = (B^T dy) A_r`` is this rank's input gradient.
- a replicated base (an ``nn.Linear`` or ``Conv1D`` the TP plan does not shard, or tp = 1): both
  adapters replicated, no collective.

Not done here: sequence parallelism and sub-pipelined regions (their input-gradient reductions
differ; ``check_lora_arguments`` refuses them), choosing the targets (``apply.py``).
"""

from __future__ import annotations

import copy
from typing import Any, Literal

import torch
from torch import nn

Kind = Literal["plain", "column", "row"]

__all__ = ["Adapter", "Kind", "LoraLinear"]


class Adapter(nn.Module):
    """One adapter matrix as ``weight`` (so its name reads ``lora_A.weight`` like PEFT's)."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def extra_repr(self) -> str:
        return f"shape={tuple(self.weight.shape)}"

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        """A copy whose weight keeps its ``ShardSpec`` (``nn.Parameter``'s deepcopy drops Python
        attributes; the pipeline partitioner copies stages with deepcopy)."""
        from merak_tp.shard_spec import get_shard_spec, set_shard_spec

        cls = type(self)
        result = cls.__new__(cls)
        memo[id(self)] = result
        for key, value in self.__dict__.items():
            object.__setattr__(result, key, copy.deepcopy(value, memo))
        set_shard_spec(result.weight, get_shard_spec(self.weight))
        return result


class LoraLinear(nn.Module):
    """``base_layer(x) + scaling * lora_B(lora_A(dropout(x)))`` with adapters sharded like the base
    (see [Note: adapters under TP]); the base layer's parameters are frozen by the caller."""

    def __init__(
        self,
        base: nn.Module,
        lora_a: nn.Parameter,
        lora_b: nn.Parameter,
        *,
        kind: Kind,
        scaling: float,
        dropout: float,
    ) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A = Adapter(lora_a)
        self.lora_B = Adapter(lora_b)
        self.kind: Kind = kind
        self.scaling = scaling
        self.lora_dropout: nn.Module = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        x = self.lora_dropout(x)
        if self.kind == "row" and not getattr(self.base_layer, "input_is_parallel", True):
            from merak_tp import scatter_to_tp_region

            x = scatter_to_tp_region(x, self._tp_group(), -1)
        h = nn.functional.linear(x, self.lora_A.weight)
        if self.kind == "column":
            from merak_tp import copy_to_tp_region

            h = copy_to_tp_region(h, self._tp_group())  # all-reduce of dh in backward
        elif self.kind == "row":
            from merak_tp import reduce_from_tp_region

            h = reduce_from_tp_region(h, self._tp_group())  # sum of the partial A_r x_r
        return y + nn.functional.linear(h, self.lora_B.weight) * self.scaling

    def _tp_group(self) -> Any:
        """The base layer's TP process group (a merak-tp layer's ``group``)."""
        return getattr(self.base_layer, "group", None)

    def extra_repr(self) -> str:
        return f"kind={self.kind}, r={self.lora_A.weight.shape[0]}, scaling={self.scaling:g}"
