"""ParallelLayout / init: degree validation, rank<->coordinate maps, and the real groups.

Multi-rank tests build every (dp, tp, pp) factorisation of the pool's world size
and check, by actually communicating, that each group holds exactly the ranks the
documented rank order says: an all-gather of global ranks over dp/tp/pp groups is
compared with the pure coordinate map.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from merak_core.parallel.layout import ParallelLayout, init
from merak_core.parallel.rank_grid import coords_of, rank_of, resolve_degrees
from tests.support.dist import run_on_ranks

ROOT = Path(__file__).resolve().parents[2]


def _factorisations(world: int) -> list[tuple[int, int, int]]:
    return [
        (d, t, world // (d * t))
        for d in range(1, world + 1)
        for t in range(1, world + 1)
        if world % (d * t) == 0
    ]


# ---------------------------------------------------------------------------- pure


def test_resolve_degrees_infers_dp() -> None:
    assert resolve_degrees(8, None, 2, 2) == (2, 2, 2)
    assert resolve_degrees(8, None, 1, 1) == (8, 1, 1)
    assert resolve_degrees(6, 3, 2, 1) == (3, 2, 1)


def test_resolve_degrees_error_shows_every_factor() -> None:
    with pytest.raises(ValueError, match=r"dp\*tp\*pp must equal WORLD_SIZE=8 \(got 2\*2\*3=12\)"):
        resolve_degrees(8, 2, 2, 3)
    with pytest.raises(ValueError, match=r"tp\*pp=3\*1=3 does not divide WORLD_SIZE=8"):
        resolve_degrees(8, None, 3, 1)
    with pytest.raises(ValueError, match="tp must be a positive integer"):
        resolve_degrees(8, None, 0, 1)
    with pytest.raises(ValueError, match="dp must be a positive integer"):
        resolve_degrees(8, -2, 1, 1)


@pytest.mark.parametrize("world", [1, 2, 4, 6, 8, 12])
def test_rank_coordinate_round_trip(world: int) -> None:
    for dp, tp, pp in _factorisations(world):
        seen = set()
        for rank in range(world):
            p, d, t = coords_of(rank, dp=dp, tp=tp)
            assert 0 <= p < pp and 0 <= d < dp and 0 <= t < tp
            assert rank_of(p, d, t, dp=dp, tp=tp) == rank
            seen.add((p, d, t))
        assert len(seen) == world
        if tp > 1:  # TP is the fastest-varying axis: r and r+1 are TP peers
            assert coords_of(1, dp=dp, tp=tp) == (0, 0, 1)
        if pp > 1:  # PP is the outermost axis
            assert coords_of(world - 1, dp=dp, tp=tp)[0] == pp - 1
            assert coords_of(world // pp, dp=dp, tp=tp) == (1, 0, 0)


def test_init_validates_before_any_collective(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not dist.is_initialized()
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(ValueError, match=r"WORLD_SIZE=8 \(got 2\*2\*3=12\)"):
        init(dp=2, tp=2, pp=3)
    assert not dist.is_initialized()


def test_init_single_process_without_launcher() -> None:
    code = (
        "import torch.distributed as dist\n"
        "from merak_core.parallel.layout import init\n"
        "lay = init(device='cpu')\n"
        "assert (lay.dp, lay.tp, lay.pp, lay.rank) == (1, 1, 1, 0), lay\n"
        "assert lay.is_first_stage and lay.is_last_stage\n"
        "assert lay.mesh.mesh_dim_names == ('pp', 'dp', 'cp', 'tp')\n"
        "print('OK', dist.get_backend())\n"
    )
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
    }
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "packages/merak-core/src"), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "OK gloo"


# ---------------------------------------------------------------------------- multi-rank


def _check_all_layouts(world: int) -> list[tuple[int, int, int, int]]:
    rank = dist.get_rank()
    results = []
    for dp, tp, pp in _factorisations(world):
        lay = ParallelLayout.build(dp, tp, pp, device="cpu", timeout=timedelta(seconds=60))
        assert (lay.dp, lay.tp, lay.pp, lay.world_size, lay.rank) == (dp, tp, pp, world, rank)
        assert lay.coords_of(rank) == (lay.pp_rank, lay.dp_rank, lay.tp_rank)
        assert lay.rank_of(pp=lay.pp_rank, dp=lay.dp_rank, tp=lay.tp_rank) == rank
        assert lay.is_first_stage == (lay.pp_rank == 0) and lay.is_last_stage == (lay.pp_rank == pp - 1)
        for axis, group, expected in (
            ("dp", lay.dp_group, lay.dp_ranks),
            ("tp", lay.tp_group, lay.tp_ranks),
            ("pp", lay.pp_group, lay.pp_ranks),
        ):
            # Communicate for real: who is in my group, in group-rank order?
            out = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size(group))]
            dist.all_gather(out, torch.tensor([rank]), group=group)
            got = [int(t) for t in out]
            assert got == expected, (axis, got, expected)
            assert dist.get_process_group_ranks(lay.mesh.get_group(axis)) == expected
            assert lay.mesh[axis].size() == len(expected)
        assert lay.pp_ranks[lay.pp_rank] == rank
        assert lay.stage_rank(pp - 1) == lay.rank_of(pp=pp - 1, dp=lay.dp_rank, tp=lay.tp_rank)
        again = ParallelLayout.from_groups(
            dp_group=lay.dp_group, tp_group=lay.tp_group, pp_group=lay.pp_group, device="cpu"
        )
        assert (again.pp_rank, again.dp_rank, again.tp_rank) == (lay.pp_rank, lay.dp_rank, lay.tp_rank)
        results.append((dp, tp, pp, lay.pp_rank * 100 + lay.dp_rank * 10 + lay.tp_rank))
    # init() over the existing default group builds the same layout and still validates.
    lay = init(None, 1, world, device="cpu")
    assert (lay.dp, lay.pp, lay.pp_rank) == (1, world, rank)
    try:
        init(dp=world, tp=2, pp=1)
    except ValueError as err:
        assert f"WORLD_SIZE={world} (got {world}*2*1={2 * world})" in str(err)
    else:
        raise AssertionError("init accepted a layout larger than the world")
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_layouts_build_real_groups(world: int) -> None:
    results = run_on_ranks(world, _check_all_layouts, world)
    for rank, per_layout in enumerate(results):
        for dp, tp, _pp, code in per_layout:
            p, d, t = coords_of(rank, dp=dp, tp=tp)
            assert code == p * 100 + d * 10 + t


@pytest.mark.world8
def test_layout_2x2x2_world8() -> None:
    results = run_on_ranks(8, _check_2x2x2)
    assert [r for r in results] == [
        (
            coords_of(rank, dp=2, tp=2),
            tuple(sorted({rank ^ 1, rank})),
        )
        for rank in range(8)
    ]


def _check_2x2x2() -> tuple[tuple[int, int, int], tuple[int, ...]]:
    lay = ParallelLayout.build(2, 2, 2, device="cpu")
    # TP peers are neighbours (r, r^1); DP peers are 2 apart; PP peers are 4 apart.
    assert lay.dp_ranks == sorted({lay.rank, lay.rank ^ 2})
    assert lay.pp_ranks == sorted({lay.rank, lay.rank ^ 4})
    x = torch.tensor([float(lay.rank)])
    dist.all_reduce(x, group=lay.tp_group)
    assert x.item() == sum(lay.tp_ranks)
    return (lay.pp_rank, lay.dp_rank, lay.tp_rank), tuple(lay.tp_ranks)


_TORCHRUN_SCRIPT = """
import sys
import torch
import torch.distributed as dist
from merak_core.parallel.layout import init

