"""Where the elements a rank holds of a tensor sit in the full logical tensor: loads read only those.

[Note: bounded checkpoint loads] A rank's local tensor (a parameter, or an optimizer state shaped like
it) holds one or more rectangular blocks of the full logical tensor a checkpoint stores (see [Note:
checkpoint keys] in ``merak_core.checkpoint``): the whole of it (replicated), one block (a TP shard, a
ZeRO-2/3 shard of it, an EP rank's experts) or several (each section of a fused q/k/v or gate/up
projection split over TP: a TP rank's shard is one block per section, and under ZeRO-2/3 the rows of
them its DP shard keeps). :func:`local_regions` lists those blocks as :class:`Region` s: a view of the
local storage, in the checkpoint's orientation, and its offsets in the full tensor.

Loads read each region straight into its view, never the whole tensor: DCP is asked for those chunks
(:class:`RegionLoadPlanner`), a safetensors file for those slices (``get_slice``). So host memory holds
the rank's share (the tensors it keeps) plus what the reader holds while it copies one stored item (DCP
reads an item whole: at most the largest tensor). Before, a tensor of which a rank keeps a part of the
whole (fused sections, a ZeRO-2/3 shard) was staged whole in host memory, every such tensor at once,
then sliced (``tests/e2e/test_checkpoint_load_memory.py``, peak over the resident size: a ZeRO-3 dp=2
resume 97 MiB before, 35-39 after, against share + largest + 2 MiB = 42; GPT-2 at tp=2, fused ``c_attn``,
37 before, 21-22 after, against 24).

Not done here: the shard specs (``specs.py``), what a load asks for and restores (``load.py``, ``weights.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata

from merak_core.parallel._compat import dtensor_offsets, read_items_for_chunks

if TYPE_CHECKING:
    from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

    from merak_core.checkpoint.specs import TensorSpec

__all__ = ["Region", "RegionLoadPlanner", "copy_regions_", "local_regions"]


@dataclasses.dataclass(frozen=True)
class Region:
    """One rectangular block of a full tensor that a rank holds."""

    view: torch.Tensor
    """The local storage of the block (writes land in the rank's tensor), in the checkpoint's orientation."""
    offsets: tuple[int, ...]
    """Where the block starts in the full tensor."""

    def index(self) -> tuple[slice, ...]:
        """The block as an index into the full tensor."""
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.view.shape, strict=True))


def local_regions(local: torch.Tensor, spec: TensorSpec) -> list[Region]:
    """The blocks of the full tensor ``spec`` describes that ``local`` (parameter orientation, a ZeRO-2/3
    DTensor or a plain tensor) holds, each with a view of its storage (see the module docstring)."""
    from torch.distributed.tensor import DTensor

    if isinstance(local, DTensor):
        storage, start = (
            local.to_local(),
            dtensor_offsets(local),
        )  # its DP shard's place in the TP-local tensor
        tp_local = tuple(local.shape)
    else:
        storage, start, tp_local = local, (0,) * local.ndim, tuple(local.shape)
    view = spec.oriented(storage.detach())
    if spec.transposed:
        start, tp_local = start[::-1], tp_local[::-1]
    if any(n == 0 for n in view.shape):
        return []
    if spec.dim is None:
        return [Region(view, start)]
    dim = spec.dim
    regions = []
    lo, hi = start[dim], start[dim] + view.shape[dim]
    for local_at, full_at, length in _blocks(spec, tp_local[dim]):
        a, b = max(lo, local_at), min(hi, local_at + length)
        if a < b:
            offsets = list(start)
            offsets[dim] = full_at + (a - local_at)
            regions.append(Region(view.narrow(dim, a - lo, b - a), tuple(offsets)))
    return regions


def _blocks(spec: TensorSpec, tp_local_size: int) -> list[tuple[int, int, int]]:
    """(start in the TP-local tensor, start in the full tensor, length) along ``spec.dim``."""
    if spec.expert is not None:
        return [(0, spec.expert.first, tp_local_size)]
    from merak_tp.shard_spec import section_sizes

    out, local_at, full_at = [], 0, 0
    for size in section_sizes(spec.shard.sections, spec.full_shape[spec.dim or 0]):
        width = size // spec.tp
        out.append((local_at, full_at + spec.tp_rank * width, width))
        local_at, full_at = local_at + width, full_at + size
    return out


def copy_regions_(regions: list[Region], read: Any) -> int:
    """Fill every region with ``read(index)`` (the full tensor's elements at that index: a safetensors
    slice, a memory-mapped tensor); the bytes copied."""
    copied = 0
    for region in regions:
        region.view.copy_(read(region.index()))
        copied += region.view.numel() * region.view.element_size()
    return copied


class RegionLoadPlanner(DefaultLoadPlanner):
    """DCP's planner that also reads the keys of ``regions`` straight into their regions.

    Those keys are not in the state dict given to ``dcp.load``: each region is asked for as one chunk of
    the full tensor (DCP plans the overlap with every stored chunk) and received by its view.
    """

    def __init__(self, regions: Mapping[str, list[Region]]) -> None:
        super().__init__()
        self.regions = dict(regions)

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        assert self.metadata is not None  # set by set_up_planner
        items = list(plan.items)
        self._fan_out: dict[tuple[str, Any], _FanOut] = {}
        for key, regions in self.regions.items():
            md = self.metadata.state_dict_metadata.get(key)
            if not isinstance(md, TensorStorageMetadata):
                raise RuntimeError(f"the checkpoint holds no tensor {key!r}")
            chunks = [ChunkStorageMetadata(torch.Size(r.offsets), r.view.shape) for r in regions]
            items += self._one_read_per_stored_item(read_items_for_chunks(key, md, chunks))
        return dataclasses.replace(plan, items=items)

    def _one_read_per_stored_item(self, reads: list[ReadItem]) -> list[ReadItem]:
        """Several regions of one stored item (the sections of a fused tensor) read it once: DCP reads a
        stored item whole whatever part is asked for, so one read item covers them all and fans out."""
        groups: dict[Any, list[ReadItem]] = {}
        for item in reads:
            groups.setdefault(item.storage_index, []).append(item)
        out = []
        for storage_index, group in groups.items():
            if len(group) == 1:
                out.append(group[0])
                continue
            lo = [min(g.storage_offsets[d] for g in group) for d in range(len(group[0].lengths))]
            hi = [max(g.storage_offsets[d] + g.lengths[d] for g in group) for d in range(len(lo))]
            self._fan_out[(group[0].dest_index.fqn, storage_index)] = _FanOut(
                [(g, [o - a for o, a in zip(g.storage_offsets, lo, strict=True)]) for g in group],
                torch.Size(b - a for a, b in zip(lo, hi, strict=True)),
                self.regions[group[0].dest_index.fqn],
            )
            out.append(
                dataclasses.replace(
                    group[0],
                    dest_offsets=torch.Size([0] * len(lo)),
                    storage_offsets=torch.Size(lo),
                    lengths=torch.Size(b - a for a, b in zip(lo, hi, strict=True)),
                )
            )
        return out

    def resolve_tensor(self, read_item: ReadItem) -> Any:
        regions = self.regions.get(read_item.dest_index.fqn)
        if regions is None:
            return super().resolve_tensor(read_item)
        fan_out = self._fan_out.get((read_item.dest_index.fqn, read_item.storage_index))
        return (
            fan_out
            if fan_out is not None
            else _narrow(regions[read_item.dest_index.index or 0].view, read_item)
        )


def _narrow(view: torch.Tensor, item: ReadItem, at: Any = None) -> torch.Tensor:
    """The part of ``view`` that ``item`` writes (its destination offsets, or ``at``)."""
    for dim, (offset, length) in enumerate(
        zip(item.dest_offsets if at is None else at, item.lengths, strict=True)
    ):
        view = view.narrow(dim, offset, length)
    return view


class _FanOut:
    """The target of one read of a stored item that several regions take parts of: DCP's reader calls
    ``detach``, ``size`` and ``copy_`` on what the planner resolves, and each part lands in its region."""

    def __init__(self, parts: list[tuple[ReadItem, list[int]]], size: torch.Size, regions: list[Region]):
        self.parts, self._size, self.regions = parts, size, regions

    def detach(self) -> _FanOut:
        return self

    def size(self) -> torch.Size:
        return self._size

    def copy_(self, source: torch.Tensor) -> _FanOut:
        for item, at in self.parts:
            _narrow(self.regions[item.dest_index.index or 0].view, item).copy_(_narrow(source, item, at))
        return self
