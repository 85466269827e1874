"""Typed shard metadata: how a tensor-parallel parameter relates to its full logical tensor.

[Note: shard metadata] Every parameter that merak-tp touches carries one :class:`ShardSpec`
(read with :func:`get_shard_spec`, written with :func:`set_shard_spec`):

- ``dim``: the tensor dim split over the TP group in contiguous equal blocks in rank order, or
  ``None`` when the parameter is replicated (identical on every TP rank, with an identical
  gradient);
- ``sections``: 1, or the number of sections the sharded dim is made of (a fused q/k/v or
  gate/up projection), each split separately; unequal sections (grouped-query q/k/v) are given
  as the tuple of their full sizes;
- ``transposed``: the parameter was sliced from a weight stored (in, out) (a transformers
  ``Conv1D``) and is kept in ``nn.Linear``'s (out, in) layout: transpose the full tensor to get
  the original layout back;
- ``sequence_partial``: a replicated parameter whose gradient, under sequence parallelism, is
  computed from this rank's tokens only (its gradient hook sums it over the TP group).

Checkpoints, gradient clipping, ZeRO and weight export read this object, never loose attributes.
This module does no communication except in :meth:`ShardSpec.gather`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup

from merak_tp._compat import all_gather_dim0

__all__ = ["REPLICATED", "ShardSpec", "get_shard_spec", "has_shard_spec", "section_sizes", "set_shard_spec"]

Sections = int | tuple[int, ...]
"""Equal sections (a count) or the full sizes of unequal sections along the sharded dim."""

_ATTR = "_merak_shard_spec"


def section_sizes(sections: Sections, size: int) -> tuple[int, ...]:
    """The full size of every section of a dim of ``size`` (``sections`` a count or explicit sizes)."""
    if isinstance(sections, int):
        if sections < 1 or size % sections:
            raise ValueError(f"sections={sections} must be >= 1 and divide the size {size}")
        return (size // sections,) * sections
    sizes = tuple(int(s) for s in sections)
    if not sizes or any(s < 1 for s in sizes) or sum(sizes) != size:
        raise ValueError(f"section sizes {sizes} must be positive and add up to the size {size}")
    return sizes


@dataclass(frozen=True)
class ShardSpec:
    """How one local tensor is a shard of its full tensor (see [Note: shard metadata])."""

    dim: int | None = None
    """The dim split over the TP group, or None (replicated)."""
    sections: Sections = 1
    """Section count, or the full sizes of unequal sections (normalised: equal sizes become a count)."""
    transposed: bool = False
    """Kept in (out, in) layout from a weight stored (in, out)."""
    sequence_partial: bool = False
    """Replicated, with a gradient summed over the TP group under sequence parallelism."""

    def __post_init__(self) -> None:
        if self.dim is not None and (not isinstance(self.dim, int) or self.dim < 0):
            raise ValueError(f"ShardSpec.dim={self.dim!r}: expected None or a dim >= 0")
        if isinstance(self.sections, int):
            if self.sections < 1:
                raise ValueError(f"ShardSpec.sections={self.sections}: expected >= 1")
        else:
            sizes = tuple(int(s) for s in self.sections)
            if not sizes or any(s < 1 for s in sizes):
                raise ValueError(f"ShardSpec.sections={self.sections!r}: expected positive section sizes")
            object.__setattr__(self, "sections", len(sizes) if len(set(sizes)) == 1 else sizes)

    @property
    def sharded(self) -> bool:
        """True when the tensor is split over the TP group (``dim`` is not None)."""
        return self.dim is not None

    @property
    def num_sections(self) -> int:
        """How many sections the sharded dim holds (1 for a plain shard)."""
        return self.sections if isinstance(self.sections, int) else len(self.sections)

    def replace(self, **changes: object) -> ShardSpec:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def full_shape(self, local_shape: torch.Size | tuple[int, ...], world: int) -> tuple[int, ...]:
        """The full tensor's shape (in the local tensor's layout) from a shard's shape."""
        shape = list(local_shape)
        if self.dim is not None:
            shape[self.dim] *= world
        return tuple(shape)

    def local_section_sizes(self, local_size: int, world: int) -> tuple[int, ...]:
        """The size of every section in one rank's block of ``local_size`` along ``dim``."""
        if isinstance(self.sections, int):
            return (local_size // self.sections,) * self.sections
        return tuple(size // world for size in self.sections)

    def slice(self, full: torch.Tensor, world: int, rank: int) -> torch.Tensor:
        """Rank ``rank``'s block of ``full`` (each section split separately; a view for one section)."""
        if self.dim is None:
            return full
        dim = self.dim
        sizes = section_sizes(self.sections, full.size(dim))
        parts = full.split(list(sizes), dim=dim) if len(sizes) > 1 else (full,)
        if any(size % world for size in sizes):
            raise ValueError(
                f"sections {sizes} along dim {dim} of {tuple(full.shape)} are not all divisible by "
                f"the tensor-parallel size {world}"
            )
        local = [p.chunk(world, dim=dim)[rank] for p in parts]
        return local[0] if len(local) == 1 else torch.cat(local, dim=dim)

    def gather(self, tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        """The full tensor from every rank's shard ``tensor`` (collective over ``group``).

        A replicated tensor, or a group of one rank, gives ``tensor`` detached.
        """
        world = torch.distributed.get_world_size(group)
        if self.dim is None or world == 1:
            return tensor.detach()
        dim = self.dim
        x0 = tensor.detach().movedim(dim, 0).contiguous()
        out = torch.empty((world * x0.size(0), *x0.shape[1:]), dtype=x0.dtype, device=x0.device)
        all_gather_dim0(out, x0, group)
        if self.num_sections > 1:
            blocks = out.chunk(world, dim=0)  # one block per rank
            local = list(self.local_section_sizes(x0.size(0), world))
            per_rank = [b.split(local, dim=0) for b in blocks]
            out = torch.cat([per_rank[r][s] for s in range(self.num_sections) for r in range(world)], dim=0)
        return out.movedim(0, dim)


REPLICATED = ShardSpec()
"""The spec of a tensor identical on every TP rank (and of any untagged tensor)."""


def has_shard_spec(tensor: torch.Tensor) -> bool:
    """True when merak-tp has tagged ``tensor`` (sharded or replicated)."""
    return isinstance(getattr(tensor, _ATTR, None), ShardSpec)


def get_shard_spec(tensor: torch.Tensor) -> ShardSpec:
    """The :class:`ShardSpec` of ``tensor``; :data:`REPLICATED` when it carries none."""
    spec = getattr(tensor, _ATTR, None)
    return spec if isinstance(spec, ShardSpec) else REPLICATED


def set_shard_spec(tensor: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """Tag ``tensor`` with ``spec`` and return it."""
    if not isinstance(spec, ShardSpec):
        raise TypeError(f"set_shard_spec needs a ShardSpec, got {type(spec).__name__}")
    setattr(tensor, _ATTR, spec)
    return tensor
