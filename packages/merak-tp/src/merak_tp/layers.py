"""Tensor-parallel layers: column / row parallel linears and a vocab-parallel embedding.

Each layer takes its TP process group as a constructor argument (any group:
the world or a subgroup from ``dist.new_group``; TP rank = ``dist.get_rank(group)``).

Every parameter of these layers carries a :class:`~merak_tp.shard_spec.ShardSpec` (see
[Note: shard metadata] in ``shard_spec.py``): the dim split over the group (or None), its
sections, and whether it was transposed from a transformers ``Conv1D``;
``merak_tp.gather_tensor`` uses it to rebuild the full tensor.

Shape legend: ``*`` leading dims (batch first, then sequence), i in-features,
o out-features, v vocabulary, h hidden.
"""

from __future__ import annotations

import copy
import logging
import math
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from merak_tp._events import _GroupRef, _RegionState
from merak_tp._linear_fns import _ColumnLinearFn, _RowLinearFn
from merak_tp.collectives import (
    gather_from_sequence_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    scatter_to_tp_region,
    tp_rank,
    tp_size,
)
from merak_tp.shard_spec import (
    Sections,
    ShardSpec,
    get_shard_spec,
    has_shard_spec,
    section_sizes,
    set_shard_spec,
)

logger = logging.getLogger(__name__)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "section_sizes"]


def _mark(
    param: nn.Parameter, dim: int | None, sections: Sections = 1, *, transposed: bool = False
) -> nn.Parameter:
    return set_shard_spec(param, ShardSpec(dim, sections, transposed))  # type: ignore[return-value]


class _KeepsShardTags:
    """``copy.deepcopy`` keeps the shard specs of the layer's parameters.

    ``nn.Parameter.__deepcopy__`` builds a new parameter without the old one's Python
    attributes; the specs are set again here (ties are kept by deepcopy's memo).
    """

    _parameters: dict[str, nn.Parameter | None]

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        cls = type(self)
        result = cls.__new__(cls)
        memo[id(self)] = result
        for key, value in self.__dict__.items():
            object.__setattr__(result, key, copy.deepcopy(value, memo))
        for name, param in self._parameters.items():
            new = result._parameters.get(name)
            if param is not None and new is not None and has_shard_spec(param):
                set_shard_spec(new, get_shard_spec(param))
        return result


def _divide(size: int, world: int, what: str, layer: str) -> int:
    if size % world:
        raise ValueError(
            f"{layer}: {what}={size} is not divisible by the tensor-parallel size {world}; "
            f"use a TP degree that divides {size} (or resize the layer)"
        )
    return size // world


def _shard(full: torch.Tensor, dim: int, world: int, rank: int, sections: Sections = 1) -> torch.Tensor:
    """This rank's block of ``full`` along ``dim`` as a new tensor (see ``ShardSpec.slice``)."""
    out = ShardSpec(dim, sections).slice(full, world, rank)
    return out.clone() if out.device.type != "meta" else out.contiguous()


