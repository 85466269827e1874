"""A token id or label out of range after the first batch is named with the step, the sample and the value.

The launch checks see the first batch only; later batches are checked on the loader's side (CPU)
before they reach the model (:mod:`merak_core.data.batch_ids`). Pure tests of the check over a sharded,
shuffled loader, and one Trainer run (one rank) whose bad sample arrives at step 3: before the check
it failed inside the embedding with ``IndexError: index out of range in self``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

from merak_core.data.batch_ids import IdRanges, sample_namer
from merak_core.data.loader import StageAwareDataLoader
from tests.support.dist import run_on_ranks

VOCAB, SEQ, SIZE, SEED = 16, 6, 16, 42


class Ids(Dataset):
    """``SIZE`` token sequences; sample ``bad`` holds ``value`` in its input ids (or its labels)."""

    def __init__(self, bad: int | None = None, value: int = VOCAB, in_labels: bool = False) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (SIZE, SEQ + 1), generator=g)
        self.bad, self.value, self.in_labels = bad, value, in_labels

    def __len__(self) -> int:
        return SIZE

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids, labels = self.ids[i, :-1].clone(), self.ids[i, 1:].clone()
        labels[0] = -100  # ignored positions are fine
        if i == self.bad:
            (labels if self.in_labels else ids)[2] = self.value
        return {"input_ids": ids, "labels": labels}


def _loader(dataset: Dataset, dp_rank: int) -> StageAwareDataLoader:
    return StageAwareDataLoader(dataset, batch_size=2, dp_rank=dp_rank, dp_size=2, shuffle=True, seed=SEED)


def _first_error(loader: StageAwareDataLoader, ranges: IdRanges) -> str | None:
    for step, batch in enumerate(loader, 1):
        inputs, labels = batch.inputs, batch.labels
        try:
            ranges.check(inputs, labels, step, sample_namer(loader))
        except ValueError as exc:
            return str(exc)
    return None


@pytest.mark.parametrize(("value", "in_labels"), [(VOCAB, False), (-1, False), (VOCAB + 3, True)])
def test_the_rank_holding_the_bad_sample_names_step_sample_and_value(value: int, in_labels: bool) -> None:
    perm = torch.randperm(SIZE, generator=torch.Generator().manual_seed(SEED))
    position = 2 * 4 + 2 + 1  # step 3 (global batch 4), DP rank 1, its second row
    bad = int(perm[position])
    ranges = IdRanges(vocab=VOCAB, classes=VOCAB)
    assert _first_error(_loader(Ids(bad, value, in_labels), 0), ranges) is None  # rank 0 never reads it
    message = _first_error(_loader(Ids(bad, value, in_labels), 1), ranges)
    what = f"labels hold class id {value}" if in_labels else f"input_ids hold token id {value}"
    assert message is not None and message.startswith(
        f"step 3: {what} (sample {bad} of the training set, epoch 0)"
    )
    assert ("-100 to ignore" if in_labels else f"vocabulary of {VOCAB}") in message


def test_good_batches_pass_and_unknown_sizes_check_nothing() -> None:
    assert _first_error(_loader(Ids(), 1), IdRanges(vocab=VOCAB, classes=VOCAB)) is None
    assert _first_error(_loader(Ids(3, 99), 1), IdRanges(vocab=None, classes=None)) is None


def trainer_body(out: str, bad: int) -> tuple[str, str] | None:
    from merak_core import Trainer, TrainingArguments
    from tests.e2e._bad_input_jobs import build_lm

    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=2, max_steps=6, dp=1, seed=SEED, logging_steps=1
    )
    try:
        Trainer(build_lm(VOCAB, 8), args, Ids(bad)).train()
    except Exception as exc:  # noqa: BLE001 - returned to the test process (the pooled rank survives)
        return type(exc).__name__, str(exc)
    return None


def test_trainer_names_the_step_and_the_sample_of_a_bad_token_id(tmp_path: Path) -> None:
    perm = torch.randperm(SIZE, generator=torch.Generator().manual_seed(SEED))
    bad = int(perm[5])  # global batch 2: sample perm[5] is in step 3
    outcome: Any = run_on_ranks(1, trainer_body, str(tmp_path / "out"), bad)[0]
    assert outcome is not None
    kind, message = outcome
    assert kind == "ValueError", outcome
    assert message.startswith(f"step 3: input_ids hold token id {VOCAB} (sample {bad} of the training set"), (
        message
    )
