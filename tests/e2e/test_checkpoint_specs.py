"""Pure tests (no processes) of how checkpoints map a TP shard to its full logical tensor.

The convention is merak-tp's ``ShardSpec`` (dim, sections, transposed):
the shard a rank holds must be exactly what ``merak_tp`` would cut from the full tensor, for
plain, fused (sections) and transposed (transformers ``Conv1D``) weights, from an in-memory
tensor and from a safetensors slice.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from merak_core.checkpoint import _Spec
from merak_core.checkpoint.regions import copy_regions_, local_regions
from merak_tp._tp_module import _shard
from merak_tp.shard_spec import ShardSpec, set_shard_spec


def _param(local: torch.Tensor, dim: int | None, sections: int = 1, transposed: bool = False) -> nn.Parameter:
    p = nn.Parameter(local.clone())
    set_shard_spec(p, ShardSpec(dim, sections, transposed))
    return p


CASES = [  # (full shape in the checkpoint, tp dim of the local param, sections, transposed)
    ((12, 4), 0, 1, False),  # column weight
    ((4, 12), 1, 1, False),  # row weight
    ((12,), 0, 1, False),  # column bias
    ((12, 4), 0, 3, False),  # fused q/k/v (GPT-2 c_attn after slicing), sections
    ((4, 12), 0, 3, True),  # the same, stored (in, out) by Conv1D: transposed
    ((12, 4), 1, 1, True),  # Conv1D row weight (c_proj): transposed
    ((12, 4), None, 1, False),  # replicated
]


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("tp", [2, 4])
def test_spec_slices_like_merak_tp(case: tuple, tp: int) -> None:
    full_shape, dim, sections, transposed = case
    full = torch.arange(torch.Size(full_shape).numel(), dtype=torch.float64).reshape(full_shape)
    layer_full = full.t() if transposed else full  # the layer's own (out, in) orientation
    for rank in range(tp):
        local = layer_full if dim is None else _shard(layer_full, dim, tp, rank, sections)
        spec = _Spec(_param(local, dim, sections, transposed), tp, rank)
        assert spec.full_shape == full_shape
        assert torch.equal(spec.slice_full(full), local)
        assert spec.whole == (dim is None or sections > 1)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_safetensors_slice_reads_only_the_shard(tmp_path: Path, case: tuple) -> None:
    safetensors = pytest.importorskip("safetensors")
    from safetensors.torch import save_file

    full_shape, dim, sections, transposed = case
    full = torch.randn(full_shape, dtype=torch.float64)
    save_file({"w": full}, str(tmp_path / "w.safetensors"))
    layer_full = full.t() if transposed else full
    with safetensors.safe_open(str(tmp_path / "w.safetensors"), framework="pt") as handle:
        entry = handle.get_slice("w")
        for rank in range(2):
            local = layer_full if dim is None else _shard(layer_full, dim, 2, rank, sections)
            param = _param(torch.zeros_like(local), dim, sections, transposed)
            spec = _Spec(param, 2, rank)
            regions = local_regions(param, spec)
            copied = copy_regions_(regions, entry.__getitem__)  # only these slices are read
            assert torch.equal(param.detach(), local)
            assert copied == local.numel() * local.element_size()
