"""Training on text data: a run interrupted by a checkpoint and resumed reads exactly the samples, in the
same order on every rank, as the uninterrupted run (none repeated, none skipped)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from tests.support.dist import run_on_ranks
from tests.support.text import make_tokenizer, sentences, text_model

VOCAB = 300
STEPS = 6


class Recorder(torch.utils.data.Dataset):
    """The samples of ``inner``, noting the id of each one read."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.seen: list[int] = []

    def __len__(self) -> int:
        return len(self.inner)

    @property
    def fingerprint(self) -> str:
        """The text samples' own (else the checkpoint's fingerprint would read samples and note them as seen)."""
        return str(self.inner.fingerprint)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        self.seen.append(self.inner.sample_id(index))
        return self.inner[index]


def _trainer(
    spec_kw: dict[str, Any], output_dir: str, max_steps: int, save_steps: int | None
) -> tuple[Any, Recorder]:
    from merak_core import Trainer, TrainingArguments, init
    from merak_core.data.text import TextDataSpec, build_text_datasets

    train, _ = build_text_datasets(TextDataSpec(**spec_kw))
    data = Recorder(train)
    args = TrainingArguments(
        dp=2,
        tp=1,
        pp=1,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=max_steps,
        save_steps=save_steps,
        output_dir=output_dir,
        logging_steps=100,
        learning_rate=1e-3,
        seed=3,
    )
    model = text_model(VOCAB, dtype="float32")
    trainer = Trainer(model, args, data, layout=init(dp=2, tp=1, pp=1))
    data.seen.clear()  # the trainer read a first microbatch to trace the model
    return trainer, data


def _run(spec_kw: dict[str, Any], output_dir: str, interrupt_at: int | None) -> list[int]:
    """This rank's sample ids over ``STEPS`` steps, in a run interrupted after ``interrupt_at`` or not."""
    if interrupt_at is None:
        trainer, data = _trainer(spec_kw, output_dir, STEPS, None)
        history = trainer.train()
        assert all(r["grad_norm"] > 0 for r in history)  # the engine's norm, before clipping, in every record
        return data.seen
    first, data = _trainer(spec_kw, output_dir, interrupt_at, interrupt_at)
    first.train()  # saves its last step
    seen = list(data.seen)
    second, data = _trainer(spec_kw, output_dir, STEPS, interrupt_at)
    assert second.resume("latest") == interrupt_at
    second.train()
    return seen + data.seen


def test_resume_from_the_middle_of_the_text_neither_repeats_nor_skips(tmp_path: Path) -> None:
    tok = make_tokenizer(tmp_path / "tok", vocab_size=VOCAB)
    (tmp_path / "corpus.txt").write_text("\n".join(sentences(120, seed=21)))
    spec_kw = {
        "format": "text",
        "path": str(tmp_path / "corpus.txt"),
        "tokenizer": str(tok),
        "seq_len": 8,
        "cache_dir": str(tmp_path / "cache"),
    }
    whole = run_on_ranks(2, _run, spec_kw, tempfile.mkdtemp(dir=tmp_path), None)
    resumed = run_on_ranks(2, _run, spec_kw, tempfile.mkdtemp(dir=tmp_path), 2)
    assert resumed == whole
    per_step = 2 * 2  # microbatch x microbatches per DP rank
    assert all(len(ids) == STEPS * per_step for ids in whole)
    assert not set(whole[0]) & set(whole[1])  # the DP ranks' shards are disjoint
    assert len(set(whole[0]) | set(whole[1])) == 2 * STEPS * per_step  # and nothing repeats within the epoch
