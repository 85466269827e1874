"""Sub-pipelined overlap: the launch/wait/compute order, and exact numbers in every mode."""

from __future__ import annotations

import pytest

from tests.support.dist import run_on_ranks
from tests.tp import _bodies as B


@pytest.mark.parametrize("chunks", [2, 4])
def test_layer_level_overlap_order(chunks: int) -> None:
    events = run_on_ranks(2, B.order_layer_body, 2, chunks)[0]
    assert sum(1 for e in events if e[0] == "launch") == 2 * chunks


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("chunks", [2, 4])
def test_block_level_overlap_order_and_numbers(tp: int, chunks: int) -> None:
    events = run_on_ranks(tp, B.order_block_body, tp, chunks)[0]
    # One forward all-reduce per chunk (row layer) and one backward all-reduce per chunk (region entry):
    # the column layer inside the region does not all-reduce on its own.
    assert sum(1 for e in events if e[:2] == ("launch", "fwd")) == chunks
    assert sum(1 for e in events if e[:2] == ("launch", "bwd")) == chunks


def test_block_that_is_not_column_local_row_falls_back() -> None:
    assert all(run_on_ranks(2, B.fallback_block_body, 2))
