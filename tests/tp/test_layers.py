"""Column/row parallel linears, the vocab-parallel embedding and loss against unsharded references."""

from __future__ import annotations

import pytest

from tests.support.dist import run_on_ranks
from tests.tp import _bodies as B


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("chunks", [1, 2, 4])
@pytest.mark.parametrize("gather_output", [False, True])
def test_column_parallel_linear(tp: int, chunks: int, gather_output: bool) -> None:
    assert all(run_on_ranks(tp, B.column_body, tp, chunks, gather_output, gather_output))


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("chunks", [1, 2, 4])
@pytest.mark.parametrize("input_is_parallel", [True, False])
def test_row_parallel_linear(tp: int, chunks: int, input_is_parallel: bool) -> None:
    assert all(run_on_ranks(tp, B.row_body, tp, chunks, input_is_parallel, not input_is_parallel))


def test_layers_on_a_subgroup() -> None:
    """TP = 2 inside a world of 4: two independent TP groups."""
    assert all(run_on_ranks(4, B.column_body, 2, 2, False, True))
    assert all(run_on_ranks(4, B.row_body, 2, 2, True, True))


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("chunks", [1, 2])
def test_sequence_parallel_mlp(tp: int, chunks: int) -> None:
    assert all(run_on_ranks(tp, B.mlp_sp_body, tp, chunks))


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("padding_idx", [None, 3])
def test_vocab_parallel_embedding(tp: int, padding_idx: int | None) -> None:
    assert all(run_on_ranks(tp, B.embedding_body, tp, padding_idx))


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize(
    ("smoothing", "reduction"), [(0.0, "mean"), (0.0, "none"), (0.1, "sum"), (0.2, "mean")]
)
def test_vocab_parallel_cross_entropy(tp: int, smoothing: float, reduction: str) -> None:
    assert all(run_on_ranks(tp, B.loss_body, tp, smoothing, reduction))


@pytest.mark.parametrize("tp", [2, 4])
def test_fresh_layers_initialise_like_torch(tp: int) -> None:
    assert all(run_on_ranks(tp, B.init_body, tp))