def _linear_init(weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    # nn.Linear.reset_parameters, applied to the full-size tensors before slicing.
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if bias is not None:
        bound = 1 / math.sqrt(weight.size(1)) if weight.size(1) > 0 else 0.0
        nn.init.uniform_(bias, -bound, bound)


class ColumnParallelLinear(_KeepsShardTags, nn.Module):
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

    @property
    def group(self) -> ProcessGroup | None:
        """The TP process group."""
        return self._group_ref.group

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
        if overlap_chunks < 1:
            raise ValueError(f"overlap_chunks must be >= 1, got {overlap_chunks}")
        sizes = section_sizes(sections, out_features)
        if gather_output and len(sizes) > 1:
            raise ValueError("gather_output=True is not supported for a fused (sections > 1) projection")
        self._group_ref = _GroupRef(group)
        self.tp_size = tp_size(group)
        self.tp_rank = tp_rank(group)
        self.in_features = in_features
        self.out_features = out_features
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
        self.sequence_parallel = sequence_parallel
        self.sequence_dim = sequence_dim
        self.overlap_chunks = overlap_chunks
        self._merak_region: _RegionState | None = None
        kw = {"device": device, "dtype": dtype}
        self.weight = _mark(
            nn.Parameter(torch.empty(self.out_features_per_rank, in_features, **kw)), 0, sections
        )
        self.bias = (
            _mark(nn.Parameter(torch.empty(self.out_features_per_rank, **kw)), 0, sections) if bias else None
        )
        if not _skip_init:
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise like ``nn.Linear`` on the full-size weight, keep this rank's block."""
        dev = self.weight.device
        full_w = torch.empty(self.out_features, self.in_features, dtype=self.weight.dtype, device=dev)
        full_b = (
            torch.empty(self.out_features, dtype=self.weight.dtype, device=dev)
            if self.bias is not None
            else None
        )
        if dev.type == "meta":
            return
        _linear_init(full_w, full_b)
        with torch.no_grad():
            self.weight.copy_(_shard(full_w, 0, self.tp_size, self.tp_rank, self.sections))
            if self.bias is not None and full_b is not None:
                self.bias.copy_(_shard(full_b, 0, self.tp_size, self.tp_rank, self.sections))

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
        src_weight: torch.Tensor = linear.weight  # type: ignore[assignment]
        weight = src_weight.t() if transposed else src_weight
        bias: torch.Tensor | None = getattr(linear, "bias", None)
        out_f, in_f = weight.shape
        layer = cls(
            in_f,
            out_f,
            group=group,
            bias=bias is not None,
            gather_output=gather_output,
            sequence_parallel=sequence_parallel,
            sequence_dim=sequence_dim,
            overlap_chunks=overlap_chunks,
            sections=sections,
            device="meta",
            dtype=weight.dtype,
            _skip_init=True,
        )
        w = _shard(weight.detach(), 0, layer.tp_size, layer.tp_rank, sections)
        layer.weight = _mark(
            nn.Parameter(w, requires_grad=src_weight.requires_grad), 0, sections, transposed=transposed
        )
        if bias is not None:
            b = _shard(bias.detach(), 0, layer.tp_size, layer.tp_rank, sections)
            layer.bias = _mark(nn.Parameter(b, requires_grad=bias.requires_grad), 0, sections)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        region = self._merak_region
        mode = region.mode if region is not None else None
        chunks = 1 if mode == "block" else self.overlap_chunks
        reduce_input_grad = self.tp_size > 1
        if self.sequence_parallel and self.tp_size > 1:
            x = gather_from_sequence_region(x, self.group, self.sequence_dim)
            reduce_input_grad = False
        elif mode in ("block", "sp"):
            reduce_input_grad = False  # the region reduces the input gradient once for all its layers
        chunk = region.chunk if region is not None and mode == "block" else 0
        name = getattr(self, "_merak_name", "column")
        y = _ColumnLinearFn.apply(
            x, self.weight, self.bias, self.group, chunks, reduce_input_grad, name, chunk
        )
        if mode in ("probe", "sp") and region is not None:
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


class RowParallelLinear(_KeepsShardTags, nn.Module):
    """``y = sum_ranks(x_r W_r^T) + b`` with W split along its input features (dim 1).

    The input holds this rank's block of features (``input_is_parallel=False``
    splits a replicated input first). The partial products are all-reduced, or
    reduce-scattered along ``sequence_dim`` with ``sequence_parallel=True``;
    with ``overlap_chunks > 1`` chunk j's reduction is in flight while chunk j+1
    is computed. The bias is replicated (its ``ShardSpec.dim`` is None).
    """

    @property
    def group(self) -> ProcessGroup | None:
        """The TP process group."""
        return self._group_ref.group

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
        if overlap_chunks < 1:
            raise ValueError(f"overlap_chunks must be >= 1, got {overlap_chunks}")
        self._group_ref = _GroupRef(group)
        self.tp_size = tp_size(group)
        self.tp_rank = tp_rank(group)
        self.in_features = in_features
        self.out_features = out_features
        self.in_features_per_rank = _divide(in_features, self.tp_size, "in_features", type(self).__name__)
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.sequence_dim = sequence_dim
        self.overlap_chunks = overlap_chunks
        self._merak_region: _RegionState | None = None
        kw = {"device": device, "dtype": dtype}
        self.weight = _mark(nn.Parameter(torch.empty(out_features, self.in_features_per_rank, **kw)), 1)
        self.bias = _mark(nn.Parameter(torch.empty(out_features, **kw)), None) if bias else None
        if not _skip_init:
            self.reset_parameters()

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
        with torch.no_grad():
            self.weight.copy_(_shard(full_w, 1, self.tp_size, self.tp_rank))
            if self.bias is not None and full_b is not None:
                self.bias.copy_(full_b)

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
        src_weight: torch.Tensor = linear.weight  # type: ignore[assignment]
        weight = src_weight.t() if transposed else src_weight
        bias: torch.Tensor | None = getattr(linear, "bias", None)
        out_f, in_f = weight.shape
        layer = cls(
            in_f,
            out_f,
            group=group,
            bias=bias is not None,
            input_is_parallel=input_is_parallel,
            sequence_parallel=sequence_parallel,
            sequence_dim=sequence_dim,
            overlap_chunks=overlap_chunks,
            device="meta",
            dtype=weight.dtype,
            _skip_init=True,
        )
        w = _shard(weight.detach(), 1, layer.tp_size, layer.tp_rank)
        layer.weight = _mark(
            nn.Parameter(w, requires_grad=src_weight.requires_grad), 1, transposed=transposed
        )
        if bias is not None:
            layer.bias = _mark(bias if isinstance(bias, nn.Parameter) else nn.Parameter(bias.detach()), None)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return nn.functional.linear(x, self.weight, self.bias)
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.group, -1)
        region = self._merak_region
        mode = region.mode if region is not None else None
        block = mode == "block"
        chunks = 1 if block else self.overlap_chunks
        chunk = region.chunk if region is not None and block else 0
        name = getattr(self, "_merak_name", "row")
        y = _RowLinearFn.apply(
            x,
            self.weight,
            self.bias,
            self.group,
            chunks,
            "reduce_scatter" if self.sequence_parallel else "all_reduce",
            self.sequence_dim,
            name,
            chunk,
            region if block else None,
        )
        if block and self.sequence_parallel:
            y = y.movedim(0, self.sequence_dim % x.dim())  # [Note: block-level overlap] in overlap.py
        if region is not None and mode in ("probe", "block", "sp"):
            region.calls.append(("row", y))
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (per rank {self.in_features_per_rank}), "
            f"out_features={self.out_features}, tp={self.tp_size}, bias={self.bias is not None}, "
            f"sequence_parallel={self.sequence_parallel}, overlap_chunks={self.overlap_chunks}"
        )


