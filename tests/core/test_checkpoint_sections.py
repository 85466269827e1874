"""A fused parameter with sections of unequal sizes (grouped-query q/k/v) read back from a full tensor.

A checkpoint stores a fused column weight whole; on load each TP rank takes its block of every
section. With unequal sections (``[heads*d, kv_heads*d, kv_heads*d]``) an equal split of the fused
dim would hand rank 0 all of q and rank 1 k and v. No processes: the spec alone.
"""

from __future__ import annotations

import pytest
import torch

from merak_core.checkpoint.specs import TensorSpec
from merak_tp.shard_spec import ShardSpec, set_shard_spec

SECTIONS = (8, 4, 4)  # q, k, v rows of a grouped-query projection


def _local(full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """What the TP layer holds: each section's ``rank``-th block."""
    rows = full.split(list(SECTIONS), dim=0)
    return torch.cat([r.chunk(tp, dim=0)[rank] for r in rows], dim=0)


@pytest.mark.parametrize("rank", [0, 1])
def test_unequal_sections_load_each_ranks_block_of_every_section(rank: int) -> None:
    tp = 2
    full = torch.arange(16 * 3, dtype=torch.float64).reshape(16, 3)  # (out, in): rows = fused outputs
    expected = _local(full, rank, tp)
    param = torch.nn.Parameter(torch.empty_like(expected))
    set_shard_spec(param, ShardSpec(dim=0, sections=SECTIONS))
    spec = TensorSpec(param, tp, rank)
    assert spec.full_shape == (16, 3) and spec.sections == 3
    got = spec.slice_full(full)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # Rank 0 holds q[0:4], k[8:10], v[12:14]: never the whole of q.
    first_rows = got[:, 0] // 3
    assert first_rows.tolist() == ([0, 1, 2, 3, 8, 9, 12, 13] if rank == 0 else [4, 5, 6, 7, 10, 11, 14, 15])
