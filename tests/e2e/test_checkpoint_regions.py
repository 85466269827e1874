"""Where a rank's elements sit in the full tensor (``merak_core.checkpoint.regions``), and that loads read
exactly them ([Note: bounded checkpoint loads]).

For every shard convention of ``test_checkpoint_specs`` (plain, fused sections, transposed ``Conv1D``,
replicated) at tp=2 and tp=4, on two ranks whose TP shard is further sharded over DP as ZeRO-2/3 does
(FSDP2: a DTensor over a 2-rank mesh, ``Shard(0)``, rows split unevenly where they do not divide): the
regions filled from the full tensor give exactly the rank's local elements, and DCP reading a saved full
tensor through :class:`RegionLoadPlanner` (several sections of one stored item read once) gives the same.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_checkpoint_specs import CASES
from tests.support.dist import run_on_ranks

UNEVEN = [((5, 4), None, 1, False), ((6, 3), 0, 3, False), ((3, 6), 0, 3, True)]
"""Rows that do not split evenly over dp=2 (FSDP2's uneven shards), with and without sections."""


def _local_tensors(case: tuple, tp: int, tp_rank: int, full: Any, sharded: bool) -> tuple[Any, Any, Any]:
    """(the parameter as the rank holds it, an empty tensor held like it, the expected local elements)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from merak_tp._tp_module import _shard
    from merak_tp.shard_spec import ShardSpec, set_shard_spec

    _, dim, sections, transposed = case
    layer_full = full.t() if transposed else full
    local = layer_full.clone() if dim is None else _shard(layer_full, dim, tp, tp_rank, sections).clone()
    if sharded:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        param = distribute_tensor(local, mesh, [Shard(0)], src_data_rank=None)
        empty = distribute_tensor(torch.full_like(local, -1.0), mesh, [Shard(0)], src_data_rank=None)
        expected = param.to_local().clone()
    else:
        param, empty, expected = local, torch.full_like(local, -1.0), local
    for t in (param, empty):
        set_shard_spec(t, ShardSpec(dim, sections, transposed))
    return param, empty, expected


def _check_case(case: tuple, tp: int, sharded: bool, directory: str) -> list[str]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from merak_core.checkpoint.regions import RegionLoadPlanner, copy_regions_, local_regions
    from merak_core.checkpoint.specs import TensorSpec
    from merak_core.parallel.fsdp import local_tensor

    full_shape = case[0]
    full = torch.arange(torch.Size(full_shape).numel(), dtype=torch.float64).reshape(full_shape)
    dcp.save({"w": full}, checkpoint_id=directory)
    wrong = []
    for tp_rank in range(tp):
        param, empty, expected = _local_tensors(case, tp, tp_rank, full, sharded)
        spec = TensorSpec(param, tp, tp_rank)
        assert spec.full_shape == tuple(full_shape)
        target = local_tensor(empty)
        copy_regions_(local_regions(empty, spec), full.__getitem__)
        if not torch.equal(target, expected):
            wrong.append(f"{case} tp_rank {tp_rank} from the full tensor: {target} != {expected}")
        target.fill_(-1.0)
        dcp.load({}, checkpoint_id=directory, planner=RegionLoadPlanner({"w": local_regions(empty, spec)}))
        if not torch.equal(target, expected):
            wrong.append(f"{case} tp_rank {tp_rank} through DCP: {target} != {expected}")
    dist.barrier()
    return wrong


def _offsets_without_the_hook(shapes: list[tuple[int, ...]]) -> list[str]:
    """dtensor_offsets from the public placements (DCP's hook removed) against the hook's, every shape."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from merak_core.parallel._compat import dtensor_offsets

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    wrong = []
    hook = DTensor.__create_chunk_list__
    for shape in shapes:
        for dim in range(len(shape)):
            t = distribute_tensor(torch.zeros(shape), mesh, [Shard(dim)], src_data_rank=None)
            want = dtensor_offsets(t)
            del DTensor.__create_chunk_list__  # a torch without DCP's hook
            try:
                got = dtensor_offsets(t)
            finally:
                DTensor.__create_chunk_list__ = hook  # type: ignore[method-assign]
            if got != want:
                wrong.append(f"{shape} Shard({dim}): {got} != {want}")
    return wrong


def test_dtensor_offsets_without_dcps_hook() -> None:
    """A ZeRO-2/3 shard's place in its tensor without torch's private hook (issue 25 item 2)."""
    shapes = [(5, 4), (6, 3), (1, 3), (3,), (0, 2), (7, 1, 3)]
    for world in (2, 3):
        assert run_on_ranks(world, _offsets_without_the_hook, shapes) == [[]] * world


@pytest.mark.parametrize("sharded", [False, True], ids=["tp", "tp_zero3"])
def test_regions_hold_exactly_the_local_elements(tmp_path: Path, sharded: bool) -> None:
    cases = list(itertools.product(CASES, [2, 4])) + [(case, 2) for case in UNEVEN if sharded]
    for i, (case, tp) in enumerate(cases):
        results = run_on_ranks(2, _check_case, case, tp, sharded, str(tmp_path / f"c{i}"))
        assert results == [[], []], results
