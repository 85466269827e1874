"""The training set's fingerprint that a checkpointed data position carries (pure: no process group).

A factory's map-style dataset is named by its length and a hash of a few samples, read without
touching the run's random streams; a resume over a training set of another size or other samples is
refused by the loader, with the fix.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

from merak_core.data.fingerprint import dataset_fingerprint, sample_indices
from merak_core.data.loader import StageAwareDataLoader


class _Rows(Dataset):
    """``n`` deterministic samples (a dict of tensors, a number and a string); sample ``changed`` altered."""

    def __init__(self, n: int, changed: int | None = None) -> None:
        self.n, self.changed = n, changed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, object]:
        x = torch.arange(4, dtype=torch.float64) + i + (0.5 if i == self.changed else 0.0)
        return {"x": x, "labels": torch.tensor(i % 3), "weight": 1.0, "tag": "row"}


class _GlobalNoise(_Rows):
    """Samples drawn from the global generators, as an augmentation would."""

    def __getitem__(self, i: int) -> dict[str, object]:
        return {"x": torch.randn(3) + float(np.random.rand()) + random.random(), "y": torch.tensor(i % 3)}


class _OwnGenerator(_Rows):
    """Samples drawn from the dataset's own generator: different at every read."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.g = torch.Generator().manual_seed(1)

    def __getitem__(self, i: int) -> dict[str, object]:
        return {"x": torch.randn(3, generator=self.g), "y": torch.tensor(i % 3)}


class _Stream(IterableDataset):
    def __iter__(self):  # type: ignore[no-untyped-def]
        yield from ({"x": torch.zeros(2), "y": torch.tensor(0)} for _ in range(8))


def test_length_and_a_few_samples_name_a_map_style_dataset() -> None:
    assert sample_indices(64) == [0, 21, 42, 63] and sample_indices(2) == [0, 1] and sample_indices(0) == []
    same = dataset_fingerprint(_Rows(64))
    assert same == dataset_fingerprint(_Rows(64)) and same is not None
    assert same.startswith("64 samples, sha256 ") and same.endswith(" of samples [0, 21, 42, 63]")
    assert dataset_fingerprint(_Rows(48)) != same  # another size
    assert dataset_fingerprint(_Rows(64, changed=21)) != same  # a hashed sample changed
    assert dataset_fingerprint([(torch.zeros(2), 1)] * 4) is not None  # a plain list is a map-style dataset
    assert dataset_fingerprint(_Stream()) is None  # a stream is not read ahead


def test_reading_the_samples_leaves_every_random_stream_alone() -> None:
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    before = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    noisy = dataset_fingerprint(_GlobalNoise(10))
    assert torch.equal(torch.get_rng_state(), before[0])
    assert np.array_equal(np.random.get_state()[1], before[1]) and random.getstate() == before[2]
    assert noisy == dataset_fingerprint(_GlobalNoise(10)) and "sha256" in str(
        noisy
    )  # seeded: the same every run
    # Samples that differ from read to read (the dataset's own generator): its length alone.
    assert (
        dataset_fingerprint(_OwnGenerator(10))
        == "10 samples (they differ from one read to the next: not hashed)"
    )


def test_the_text_datasets_own_fingerprint_wins() -> None:
    class _Text(_Rows):
        fingerprint = "cache-key:seq_len=8:packing=True:train[0+64]"

    assert dataset_fingerprint(_Text(64)) == _Text.fingerprint


def test_a_resume_over_another_training_set_is_refused_with_the_fix() -> None:
    loader = StageAwareDataLoader(_Rows(16), batch_size=2, dp_size=2, seed=1)
    next(iter(loader))
    state = loader.state_dict()
    assert state["dataset"] == dataset_fingerprint(_Rows(16))
    StageAwareDataLoader(_Rows(16), batch_size=2, dp_size=2, seed=1).load_state_dict(state)  # the same data
    for other in (_Rows(24), _Rows(16, changed=15)):
        resumed = StageAwareDataLoader(other, batch_size=2, dp_size=2, seed=1)
        with pytest.raises(ValueError) as info:
            resumed.load_state_dict(state)
        assert str(info.value).startswith(
            f"data loader state was saved over a training set of {state['dataset']!r}"
        )
        assert "the training set changed (its size or its samples)" in str(info.value)
        assert "resume with the same data (the data factory and its kwargs)" in str(info.value)
    # A checkpoint written before datasets were fingerprinted (no fingerprint): not checked.
    StageAwareDataLoader(_Rows(24), batch_size=2, dp_size=2, seed=1).load_state_dict(
        {**state, "dataset": None}
    )
