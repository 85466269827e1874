"""The synthetic token data the Trainer benchmarks feed: fixed-seed random ids, next-token labels."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class Tokens(Dataset):
    """``size`` sequences of ``seq`` random ids below ``vocab`` (seed 0), labels shifted by one."""

    def __init__(self, size: int, vocab: int, seq: int) -> None:
        self.ids = torch.randint(0, vocab, (size, seq + 1), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i, :-1], "labels": self.ids[i, 1:]}
