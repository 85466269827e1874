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

[Note: adapters under sequence parallelism] Whoever sums the base layer's input-gradient terms
sums the adapter's too (``ColumnParallelLinear.input_reduction``):

- ``"layer"`` (plain TP): as above, dh is all-reduced beside the base's own all-reduce;
- ``"region"`` (a sequence-parallel region, or a sub-pipelined block): the region sums the input
  gradients of all its column layers once, so the adapter leaves its term ``dh_r A`` partial like
  the base's, and A's gradient ``dh_r^T x`` (one term per rank) is summed over TP instead;
- ``"sequence"`` (x arrives split along the sequence): ``h = A x_r`` on this rank's tokens is
  all-gathered along the sequence (r wide instead of x's width; its backward reduce-scatter sums
  dh), and A's gradient, made from this rank's tokens only, is summed over TP.

A row-parallel base under sequence parallelism reduce-scatters its output along the sequence:
``A_r x_r`` is reduce-scattered the same way, so ``B h`` covers this rank's tokens, and B's
gradient (from those tokens only) is summed over TP. A row layer whose output reduction a region
defers (block-level overlap) cannot be wrapped: the wrapper's sum makes the region's output
something other than the row layer's, so the region never defers it (checked at run time).

[Note: adapter dropout under TP] The dropout mask on the adapter's input must be the one a single
process would draw on the whole input. The Trainer seeds the default generator identically on
every TP rank, and the TP ranks run the same ops in the same order, so at each adapter the
generator is in the same state on every TP rank (``tests/e2e/test_tp_families_dropout.py``). Then:

- x whole and replicated (a column-parallel base without sequence parallelism, a row-parallel
  base that splits x itself, a replicated base): every rank applies the dropout to the whole x and
  draws the same mask, the single process's;
- x split over TP (a row-parallel base's input, split on features; a column-parallel base under
  sequence parallelism, split along the sequence): each rank draws the mask of the whole input (the
  same draws on every rank, ``F.dropout`` of ones of the global shape, so the same kernel and
  draws as one process's dropout of the whole x) and keeps its own block (by the adapter's
  ``ShardSpec`` for features, the sequence chunk for tokens).

Sub-pipelined TP (``overlap_chunks > 1``) runs the microbatch in chunks interleaved with other
layers' draws: refused with dropout (``merak_core.lora.config.check_lora_arguments``).

Not done here: choosing the targets (``apply.py``).
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
        # As PEFT: the adapter runs in its own dtype (float32 beside 16-bit weights), the sum in the
        # wider one, rounded to the base's output dtype once.
        x = self._dropout(x).to(self.lora_A.weight.dtype)
        b: torch.Tensor = self.lora_B.weight
        if self.kind == "column":
            h = self._column_h(x)
        elif self.kind == "row":
            h = self._row_h(x)
            if getattr(self.base_layer, "sequence_parallel", False):
                b = self._summed(b)  # [Note: adapters under sequence parallelism]: h holds this rank's tokens
        else:
            h = nn.functional.linear(x, self.lora_A.weight)
        return (y + nn.functional.linear(h, b) * self.scaling).to(y.dtype)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter's dropout with the single process's mask ([Note: adapter dropout under TP])."""
        drop = self.lora_dropout
        group = self._tp_group()
        if not isinstance(drop, nn.Dropout) or not self.training or group is None:
            return drop(x)
        import torch.distributed as dist

        tp, rank = dist.get_world_size(group), dist.get_rank(group)
        base: Any = self.base_layer
        if tp == 1:
            return drop(x)
        if self.kind == "row" and base.input_is_parallel:  # x: this rank's features
            from merak_tp.shard_spec import get_shard_spec

            full = (*x.shape[:-1], x.shape[-1] * tp)
            mask = nn.functional.dropout(x.new_ones(full), drop.p, True)
            flat = get_shard_spec(self.lora_A.weight).slice(mask.reshape(-1, full[-1]), tp, rank)
            return x * flat.reshape(x.shape)
        if self.kind == "column" and base.input_reduction() == "sequence":  # x: this rank's tokens
            dim = base.sequence_dim % x.ndim
            full = (*x.shape[:dim], x.shape[dim] * tp, *x.shape[dim + 1 :])
            mask = nn.functional.dropout(x.new_ones(full), drop.p, True)
            return x * mask.narrow(dim, rank * x.shape[dim], x.shape[dim])
        return drop(x)  # x whole and replicated: the same draws on every TP rank

    def _column_h(self, x: torch.Tensor) -> torch.Tensor:
        """``h = A x`` beside a column-parallel base, its gradients summed as the base's input gradient is."""
        from merak_tp import copy_to_tp_region, gather_from_sequence_region

        reduction = self.base_layer.input_reduction()  # type: ignore[operator]
        if reduction == "sequence":  # x is this rank's tokens: gather the r-wide h instead of x
            h = nn.functional.linear(x, self._summed(self.lora_A.weight))
            return gather_from_sequence_region(h, self._tp_group(), self.base_layer.sequence_dim)  # type: ignore[arg-type]
        if reduction == "region":  # the region sums the input-gradient terms: A's gradient is summed here
            return nn.functional.linear(x, self._summed(self.lora_A.weight))
        h = nn.functional.linear(x, self.lora_A.weight)
        return copy_to_tp_region(h, self._tp_group()) if reduction == "layer" else h  # dh all-reduced

    def _row_h(self, x: torch.Tensor) -> torch.Tensor:
        """``h = A x`` beside a row-parallel base: the partial ``A_r x_r`` summed (and, under sequence
        parallelism, scattered along the sequence like the base's output)."""
        from merak_tp import reduce_from_tp_region, reduce_scatter_to_sequence_region, scatter_to_tp_region

        base: Any = self.base_layer
        if base.output_deferred():
            raise RuntimeError(
                f"{type(self).__name__}: the row layer's output reduction is deferred to its region"
            )
        if not base.input_is_parallel:
            x = scatter_to_tp_region(x, self._tp_group(), -1)
        h = nn.functional.linear(x, self.lora_A.weight)
        if base.sequence_parallel:
            return reduce_scatter_to_sequence_region(h, self._tp_group(), base.sequence_dim)
        return reduce_from_tp_region(h, self._tp_group())

    def _summed(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` whose gradient is summed over the TP group (each rank computes one term of it)."""
        from merak_tp import copy_to_tp_region

        return copy_to_tp_region(weight, self._tp_group())

    def _tp_group(self) -> Any:
        """The base layer's TP process group (a merak-tp layer's ``group``)."""
        return getattr(self.base_layer, "group", None)

    def extra_repr(self) -> str:
        return f"kind={self.kind}, r={self.lora_A.weight.shape[0]}, scaling={self.scaling:g}"
