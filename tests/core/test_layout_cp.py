"""The cp axis of the parallel layout: rank order, real groups, and cp=1 unchanged."""

from __future__ import annotations

import itertools
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from merak_core.parallel.layout import ParallelLayout
from merak_core.parallel.rank_grid import coords_of, cp_rank_of, rank_of, resolve_degrees
from tests.support.dist import run_on_ranks


def test_resolve_degrees_with_cp() -> None:
    assert resolve_degrees(8, None, 2, 1, cp=2) == (2, 2, 1)
    assert resolve_degrees(4, 1, 1, 1, cp=4) == (1, 1, 1)
    with pytest.raises(ValueError, match=r"dp\*cp\*tp\*pp must equal WORLD_SIZE=4 \(got 2\*2\*2\*1=8\)"):
        resolve_degrees(4, 2, 2, 1, cp=2)
    with pytest.raises(ValueError, match=r"cp\*tp\*pp=3\*1\*1=3 does not divide WORLD_SIZE=8"):
        resolve_degrees(8, None, 1, 1, cp=3)
    with pytest.raises(ValueError, match="cp must be a positive integer"):
        resolve_degrees(8, None, 1, 1, cp=0)


def test_rank_order_tp_innermost_then_cp_then_dp() -> None:
    dp, cp, tp, pp = 2, 2, 2, 2
    seen = []
    for p, d, c, t in itertools.product(range(pp), range(dp), range(cp), range(tp)):
        r = rank_of(p, d, t, dp=dp, tp=tp, cp=cp, cp_rank=c)
        assert coords_of(r, dp=dp, tp=tp, cp=cp) == (p, d, t)
        assert cp_rank_of(r, tp=tp, cp=cp) == c
        seen.append(r)
    assert seen == list(range(16))  # C order over (pp, dp, cp, tp)
    # cp=1 is the 3-D order every earlier layout used.
    for r in range(8):
        assert coords_of(r, dp=2, tp=2, cp=1) == coords_of(r, dp=2, tp=2)
        p, d, t = coords_of(r, dp=2, tp=2)
        assert rank_of(p, d, t, dp=2, tp=2) == (p * 2 + d) * 2 + t


def _gather_ranks(group: dist.ProcessGroup) -> list[int]:
    out = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, torch.tensor([dist.get_rank()]), group=group)
    return [int(x) for x in out]


def _check_cp_layout(dp: int, cp: int, tp: int, pp: int) -> tuple[int, int, int, int, list[int], list[int]]:
    lay = ParallelLayout.build(dp, tp, pp, cp=cp, device="cpu", timeout=timedelta(seconds=60))
    assert lay.world_size == dp * cp * tp * pp and lay.cp == cp
    for axis, group, expected in (
        ("dp", lay.dp_group, lay.dp_ranks),
        ("cp", lay.cp_group, lay.cp_ranks),
        ("tp", lay.tp_group, lay.tp_ranks),
        ("pp", lay.pp_group, lay.pp_ranks),
    ):
        assert group is not None
        assert _gather_ranks(group) == expected, axis
        assert dist.get_process_group_ranks(lay.mesh.get_group(axis)) == expected
    sync = _gather_ranks(lay.grad_sync_group)
    assert sorted(sync) == sorted(r for d in range(lay.dp) for r in _cp_peers(lay, d))
    if cp > 1:
        assert f"cp={cp}" in lay.describe() and f"cp_rank={lay.cp_rank}" in lay.describe()
    return lay.pp_rank, lay.dp_rank, lay.cp_rank, lay.tp_rank, lay.cp_ranks, sync


def _cp_peers(lay: ParallelLayout, dp_rank: int) -> list[int]:
    return [lay.rank_of(pp=lay.pp_rank, dp=dp_rank, tp=lay.tp_rank, cp=c) for c in range(lay.cp)]


@pytest.mark.parametrize(
    ("dp", "cp", "tp", "pp"), [(1, 2, 1, 1), (1, 2, 2, 1), (2, 2, 1, 1), (1, 2, 1, 2), (1, 1, 2, 2)]
)
def test_cp_layout_builds_real_groups(dp: int, cp: int, tp: int, pp: int) -> None:
    world = dp * cp * tp * pp
    results = run_on_ranks(world, _check_cp_layout, dp, cp, tp, pp)
    for rank, (p, d, c, t, cp_ranks, sync) in enumerate(results):
        assert rank == ((p * dp + d) * cp + c) * tp + t
        assert cp_ranks == [((p * dp + d) * cp + x) * tp + t for x in range(cp)]
        assert sorted(sync) == [((p * dp + y) * cp + x) * tp + t for y in range(dp) for x in range(cp)]
