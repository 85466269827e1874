"""Samples of a token cache: packed blocks or one record each, with shifted labels and SFT masking.

[Note: samples] A sample is ``seq_len + 1`` consecutive tokens ``t``; the model gets
``input_ids = t[:-1]`` and the loss ``labels = t[1:]`` (the labels are already shifted: the
trainer's cross-entropy compares position ``j``'s logits with token ``j + 1``).

- ``packing: true``: the records' tokens (each ending in the end-of-sequence token) form one
  stream of ``N`` tokens; sample ``i`` is ``stream[i * seq_len : (i + 1) * seq_len + 1]``, so
  consecutive samples share one boundary token (the last label of one is the first input of
  the next) and every token but the first is a label exactly once. There are
  ``(N - 1) // seq_len`` samples; the tail after the last whole sample is not used. Blocks
  cross record boundaries (attention sees the previous record, as in GPT-2-style packing).
- ``packing: false``: sample ``i`` is record ``i`` truncated to ``seq_len + 1`` tokens and
  padded at the end with the padding id; padded labels are -100. Records of fewer than 2
  tokens have no label and are skipped.
- Prompt/response records: a label whose token belongs to the prompt is -100, so the loss
  counts the response tokens (and the end-of-sequence token) alone.
- ``eval_fraction``: the last ``ceil(eval_fraction * samples)`` samples are the eval set,
  the others the training set, in order (the loader shuffles the training set per epoch).

[Note: cp reads] At context parallelism (``training.cp > 1``) the run replaces the sets by views
(:meth:`TokenSamples.reading_positions`) that read, of each sample, only the positions this cp rank
holds (``merak_tp.context.shard_positions``: two chunks under ``ring``, one block under ``ulysses``):
the input at position ``p`` is token ``start + p``, its label token ``start + p + 1`` (masked as
above; beyond a padded record's end, the padding id and -100). The items are then the cp split of the
whole sample's, read without the other ranks' tokens.

The order of the training samples, their split over data-parallel ranks and the position a
checkpoint resumes from belong to :class:`merak_core.data.loader.StageAwareDataLoader` (see
[Note: DP sharding] there): each sample is identified by its index, so a resume neither
repeats nor skips one.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from merak_core.data.text.cache import TokenCache

IGNORE_INDEX = -100


class TokenSamples(Dataset[dict[str, torch.Tensor]]):
    """A contiguous range of the samples of a token cache (see [Note: samples]).

    Items are ``{"input_ids": int64[seq_len], "labels": int64[seq_len]}``.
    """

    def __init__(
        self, cache: TokenCache, *, seq_len: int, packing: bool, first: int, count: int, split: str
    ) -> None:
        self.cache = cache
        self.seq_len = seq_len
        self.packing = packing
        self.first = first
        self.count = count
        self.split = split
        self.pad_id = int(cache.meta["pad_id"])
        self._records = None if packing else _labelled_records(cache)
        self.cp_positions: np.ndarray | None = None
        """The positions of each sample this view reads (a cp rank's, [Note: cp reads]); None: all."""

    def reading_positions(self, positions: Callable[[int], torch.Tensor]) -> TokenSamples:
        """A view of this set whose items hold only the positions ``positions(seq_len)`` of each sample
        ([Note: cp reads])."""
        pos = np.asarray(positions(self.seq_len).cpu(), dtype=np.int64)
        if pos.ndim != 1 or len(pos) == 0 or pos.min() < 0 or pos.max() >= self.seq_len:
            raise ValueError(
                f"positions {pos.tolist()} are not positions of a sample of {self.seq_len} tokens"
            )
        view = copy.copy(self)
        view.cp_positions = pos
        return view

    def __len__(self) -> int:
        return self.count

    def sample_id(self, index: int) -> int:
        """The sample's index over all samples of the cache (train and eval), its identity."""
        if not 0 <= index < self.count:
            raise IndexError(f"sample {index} of a {self.split} set of {self.count}")
        return self.first + index

    def token_span(self, index: int) -> tuple[int, int]:
        """``[start, stop)`` of the sample's tokens in the cache's token stream."""
        sid = self.sample_id(index)
        if self._records is None:
            start = sid * self.seq_len
            return start, start + self.seq_len + 1
        record = int(self._records[sid])
        start, stop = int(self.cache.offsets[record]), int(self.cache.offsets[record + 1])
        return start, min(stop, start + self.seq_len + 1)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start, stop = self.token_span(int(index))
        if self.cp_positions is not None:
            return self._read_positions(start, stop, self.cp_positions)
        tokens = np.asarray(self.cache.tokens[start:stop], dtype=np.int64)
        labels = tokens[1:].copy()
        if self.cache.loss_mask is not None:
            labels[np.asarray(self.cache.loss_mask[start + 1 : stop]) == 0] = IGNORE_INDEX
        inputs = tokens[:-1]
        pad = self.seq_len - len(inputs)
        if pad:
            inputs = np.concatenate([inputs, np.full(pad, self.pad_id, dtype=np.int64)])
            labels = np.concatenate([labels, np.full(pad, IGNORE_INDEX, dtype=np.int64)])
        return {"input_ids": torch.from_numpy(inputs), "labels": torch.from_numpy(labels)}

    def _read_positions(self, start: int, stop: int, pos: np.ndarray) -> dict[str, torch.Tensor]:
        """The inputs and labels at ``pos`` of the sample ``[start, stop)`` ([Note: cp reads])."""
        keep = pos < stop - start - 1  # positions with an input and a label; the others pad
        at = start + pos[keep]
        inputs = np.full(len(pos), self.pad_id, dtype=np.int64)
        labels = np.full(len(pos), IGNORE_INDEX, dtype=np.int64)
        inputs[keep] = np.asarray(self.cache.tokens[at], dtype=np.int64)
        label_ids = np.asarray(self.cache.tokens[at + 1], dtype=np.int64)
        if self.cache.loss_mask is not None:
            label_ids[np.asarray(self.cache.loss_mask[at + 1]) == 0] = IGNORE_INDEX
        labels[keep] = label_ids
        return {"input_ids": torch.from_numpy(inputs), "labels": torch.from_numpy(labels)}

    @property
    def fingerprint(self) -> str:
        """What a checkpointed position depends on: the cache, the cutting and this range."""
        return f"{self.cache.key}:seq_len={self.seq_len}:packing={self.packing}:{self.split}[{self.first}+{self.count}]"

    def describe(self) -> str:
        return (
            f"{self.count} {self.split} samples of {self.seq_len} tokens "
            f"({'packed' if self.packing else 'one record each'})"
        )


def _labelled_records(cache: TokenCache) -> np.ndarray:
    lengths = np.diff(np.asarray(cache.offsets))
    return np.flatnonzero(lengths >= 2)


def num_samples(cache: TokenCache, *, seq_len: int, packing: bool) -> int:
    """Samples in the cache for ``seq_len`` (see [Note: samples])."""
    if packing:
        return max(0, (int(cache.meta["num_tokens"]) - 1) // seq_len)
    return int(len(_labelled_records(cache)))


def split_samples(
    cache: TokenCache, *, seq_len: int, packing: bool, eval_fraction: float, source: str = "data"
) -> tuple[TokenSamples, TokenSamples | None]:
    """The training set and (``eval_fraction > 0``) the eval set: the last samples."""
    total = num_samples(cache, seq_len=seq_len, packing=packing)
    held = math.ceil(eval_fraction * total) if eval_fraction > 0 else 0
    if total - held < 1:
        tokens = int(cache.meta["num_tokens"])
        raise ValueError(
            f"{source}: the data gives {total} samples of seq_len={seq_len} ({tokens} tokens, "
            f"{cache.num_records} records, packing={packing}), {held} held out by eval_fraction={eval_fraction}, "
            "so no training sample is left: add text, lower data.seq_len or data.eval_fraction"
        )
    train = TokenSamples(cache, seq_len=seq_len, packing=packing, first=0, count=total - held, split="train")
    evaluation = (
        TokenSamples(cache, seq_len=seq_len, packing=packing, first=total - held, count=held, split="eval")
        if held
        else None
    )
    return train, evaluation


def token_counts(samples: TokenSamples) -> dict[str, Any]:
    """Labelled tokens (not -100) of a sample set, for logs and tests."""
    counted = sum(int((samples[i]["labels"] != IGNORE_INDEX).sum()) for i in range(len(samples)))
    return {"samples": len(samples), "labelled_tokens": counted}


__all__ = ["IGNORE_INDEX", "TokenSamples", "num_samples", "split_samples", "token_counts"]
