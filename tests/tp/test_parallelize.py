"""``parallelize`` on every reference model: outputs, loss and all gradients equal the unsharded model."""

from __future__ import annotations

import pytest

from tests.support.dist import run_on_ranks
from tests.tp import _bodies as B


@pytest.mark.parametrize("name", ["gpt", "llama", "bert"])
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_parallelize_reference_models(name: str, tp: int, chunks: int) -> None:
    regions = run_on_ranks(tp, B.parallelize_body, name, tp, chunks, False, False)[0]
    if chunks == 1:
        assert regions == {}
    else:
        # Every attention / MLP block of the reference models really ran sub-pipelined.
        assert regions and all(regions.values()), regions


@pytest.mark.parametrize("name", ["gpt", "llama", "bert"])
@pytest.mark.parametrize("tp", [2, 4])
def test_parallelize_vocab_parallel_loss(name: str, tp: int) -> None:
    run_on_ranks(tp, B.parallelize_body, name, tp, 2, False, True)


@pytest.mark.parametrize("name", ["gpt", "llama", "bert"])
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("chunks", [1, 2])
def test_parallelize_sequence_parallel(name: str, tp: int, chunks: int) -> None:
    regions = run_on_ranks(tp, B.parallelize_body, name, tp, chunks, True, chunks == 2)[0]
    assert regions, "sequence parallelism makes the plan's regions TP regions"
    if chunks > 1 and name != "bert":
        # Sub-pipelined together with sequence parallelism (BERT's attention ends in o_proj too).
        assert all(regions.values()), regions


@pytest.mark.parametrize("name", ["llama", "bert"])
def test_parallelize_uneven_chunks(name: str) -> None:
    """A batch of 5 in 4 chunks (sizes 2, 2, 1): the attention mask is split like the input."""
    regions = run_on_ranks(2, B.parallelize_body, name, 2, 4, False, False, True, 5)[0]
    assert regions and all(regions.values()), regions


def test_parallelize_on_a_subgroup() -> None:
    run_on_ranks(4, B.parallelize_body, "llama", 2, 2, False, False)


@pytest.mark.parametrize("tp", [2, 4])
def test_parallelize_meta_model(tp: int) -> None:
    assert all(run_on_ranks(tp, B.meta_body, tp))
