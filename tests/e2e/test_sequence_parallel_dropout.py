"""Sequence parallelism refuses dropout on sequence-sharded activations (before any process group).

Under sequence parallelism the activations between the TP regions are split along the sequence,
one block per TP rank, but dropout there draws from the generator every TP rank shares: each
block would get the same mask. The check runs on the model alone (meta device here).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from merak_core.checks.tp_check import check_sequence_parallel  # noqa: E402
from tests.support.hf_models import tiny_gpt2_config  # noqa: E402


def _gpt2(dropout: float) -> torch.nn.Module:
    config = tiny_gpt2_config(
        64, n_embd=16, n_head=2, n_positions=16, resid_pdrop=dropout, embd_pdrop=dropout
    )
    with torch.device("meta"):
        return transformers.GPT2LMHeadModel(config)


def test_residual_dropout_under_sequence_parallelism_is_refused_with_the_modules_and_the_fix() -> None:
    with pytest.raises(ValueError) as info:
        check_sequence_parallel(_gpt2(0.1), None)
    text = str(info.value)
    assert text.startswith(
        "training.sequence_parallel=true with dropout on sequence-sharded activations ('transformer.drop'"
    )
    assert "every TP rank would draw the same mask" in text
    assert "training.sequence_parallel: false" in text


def test_without_dropout_sequence_parallelism_is_allowed() -> None:
    check_sequence_parallel(_gpt2(0.0), None)  # no error: the plan supports it and nothing drops
