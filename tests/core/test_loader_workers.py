"""Loader workers and pinned memory change nothing but speed: the same batches with 2 workers as with
none, and the same position after a resume (``training.dataloader_num_workers``)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset

from merak_core.data.loader import StageAwareDataLoader, default_num_workers


class _Tokens(Dataset):
    def __init__(self, n: int) -> None:
        self.ids = torch.randint(0, 50, (n, 9), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i, :-1], "labels": self.ids[i, 1:]}


def _loader(workers: int, dp_rank: int) -> StageAwareDataLoader:
    return StageAwareDataLoader(
        _Tokens(40), batch_size=4, dp_rank=dp_rank, dp_size=2, seed=5, num_workers=workers
    )


def _take(loader: StageAwareDataLoader, count: int) -> list[Any]:
    out: list[Any] = []
    while len(out) < count:
        for batch in loader:  # across epochs, as the trainer iterates
            out.append((batch.inputs["input_ids"], batch.labels))
            if len(out) == count:
                break
    return out


def _same(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b, strict=True)
    )


def test_two_workers_give_the_batches_of_none_over_epochs() -> None:
    for dp_rank in (0, 1):
        assert _same(_take(_loader(2, dp_rank), 12), _take(_loader(0, dp_rank), 12))  # 5 batches an epoch


def test_resume_with_workers_continues_at_the_saved_position() -> None:
    whole = _take(_loader(0, 1), 9)
    first = _loader(2, 1)
    head = _take(first, 3)
    resumed = _loader(2, 1)
    resumed.load_state_dict(first.state_dict())
    assert _same(head + _take(resumed, 6), whole)


def test_workers_default_to_two_on_cuda_and_none_on_cpu() -> None:
    assert default_num_workers(None, torch.device("cpu")) == 0
    assert default_num_workers(None, torch.device("cuda", 0)) == 2
    assert (
        default_num_workers(3, torch.device("cpu")) == 3 and default_num_workers(0, torch.device("cuda")) == 0
    )