dp, tp = (None if sys.argv[1] == "none" else int(sys.argv[1])), int(sys.argv[2])
lay = init(dp, tp, 1, device="cpu")
x = torch.tensor([float(lay.rank + 1)])
dist.all_reduce(x, group=lay.tp_group)
print(f"RESULT rank={lay.rank} dp={lay.dp} tp={lay.tp} tp_rank={lay.tp_rank} sum={x.item()} "
      f"backend={dist.get_backend()} timeout={lay.timeout.total_seconds():.0f}", flush=True)
dist.destroy_process_group()
"""


def _torchrun(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "job.py"
    script.write_text(_TORCHRUN_SCRIPT)
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
    }
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "packages/merak-core/src"), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(script),
        *args,
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    if out.returncode != 0 and "address already in use" in out.stderr.lower():
        # torchrun picks a free port, closes it and lets the workers bind it later: another job on a
        # busy machine can take it in between. That race is torchrun's, not ours: try once more.
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    return out


@pytest.mark.slow
def test_init_under_torchrun(tmp_path: Path) -> None:
    out = _torchrun(tmp_path, "none", "2")
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-4000:])
    # Two ranks share one stdout pipe: a line of one may land in the middle of the other's.
    lines = sorted(
        re.findall(
            r"RESULT rank=\d+ dp=\d+ tp=\d+ tp_rank=\d+ sum=[\d.]+ backend=\w+ timeout=\d+", out.stdout
        )
    )
    assert lines == [
        "RESULT rank=0 dp=1 tp=2 tp_rank=0 sum=3.0 backend=gloo timeout=600",
        "RESULT rank=1 dp=1 tp=2 tp_rank=1 sum=3.0 backend=gloo timeout=600",
    ]
