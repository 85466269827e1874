"""Model and data factories of the job files in the launch checks and CLI signal tests.

Job files name them as ``tests.e2e._bad_input_jobs:<function>``; keyword arguments choose the mistake.
The signal tests' job writes each rank's pid into ``MERAK_TEST_PID_DIR`` and trains slowly
(``MERAK_TEST_STEP_SLEEP`` seconds per loss call), so a test can signal it mid-run and then
check that no rank is left.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

SEQ = 6


class TinyLM(nn.Module):
    """Embedding -> one linear layer -> LM head: the smallest model with a vocabulary."""

    def __init__(self, vocab_size: int, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.hidden = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(self.embed(input_ids))))


def build_lm(vocab_size: int = 16, width: int = 8, depth: int = 1) -> nn.Module:
    """A tiny LM (``depth`` is used as a count, so a non-integer breaks it)."""
    torch.manual_seed(0)
    layers = [nn.Identity() for _ in range(depth)]
    model = TinyLM(vocab_size, width)
    model.extra = nn.Sequential(*layers)
    return model


def build_untyped(**kwargs: Any) -> nn.Module:
    """A factory that forwards every keyword (no signature to check)."""
    return build_lm(**kwargs)


def build_not_a_module() -> Any:
    return {"model": "oops"}


def build_failing() -> nn.Module:
    raise RuntimeError("weights file model.bin not found")


class Tokens(Dataset):
    """Token sequences with next-token labels; options make one sample or the dtypes wrong (``hf_labels``:
    labels = input_ids, the transformers convention, the last two of sample 1 ignored)."""

    def __init__(
        self,
        size: int = 32,
        vocab: int = 16,
        *,
        ragged_at: int | None = None,
        label_dtype: str = "int64",
        max_id: int | None = None,
        float_ids: bool = False,
        bad_label: int | None = None,
        hf_labels: bool = False,
    ) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (size, SEQ + 1), generator=g)
        if max_id is not None:
            self.ids[1, 3] = max_id
        self.ragged_at = ragged_at
        self.label_dtype = getattr(torch, label_dtype)
        self.float_ids = float_ids
        self.bad_label = bad_label
        self.hf_labels = hf_labels

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = self.ids[i, :-2] if i == self.ragged_at else self.ids[i]
        ids, labels = row[:-1].clone(), row[1:].clone()
        if self.hf_labels:
            labels = ids.clone()
            if i == 1:
                labels[-2:] = -100
        if self.bad_label is not None and i == 2:
            labels[0] = self.bad_label
        return {"input_ids": ids.float() if self.float_ids else ids, "labels": labels.to(self.label_dtype)}


def data(kind: str = "tokens", size: int = 32, **options: Any) -> Any:
    """``kind``: ``tokens`` (a good (train, eval) pair), ``int``, ``dict``, ``empty``, ``failing``."""
    if kind == "int":
        return 8
    if kind == "dict":
        return {"train": Tokens(size), "eval": Tokens(8)}
    if kind == "empty":
        return Tokens(0)
    if kind == "failing":
        raise FileNotFoundError("data/train.jsonl")
    return Tokens(size, **options), Tokens(8)


def broken_collate(samples: list[Any]) -> Any:
    raise KeyError("attention_mask")


# ---------------------------------------------------------------------------- the signal tests' job


def slow_lm(vocab_size: int = 16, width: int = 8) -> nn.Module:
    pid_dir = os.environ.get("MERAK_TEST_PID_DIR")
    if pid_dir and "LOCAL_RANK" in os.environ:  # a rank (not the launcher's check)
        with open(os.path.join(pid_dir, f"rank{os.environ.get('RANK', '0')}.pid"), "w") as f:
            f.write(str(os.getpid()))
    return build_lm(vocab_size, width)


def slow_loss(logits_btv: torch.Tensor, labels_bt: torch.Tensor) -> torch.Tensor:
    if not logits_btv.is_meta:
        time.sleep(float(os.environ.get("MERAK_TEST_STEP_SLEEP", "0")))
        marker = os.environ.get("MERAK_TEST_PID_DIR")
        if marker:
            open(os.path.join(marker, f"step.rank{os.environ.get('RANK', '0')}"), "w").close()
    return F.cross_entropy(
        logits_btv.reshape(-1, logits_btv.size(-1)), labels_bt.reshape(-1), ignore_index=-100
    )
