"""Tensor-parallel linears: ``ColumnParallelLinear`` (output features split) and ``RowParallelLinear``.

Each layer takes its TP process group as a constructor argument (any group:
the world or a subgroup from ``dist.new_group``; TP rank = ``dist.get_rank(group)``).

Every parameter of these layers carries a :class:`~merak_tp.shard_spec.ShardSpec` (see
[Note: shard metadata] in ``shard_spec.py``): the dim split over the group (or None), its
sections, and whether it was transposed from a transformers ``Conv1D``;
``merak_tp.gather_tensor`` uses it to rebuild the full tensor. The differentiable
matmul-plus-collective functions the layers call live in ``_linear_fns.py``; the
vocab-parallel embedding in ``embedding.py``.

Shape legend: ``*`` leading dims (batch first, then sequence), i in-features, o out-features.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from merak_tp._events import _RegionState
from merak_tp._linear_fns import _LinearCall, _ParallelLinearFn
from merak_tp._tp_module import _divide, _mark, _shard, _shard_param, _TPModule
from merak_tp.collectives import gather_from_sequence_region, gather_from_tp_region, scatter_to_tp_region
from merak_tp.shard_spec import Sections, section_sizes

__all__ = ["ColumnParallelLinear", "RowParallelLinear"]


def _linear_init(weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    # nn.Linear.reset_parameters, applied to the full-size tensors before slicing.
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if bias is not None:
        bound = 1 / math.sqrt(weight.size(1)) if weight.size(1) > 0 else 0.0
        nn.init.uniform_(bias, -bound, bound)


def _linear_source(linear: nn.Module, transposed: bool) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """``(weight as (out, in), bias, weight.requires_grad)`` of an ``nn.Linear`` or a ``Conv1D``."""
    src_weight: torch.Tensor = linear.weight  # type: ignore[assignment]
    weight = src_weight.t() if transposed else src_weight
    bias: torch.Tensor | None = getattr(linear, "bias", None)
    return weight, bias, src_weight.requires_grad


class _ParallelLinear(_TPModule):
    """What the column and the row layer share: options, ``nn.Linear``'s init, the repr."""

    weight: nn.Parameter
    bias: nn.Parameter | None
    layer_name: str
    """The layer's name in overlap events (``record_overlap_events``): its module name once
    ``parallelize`` made it, else ``"column"`` / ``"row"``."""

    def _set_options(
        self,
        in_features: int,
        out_features: int,
        group: ProcessGroup | None,
        sequence_parallel: bool,
        sequence_dim: int,
        overlap_chunks: int,
    ) -> None:
        if overlap_chunks < 1:
            raise ValueError(f"overlap_chunks must be >= 1, got {overlap_chunks}")
        self._bind_group(group)
        self.in_features = in_features
        self.out_features = out_features
        self.sequence_parallel = sequence_parallel
        self.sequence_dim = sequence_dim
        self.overlap_chunks = overlap_chunks
        self._region: _RegionState | None = None

    def join_region(self, state: _RegionState | None) -> None:
        """Run inside the region whose run-time state is ``state`` (None: on its own again)."""
        self._region = state

    def _block_region(self) -> _RegionState | None:
        """The enclosing region when it runs in block mode (it chunks the batch and owns the collectives)."""
        region = self._region
        return region if region is not None and region.mode == "block" else None

    def _call(self, kind: str, **options: Any) -> _LinearCall:
        """This forward's options for :class:`_ParallelLinearFn`: one chunk inside a block-mode region (the
        region chunks the batch), else the layer's ``overlap_chunks``."""
        block = self._block_region()
        chunks, chunk = (1, block.chunk) if block is not None else (self.overlap_chunks, 0)
        return _LinearCall(kind, self.group, chunks, self.layer_name, chunk, **options)

    @classmethod
    def _meta_from(
        cls, linear: nn.Module, transposed: bool, **options: Any
    ) -> tuple[Any, torch.Tensor, torch.Tensor | None, bool]:
        """A meta-device layer of ``linear``'s size and dtype with ``options``, and ``linear``'s weight as
        (out, in), bias and whether the weight wants a gradient (:func:`_linear_source`)."""
        weight, bias, weight_grad = _linear_source(linear, transposed)
        out_f, in_f = weight.shape
        layer = cls(
            in_f, out_f, bias=bias is not None, device="meta", dtype=weight.dtype, _skip_init=True, **options
        )
        return layer, weight, bias, weight_grad

    def _blocks(
        self, full_w: torch.Tensor, full_b: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's weight and bias out of the full-size ones."""
        raise NotImplementedError

    def reset_parameters(self) -> None:
        """Initialise like ``nn.Linear`` on the full-size weight, keep this rank's block."""
        dev = self.weight.device
        if dev.type == "meta":
            return
        full_w = torch.empty(self.out_features, self.in_features, dtype=self.weight.dtype, device=dev)
        full_b = (
            torch.empty(self.out_features, dtype=self.weight.dtype, device=dev)
            if self.bias is not None
            else None
        )
        _linear_init(full_w, full_b)
        w, b = self._blocks(full_w, full_b)
        with torch.no_grad():
            self.weight.copy_(w)
            if self.bias is not None and b is not None:
                self.bias.copy_(b)


class ColumnParallelLinear(_ParallelLinear):
    """``y = x W^T + b`` with W split along its output features (dim 0) over ``group``.

    The input is replicated on every TP rank; the output holds this rank's block of
    features (``gather_output=True`` all-gathers them). In backward the input
    gradient is all-reduced over the group (chunked and overlapped with
    ``overlap_chunks > 1``, see [Note: layer-level overlap]). With
    ``sequence_parallel=True`` the input arrives split along ``sequence_dim`` and
    is all-gathered first (its gradient is reduce-scattered back).

    ``reset_parameters`` draws the full-size weight exactly as ``nn.Linear`` would
    and keeps this rank's block, so with the same seed on every rank the layer
    equals an ``nn.Linear`` built with that seed.
    """

    layer_name = "column"

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        group: ProcessGroup | None,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
        overlap_chunks: int = 1,
        sections: Sections = 1,
        device: Any = None,
        dtype: torch.dtype | None = None,
        _skip_init: bool = False,
    ) -> None:
        super().__init__()
        sizes = section_sizes(sections, out_features)
        if gather_output and len(sizes) > 1:
            raise ValueError("gather_output=True is not supported for a fused (sections > 1) projection")
        self._set_options(in_features, out_features, group, sequence_parallel, sequence_dim, overlap_chunks)
        self.sections = sections
        self.out_features_per_rank = sum(
            _divide(
                size,
                self.tp_size,
                "out_features" if len(sizes) == 1 else f"out_features section {i} of {sizes}",
                type(self).__name__,
            )
            for i, size in enumerate(sizes)
        )
        self.gather_output = gather_output
        kw = {"device": device, "dtype": dtype}
        self.weight = _mark(
            nn.Parameter(torch.empty(self.out_features_per_rank, in_features, **kw)), 0, sections
        )
        self.bias = (
            _mark(nn.Parameter(torch.empty(self.out_features_per_rank, **kw)), 0, sections) if bias else None
        )
        if not _skip_init:
            self.reset_parameters()

    def _blocks(
        self, full_w: torch.Tensor, full_b: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        block_b = None if full_b is None else _shard(full_b, 0, self.tp_size, self.tp_rank, self.sections)
        return _shard(full_w, 0, self.tp_size, self.tp_rank, self.sections), block_b

    @classmethod
    def from_linear(
        cls,
        linear: nn.Module,
        *,
        group: ProcessGroup | None,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
        overlap_chunks: int = 1,
        sections: Sections = 1,
        transposed: bool = False,
    ) -> ColumnParallelLinear:
        """Slice an existing ``nn.Linear`` (real or meta weights) into this rank's column shard.

        ``transposed=True`` reads a weight stored as (in, out) (transformers' ``Conv1D``).
        """
        layer, weight, bias, weight_grad = cls._meta_from(
            linear,
            transposed,
            group=group,
            gather_output=gather_output,
            sequence_parallel=sequence_parallel,
            sequence_dim=sequence_dim,
            overlap_chunks=overlap_chunks,
            sections=sections,
        )
        world, rank = layer.tp_size, layer.tp_rank
        layer.weight = _shard_param(
            weight, 0, world, rank, sections, transposed=transposed, requires_grad=weight_grad
        )
        if bias is not None:
            layer.bias = _shard_param(bias, 0, world, rank, sections)
        return layer

    def input_reduction(self) -> str:
        """Who sums this layer's input gradient over the TP group in the current forward.

        ``"layer"``: this layer's all-reduce; ``"sequence"``: the input arrives split along the
        sequence and this layer's all-gather reduce-scatters the gradient back; ``"region"``: the
        enclosing region, once for all its layers (block-level overlap, sequence-parallel regions);
        ``"none"``: tp = 1. For code that adds its own path on the same input (LoRA adapters): its
        input-gradient term must be summed the same way.
        """
        region = self._region
        mode = region.mode if region is not None else None
        if self.tp_size == 1:
            return "none"
        if self.sequence_parallel:
            return "sequence"
        return "region" if mode in ("block", "sp") else "layer"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        reduction = self.input_reduction()
        if reduction == "sequence":
            x = gather_from_sequence_region(x, self.group, self.sequence_dim)
        # "region": the region reduces the input gradient once for all its layers.
        call = self._call("column", reduce_input_grad=reduction == "layer")
        y = _ParallelLinearFn.apply(x, self.weight, self.bias, call)
        region = self._region
        if region is not None and region.mode in ("probe", "sp"):
            region.calls.append(("column", self))
        if self.gather_output and self.tp_size > 1:
            y = gather_from_tp_region(y, self.group, -1)
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"(per rank {self.out_features_per_rank}), tp={self.tp_size}, bias={self.bias is not None}, "
            f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}, "
            f"overlap_chunks={self.overlap_chunks}"
        )


