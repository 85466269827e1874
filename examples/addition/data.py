"""A learnable synthetic task the project generates itself: multi-digit addition as text.

Each example is ``"123+456=" + reversed(sum)``, e.g. ``"123+456=9750"``
(579 written least-significant digit first, padded to 4 digits). Writing the
answer in reverse lets a causal model produce each digit after the digits it
depends on (the carry flows left to right). Tokens are characters; the loss
is computed on the answer digits only (prompt labels are -100).

Exact match under teacher forcing equals exact match of greedy decoding: if
every answer digit is the argmax given the true previous digits, greedy
decoding reproduces the same digits. So accuracy needs one forward pass.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

VOCAB = "0123456789+=#"  # '#' pads nothing here but keeps a spare symbol
STOI = {ch: i for i, ch in enumerate(VOCAB)}
VOCAB_SIZE = len(VOCAB)


class AdditionDataset(Dataset):
    """``size`` deterministic examples of ``num_digits``-digit additions."""

    def __init__(self, size: int, *, num_digits: int = 3, seed: int = 0) -> None:
        if size < 1 or num_digits < 1:
            raise ValueError(f"size and num_digits must be >= 1, got {size}, {num_digits}")
        g = torch.Generator().manual_seed(seed)
        hi = 10**num_digits
        self.a = torch.randint(0, hi, (size,), generator=g)
        self.b = torch.randint(0, hi, (size,), generator=g)
        self.num_digits = num_digits
        self.prompt_len = 2 * num_digits + 2
        self.answer_len = num_digits + 1

    def __len__(self) -> int:
        return len(self.a)

    def text(self, i: int) -> str:
        d = self.num_digits
        a, b = int(self.a[i]), int(self.b[i])
        answer = str(a + b).zfill(d + 1)[::-1]
        return f"{a:0{d}d}+{b:0{d}d}={answer}"

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.tensor([STOI[c] for c in self.text(i)])
        # Next-token prediction: position p predicts token p+1; only answer digits count.
        input_ids = ids[:-1]
        labels = ids[1:].clone()
        labels[: self.prompt_len - 1] = -100
        return {"input_ids": input_ids, "labels": labels}


def build_datasets(train_size: int = 20000, eval_size: int = 512, num_digits: int = 3):
    """Training and evaluation sets (disjoint seeds)."""
    return (
        AdditionDataset(train_size, num_digits=num_digits, seed=1),
        AdditionDataset(eval_size, num_digits=num_digits, seed=2),
    )


def exact_match(logits_btv: torch.Tensor, labels_bt: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-example accuracy: 1.0 when every answer digit is predicted correctly (and digit accuracy)."""
    pred = logits_btv.argmax(-1)
    counted = labels_bt != -100
    hits = (pred == labels_bt) & counted
    return {
        "accuracy": (hits | ~counted).all(dim=1).float(),
        "digit_accuracy": hits.sum(1).float() / counted.sum(1).clamp(min=1).float(),
    }
