"""``parallelize`` on tiny transformers GPT-2, Llama, Qwen2 and BERT (the ``transformers`` nox session)."""

from __future__ import annotations

import pytest

from tests.support.dist import run_on_ranks

pytest.importorskip("transformers")

from tests.tp import _hf_bodies as H  # noqa: E402

pytestmark = pytest.mark.transformers


@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen2", "bert"])
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_parallelize_transformers_models(name: str, tp: int, chunks: int) -> None:
    regions = run_on_ranks(tp, H.hf_body, name, tp, chunks, False, False)[0]
    if chunks > 1 and name != "bert":
        # Attention and MLP blocks really ran sub-pipelined (BERT's blocks end in LayerNorm: layer level).
        assert regions and all(regions.values()), regions


@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen2", "bert"])
def test_transformers_vocab_parallel_loss_and_sequence_parallel(name: str) -> None:
    run_on_ranks(2, H.hf_body, name, 2, 2, False, True)
    run_on_ranks(2, H.hf_body, name, 2, 1, True, False)