class RowParallelLinear(_ParallelLinear):
    """``y = sum_ranks(x_r W_r^T) + b`` with W split along its input features (dim 1).

    The input holds this rank's block of features (``input_is_parallel=False``
    splits a replicated input first). The partial products are all-reduced, or
    reduce-scattered along ``sequence_dim`` with ``sequence_parallel=True``;
    with ``overlap_chunks > 1`` chunk j's reduction is in flight while chunk j+1
    is computed. The bias is replicated (its ``ShardSpec.dim`` is None).
    """

    layer_name = "row"

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        group: ProcessGroup | None,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
        overlap_chunks: int = 1,
        device: Any = None,
        dtype: torch.dtype | None = None,
        _skip_init: bool = False,
    ) -> None:
        super().__init__()
        self._set_options(in_features, out_features, group, sequence_parallel, sequence_dim, overlap_chunks)
        self.in_features_per_rank = _divide(in_features, self.tp_size, "in_features", type(self).__name__)
        self.input_is_parallel = input_is_parallel
        kw = {"device": device, "dtype": dtype}
        self.weight = _mark(nn.Parameter(torch.empty(out_features, self.in_features_per_rank, **kw)), 1)
        self.bias = _mark(nn.Parameter(torch.empty(out_features, **kw)), None) if bias else None
        if not _skip_init:
            self.reset_parameters()

    def _blocks(
        self, full_w: torch.Tensor, full_b: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return _shard(full_w, 1, self.tp_size, self.tp_rank), full_b

    @classmethod
    def from_linear(
        cls,
        linear: nn.Module,
        *,
        group: ProcessGroup | None,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
        overlap_chunks: int = 1,
        transposed: bool = False,
    ) -> RowParallelLinear:
        """Slice an existing ``nn.Linear`` (real or meta weights) into this rank's row shard."""
        layer, weight, bias, weight_grad = cls._meta_from(
            linear,
            transposed,
            group=group,
            input_is_parallel=input_is_parallel,
            sequence_parallel=sequence_parallel,
            sequence_dim=sequence_dim,
            overlap_chunks=overlap_chunks,
        )
        layer.weight = _shard_param(
            weight, 1, layer.tp_size, layer.tp_rank, transposed=transposed, requires_grad=weight_grad
        )
        if bias is not None:
            layer.bias = _mark(bias if isinstance(bias, nn.Parameter) else nn.Parameter(bias.detach()), None)
        return layer

    def output_deferred(self) -> bool:
        """Whether the current forward leaves the output's reduction in flight for the enclosing region
        (block-level overlap): the output is then a partial sum that only the region completes."""
        region = self._region
        return self.tp_size > 1 and region is not None and region.mode == "block"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return nn.functional.linear(x, self.weight, self.bias)
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.group, -1)
        block = self._block_region()
        mode = "reduce_scatter" if self.sequence_parallel else "all_reduce"
        call = self._call("row", mode=mode, seq_dim=self.sequence_dim, defer=block)
        y = _ParallelLinearFn.apply(x, self.weight, self.bias, call)
        if block is not None and self.sequence_parallel:
            y = y.movedim(0, self.sequence_dim % x.dim())  # [Note: block-level overlap] in overlap.py
        region = self._region
        if region is not None and region.mode in ("probe", "block", "sp"):
            region.calls.append(("row", y))
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (per rank {self.in_features_per_rank}), "
            f"out_features={self.out_features}, tp={self.tp_size}, bias={self.bias is not None}, "
            f"sequence_parallel={self.sequence_parallel}, overlap_chunks={self.overlap_chunks}"
        )
