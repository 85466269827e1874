"""DCP's read-item helper removed (issue 25, item 2): checkpoint loads plan the same reads without it.

``merak_core.checkpoint.regions`` asks DCP for the blocks a rank holds ([Note: bounded checkpoint
loads]) through ``_compat.read_items_for_chunks``: torch's undocumented
``planner_helpers.create_read_items_for_chunk_list`` where present, else the same read items from the
public ``ReadItem`` / ``MetadataIndex`` and the overlap arithmetic. Checked here: the fallback gives the
same read items as torch's helper (every field, the chunk indexes included) for random chunkings of 0-d
to 3-d tensors, uneven and empty chunks included; and with the helper deleted from torch, a load of
blocks that cross stored chunks (one process, one stored chunk; two ranks, a tensor saved in two
chunks) gives the same tensors, equal to the saved elements.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import planner_helpers
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
)

from merak_core.parallel import _compat
from tests.support.dist import run_on_ranks

HELPER = "create_read_items_for_chunk_list"


def _grid(shape: tuple[int, ...], cuts: list[list[int]]) -> list[ChunkStorageMetadata]:
    """The chunks of ``shape`` cut at ``cuts[d]`` along each dim (empty pieces kept, as uneven shards make)."""
    bounds = [[0, *sorted(c), n] for c, n in zip(cuts, shape, strict=True)]
    chunks = [ChunkStorageMetadata(torch.Size([]), torch.Size([]))]
    for edges in bounds:
        pieces = list(zip(edges[:-1], edges[1:], strict=True))
        chunks = [
            ChunkStorageMetadata(torch.Size([*c.offsets, a]), torch.Size([*c.sizes, b - a]))
            for c in chunks
            for a, b in pieces
        ]
    return chunks


def _cuts(rng: random.Random, shape: tuple[int, ...]) -> list[list[int]]:
    return [[rng.randint(0, n) for _ in range(rng.randint(0, 3))] for n in shape]


def _blocks(rng: random.Random, shape: tuple[int, ...]) -> list[ChunkStorageMetadata]:
    """Requested blocks as regions are (not a grid: fused sections, ZeRO rows of them), none empty."""
    out = []
    for _ in range(rng.randint(1, 4)):
        starts = [rng.randint(0, n - 1) for n in shape]
        sizes = [rng.randint(1, n - s) for s, n in zip(starts, shape, strict=True)]
        out.append(ChunkStorageMetadata(torch.Size(starts), torch.Size(sizes)))
    return out


def _key(item: Any) -> tuple[Any, ...]:
    """Every field of a read item, the chunk positions too (``MetadataIndex`` equality ignores them)."""
    return (
        item.type,
        item.dest_index.fqn,
        tuple(item.dest_index.offset),
        item.dest_index.index,
        tuple(item.dest_offsets),
        item.storage_index.fqn,
        tuple(item.storage_index.offset),
        item.storage_index.index,
        tuple(item.storage_offsets),
        tuple(item.lengths),
    )


def _cases() -> list[tuple[TensorStorageMetadata, list[ChunkStorageMetadata]]]:
    rng = random.Random(0)
    cases = []
    for ndim in (0, 1, 2, 3):
        for _ in range(60 if ndim else 2):
            shape = tuple(rng.randint(1, 7) for _ in range(ndim))
            stored = _grid(shape, _cuts(rng, shape))
            md = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(shape), stored)
            wanted = _grid(shape, _cuts(rng, shape)) if rng.random() < 0.3 else _blocks(rng, shape)
            cases.append((md, [c for c in wanted if all(n > 0 for n in c.sizes)]))
    return cases


def test_read_items_without_torchs_helper_equal_torchs(monkeypatch: pytest.MonkeyPatch) -> None:
    real = getattr(planner_helpers, HELPER)
    cases = _cases()
    assert sum(len(real("w", md, wanted)) > len(wanted) for md, wanted in cases) > 50  # chunks are crossed
    monkeypatch.delattr(planner_helpers, HELPER)
    for md, wanted in cases:
        want = sorted(map(_key, real("w", md, wanted)))
        got = _compat.read_items_for_chunks("w", md, wanted)
        assert sorted(map(_key, got)) == want, (md, wanted)


def _regions(view_of: dict[str, torch.Tensor]) -> dict[str, list[Any]]:
    """Blocks of a (6, 4) tensor that cross rows 3 (where two ranks' saved chunks meet) and share rows."""
    from merak_core.checkpoint.regions import Region

    blocks = {"w": [(1, 0, 4, 2), (0, 2, 2, 2), (4, 1, 2, 3)]}  # (row, col, rows, cols)
    return {
        key: [Region(view_of[key][i, :n, :m], (r, c)) for i, (r, c, n, m) in enumerate(found)]
        for key, found in blocks.items()
    }


def _load_blocks(directory: str, remove: bool) -> tuple[torch.Tensor, int]:
    """(the blocks of :func:`_regions` read through ``RegionLoadPlanner``, how many plans the fallback made),
    torch's helper deleted if ``remove``."""
    import torch.distributed.checkpoint as dcp

    from merak_core.checkpoint.regions import RegionLoadPlanner

    target = torch.full((3, 4, 3), -1.0, dtype=torch.float64)
    real, fallback = getattr(planner_helpers, HELPER), _compat._read_items_from_overlaps
    calls = []

    def counted(*args: Any) -> Any:
        calls.append(args[0])
        return fallback(*args)

    _compat._read_items_from_overlaps = counted  # type: ignore[assignment]
    if remove:
        delattr(planner_helpers, HELPER)  # a torch without it (the planner asks for nothing else)
    try:
        dcp.load({}, checkpoint_id=directory, planner=RegionLoadPlanner(_regions({"w": target})))
    finally:
        setattr(planner_helpers, HELPER, real)
        _compat._read_items_from_overlaps = fallback  # type: ignore[assignment]
    return target, len(calls)


def _expected(full: torch.Tensor) -> torch.Tensor:
    out = torch.full((3, 4, 3), -1.0, dtype=torch.float64)
    for region in _regions({"w": out})["w"]:
        region.view.copy_(full[region.index()])
    return out


def _full() -> torch.Tensor:
    return torch.arange(24, dtype=torch.float64).reshape(6, 4)


def test_region_load_without_torchs_helper_one_process(tmp_path: Path) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if dist.is_initialized():
        pytest.skip("needs a process without a process group")
    dcp.save({"w": _full()}, checkpoint_id=str(tmp_path))
    (with_helper, used_before), (without, used) = (
        _load_blocks(str(tmp_path), False),
        _load_blocks(str(tmp_path), True),
    )
    assert (used_before, used) == (0, 1), (
        "the load did not plan through _compat's fallback without the helper"
    )
    assert torch.equal(with_helper, _expected(_full()))
    assert torch.equal(without, with_helper)


def _two_chunks(directory: str) -> list[Any]:
    """On 2 ranks: save ``_full()`` as two chunks of rows (a DTensor, ``Shard(0)``), load the blocks both ways."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    dcp.save({"w": distribute_tensor(_full(), mesh, [Shard(0)], src_data_rank=None)}, checkpoint_id=directory)
    with_helper, used_before = _load_blocks(directory, False)
    without, used = _load_blocks(directory, True)
    dist.barrier()
    return [
        (used_before, used),
        torch.equal(with_helper, _expected(_full())),
        torch.equal(without, with_helper),
    ]


def test_region_load_without_torchs_helper_two_stored_chunks(tmp_path: Path) -> None:
    assert run_on_ranks(2, _two_chunks, str(tmp_path / "ckpt")) == [[(0, 1), True, True]] * 2
