"""Greedy generation at tp=2 x pp=2 (Mixtral: tp=2 and pp=2 too) for the transformers families whose pipeline stages decoding rebuilds
(``merak_core.generation.decoders.FAMILIES`` beyond GPT-2 and Llama, which ``test_generation.py`` covers
at every layout): Mistral (sliding window), Qwen2, Qwen3 (per-head norms) and Gemma (embedding scale, float32 norms); and Mixtral (mixture of experts). Each tiny random float64 model (``tests/tp/_hf_families.py``)
is saved with ``save_pretrained``; Merak starts from the folder on 4 ranks and must give exactly the
tokens of transformers' ``generate(do_sample=False)`` on the same left-padded prompts, an EOS ending one
row early."""

from __future__ import annotations

import tempfile

import pytest

from tests.e2e._trainer_support import make_args
from tests.e2e.test_generation import NEW, PAD, _eos_ending_one_row, _hf_greedy, _prompts, _reference
from tests.e2e.test_pretrained_families import Batches, lm_loss, save_family
from tests.support.dist import run_on_ranks

pytestmark = pytest.mark.transformers


def greedy_on_ranks(name: str, folder: str, eos: int, tp: int, pp: int) -> list[list[int]]:
    from merak_core import Trainer

    args = make_args(
        dp=1, tp=tp, pp=pp, gradient_accumulation_steps=2, output_dir=tempfile.mkdtemp(prefix="merak-gen-")
    )
    trainer = Trainer(None, args, Batches(name), loss_fn=lm_loss, pretrained=folder)
    ids, mask = _prompts()
    return trainer.generate(ids, mask, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=PAD).tolist()


CASES = [
    ("mistral", 2, 2),
    ("qwen2", 2, 2),
    ("qwen2", 2, 1),
    ("qwen2", 1, 2),
    ("qwen3", 2, 2),
    ("gemma", 2, 2),
    ("gemma", 2, 1),
    ("gemma", 1, 2),
    ("mixtral", 2, 1),
    ("mixtral", 2, 2),
    ("mixtral", 1, 2),
]
"""(family, tp, pp): Qwen2, Gemma and Mixtral at tp2 and pp2 alone too (pp=1 decodes with the TP-sharded model
itself, pp > 1 with the rebuilt stages); Mixtral (experts sharded, the cache sharded like its kv heads); under the
pipeline its fused experts are trace leaves (merak_core.parallel.expert_hf.fused_expert_leaves)."""


@pytest.mark.parametrize(("name", "tp", "pp"), CASES, ids=[f"{n}-tp{t}pp{p}" for n, t, p in CASES])
def test_family_generation_equals_transformers(name: str, tp: int, pp: int) -> None:
    folder = save_family(name)
    model = _reference(folder)
    eos = _eos_ending_one_row(model)
    expected = _hf_greedy(model, eos).tolist()
    for rank, got in enumerate(run_on_ranks(tp * pp, greedy_on_ranks, name, str(folder), eos, tp, pp)):
        assert got == expected, f"rank {rank}"
