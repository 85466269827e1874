"""Text and tokenizers made in the test (no downloads): a byte-level BPE trained on a few sentences."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.support.models import GPT, DecoderConfig

EOS = "<|endoftext|>"

WORDS = (
    "the quick brown fox jumps over lazy dog merak trains models with pipeline tensor data parallel "
    "stages ranks tokens loss step eval checkpoint resume"
).split()


def sentences(count: int, *, seed: int = 0, words: int = 7) -> list[str]:
    """``count`` deterministic pseudo-random sentences over a small vocabulary."""
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, words))) for _ in range(count)]


def make_tokenizer(
    folder: Path, *, vocab_size: int = 300, corpus: list[str] | None = None, eos: bool = True
) -> Path:
    """A byte-level BPE tokenizer in ``folder`` (``tokenizer.json``, and ``tokenizer_config.json`` naming
    the end-of-sequence token when ``eos``); returns the folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus if corpus is not None else sentences(200, seed=123), trainer=trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    if eos:
        (folder / "tokenizer_config.json").write_text(
            json.dumps({"eos_token": EOS, "model_max_length": 1024})
        )
    return folder


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


class TextGPT(GPT):
    """The reference GPT taking the text datasets' ``input_ids`` keyword."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(input_ids)


def text_model(
    vocab_size: int = 300, hidden_size: int = 16, num_layers: int = 2, seed: int = 0, dtype: str = "float64"
) -> TextGPT:
    """A tiny GPT (tests.support.models) that takes the text datasets' ``input_ids`` keyword."""
    torch.manual_seed(seed)
    cfg = DecoderConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=2,
        num_kv_heads=2,
        intermediate_size=2 * hidden_size,
        max_seq_len=64,
    )
    return TextGPT(cfg).to(getattr(torch, dtype))


def token_metrics(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per sample (a job's ``metrics``): the share of its counted labels (not -100) that the argmax predicts,
    and the mean logit of the label tokens (a value that a random model makes informative too)."""
    counted = labels != -100
    per_sample = counted.sum(-1).clamp(min=1).double()
    right = (logits.argmax(-1) == labels) & counted
    label_logit = logits.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1).double() * counted
    return {
        "token_accuracy": right.sum(-1).double() / per_sample,
        "label_logit": label_logit.sum(-1) / per_sample,
    }
