"""What merak-tp makes of a module is its ``ModuleSpec``: nothing is written into the user's modules."""

from __future__ import annotations

import copy

import torch
from torch import nn

import merak_tp
from tests.support.compare import assert_tensors_close
from tests.support.dist import run_on_ranks
from tests.support.models import REFERENCE_MODELS
from tests.tp._bodies import BUILDERS, tp_group


def loose_attributes(model: nn.Module) -> list[str]:
    """``module: attribute`` for every ``_merak_*`` name in a module's ``__dict__`` or its class's."""
    found = []
    for name, module in model.named_modules():
        for where in (vars(module), vars(type(module))):
            found += [f"{name or '<root>'}: {key}" for key in where if key.startswith("_merak_")]
    return found


def _check_specs(model: nn.Module) -> tuple[int, int]:
    """Every region's layers run in its state; boundaries carry the group and dim. (regions, boundaries)."""
    regions = boundaries = 0
    for name, module in model.named_modules():
        spec = merak_tp.get_module_spec(module)
        if isinstance(module, merak_tp.TPRegion):
            assert spec.region is not None and spec.region.name == name, (name, spec)
            layers = [
                m
                for m in module.modules()
                if isinstance(m, (merak_tp.ColumnParallelLinear, merak_tp.RowParallelLinear))
            ]
            assert layers and all(m._region is spec.region for m in layers), name
            regions += 1
        if isinstance(module, (merak_tp.SequenceScatter, merak_tp.SequenceGather)):
            kind = "scatter" if isinstance(module, merak_tp.SequenceScatter) else "gather"
            assert (
                spec.sequence is not None and spec.sequence.kind == kind and spec.sequence.sequence_dim == 1
            )
            boundaries += 1
        if not isinstance(module, (merak_tp.TPRegion, merak_tp.SequenceScatter, merak_tp.SequenceGather)):
            assert spec.empty, (name, spec)
    return regions, boundaries


def sequence_parallel_body(tp: int) -> tuple[list[str], list[str], int, int]:
    """parallelize at ``tp`` with sequence parallelism and overlap; two steps (the probe, then chunked)."""
    group = tp_group(tp)
    torch.manual_seed(0)
    model = merak_tp.parallelize(
        BUILDERS["gpt"]().double(), group=group, overlap_chunks=2, sequence_parallel=True
    )
    (ids,) = REFERENCE_MODELS["gpt"].make_inputs(4, 8, 3)
    for _ in range(2):
        out = model(ids)
        out.sum().backward()
    regions, boundaries = _check_specs(model)
    twin = copy.deepcopy(model)
    _check_specs(twin)
    assert_tensors_close(twin(ids), model(ids).detach(), name="deep copy output")
    after = loose_attributes(model)
    for region in [m for m in model.modules() if isinstance(m, merak_tp.TPRegion)]:
        merak_tp.remove_region(region)
        assert not isinstance(region, merak_tp.TPRegion) and merak_tp.get_module_spec(region).empty
        assert all(
            m._region is None
            for m in region.modules()
            if isinstance(m, (merak_tp.ColumnParallelLinear, merak_tp.RowParallelLinear))
        )
    return after, loose_attributes(twin), regions, boundaries


def test_no_merak_attribute_on_modules_at_tp2_with_sequence_parallelism() -> None:
    after, twin, regions, boundaries = run_on_ranks(2, sequence_parallel_body, 2)[0]
    assert after == [] and twin == [], (after, twin)
    assert regions >= 4 and boundaries >= 1, (regions, boundaries)  # two blocks: attention and MLP each