class VocabParallelEmbedding(_KeepsShardTags, nn.Module):
    """An embedding table split along the vocabulary (dim 0) over ``group``.

    Each rank looks up the ids in its block of the vocabulary (others give zero)
    and the partial results are all-reduced. The weight has the same layout as a
    ``ColumnParallelLinear`` over the vocabulary, so a tied output projection can
    share the very same local shard. ``embed_scale`` multiplies the looked-up rows (an
    embedding scaled by sqrt(hidden), as Gemma's), kept as a non-persistent buffer.
    """

    @property
    def group(self) -> ProcessGroup | None:
        """The TP process group."""
        return self._group_ref.group

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        group: ProcessGroup | None,
        padding_idx: int | None = None,
        embed_scale: float | torch.Tensor | None = None,
        device: Any = None,
        dtype: torch.dtype | None = None,
        _skip_init: bool = False,
    ) -> None:
        super().__init__()
        self._group_ref = _GroupRef(group)
        self.tp_size = tp_size(group)
        self.tp_rank = tp_rank(group)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_per_rank = _divide(
            num_embeddings, self.tp_size, "num_embeddings", type(self).__name__
        )
        self.vocab_start = self.tp_rank * self.num_embeddings_per_rank
        self.vocab_end = self.vocab_start + self.num_embeddings_per_rank
        self.padding_idx = padding_idx
        self.weight = _mark(
            nn.Parameter(
                torch.empty(self.num_embeddings_per_rank, embedding_dim, device=device, dtype=dtype)
            ),
            0,
        )
        self.embed_scale: torch.Tensor | None
        if embed_scale is None:
            self.embed_scale = None
        else:
            scale = (
                embed_scale.detach().clone()
                if isinstance(embed_scale, torch.Tensor)
                else torch.tensor(float(embed_scale), device=device)
            )
            self.register_buffer("embed_scale", scale, persistent=False)
        if not _skip_init:
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Embedding``'s init (standard normal, zero padding row) on the full table, sliced."""
        if self.weight.device.type == "meta":
            return
        full = torch.empty(
            self.num_embeddings, self.embedding_dim, dtype=self.weight.dtype, device=self.weight.device
        )
        nn.init.normal_(full)
        if self.padding_idx is not None:
            full[self.padding_idx].zero_()
        with torch.no_grad():
            self.weight.copy_(_shard(full, 0, self.tp_size, self.tp_rank))

    @classmethod
    def from_embedding(
        cls,
        embedding: nn.Embedding,
        *,
        group: ProcessGroup | None,
        embed_scale: float | torch.Tensor | None = None,
    ) -> VocabParallelEmbedding:
        """Slice an existing ``nn.Embedding`` (real or meta weights) into this rank's vocab shard.

        ``embed_scale``: the factor the source module's forward multiplies its rows by, if any.
        """
        if getattr(embedding, "max_norm", None) is not None or getattr(embedding, "sparse", False):
            raise ValueError("VocabParallelEmbedding supports neither max_norm nor sparse embeddings")
        num, dim = embedding.weight.shape
        if embed_scale is not None and not isinstance(embed_scale, torch.Tensor):
            embed_scale = torch.tensor(float(embed_scale), device=embedding.weight.device)
        layer = cls(
            num,
            dim,
            group=group,
            padding_idx=embedding.padding_idx,
            embed_scale=embed_scale,
            device="meta",
            dtype=embedding.weight.dtype,
            _skip_init=True,
        )
        w = _shard(embedding.weight.detach(), 0, layer.tp_size, layer.tp_rank)
        layer.weight = _mark(nn.Parameter(w, requires_grad=embedding.weight.requires_grad), 0)
        return layer

    def _local_padding_idx(self) -> int | None:
        p = self.padding_idx
        if p is None:
            return None
        p = p % self.num_embeddings
        return p - self.vocab_start if self.vocab_start <= p < self.vocab_end else None

    def _check_ids(self, ids: torch.Tensor) -> None:
        """An id outside the vocabulary is an error (masked, it would embed as a row of zeros on every rank).

        Every TP rank holds the same ids, so every rank raises the same error before the all-reduce.
        """
        if ids.is_meta or torch.compiler.is_compiling() or torch.compiler.is_exporting():
            return
        bad = (ids < 0) | (ids >= self.num_embeddings)
        if bool(bad.any()):
            value = int(ids[bad].flatten()[0])
            raise ValueError(
                f"token id {value} is outside the vocabulary of {self.num_embeddings} (ids 0.."
                f"{self.num_embeddings - 1}) of this vocab-parallel embedding; fix the tokenizer or "
                "the data, or build the model with a vocabulary that covers every id"
            )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            out = nn.functional.embedding(ids, self.weight, self.padding_idx)
        else:
            self._check_ids(ids)
            outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
            local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
            out = nn.functional.embedding(local_ids, self.weight, self._local_padding_idx())
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
            out = reduce_from_tp_region(out, self.group)
        if self.embed_scale is not None:
            # One non-zero row per token in the sum: scaling after the reduction is exact.
            out = out * self.embed_scale.to(self.weight.dtype)
        return out

    def extra_repr(self) -> str:
        scale = (
            ""
            if self.embed_scale is None
            else f", embed_scale={float(self.embed_scale):g}"
            if self.embed_scale.device.type != "meta"
            else ", embed_scale=(meta)"
        )
        return (
            f"{self.num_embeddings} (per rank {self.num_embeddings_per_rank}), {self.embedding_dim}, "
            f"tp={self.tp_size}{scale}"
        )
