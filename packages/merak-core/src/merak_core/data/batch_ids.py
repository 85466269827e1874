"""Token ids and labels of every training batch against the model's sizes, on the loader's side (CPU).

The launch checks see the first batch only. A bad id later (part of the data tokenized with another
vocabulary, a corrupt shard) would fail inside an embedding or the loss: an ``IndexError`` from one
stage on CPU, a device-side assert on CUDA, while the other ranks wait. Here each batch a rank
reads is checked before it reaches the model; the error names the step, the sample (its index in
the training set for a map-style dataset, else its row in this rank's batch) and the value.

Cheap: a min and a max per tensor of the CPU batch. Not checked: labels when the loss is the
user's, or when the model's output size is not known without running it (no output embedding
and no ``lm_head`` linear).

Not done here: the first batch before launch (``merak_core.checks``), the loader itself (``data.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch
from torch import nn

IGNORE_INDEX = -100
"""The label the default loss ignores."""


def input_embedding(model: nn.Module) -> nn.Embedding | None:
    """The model's input embedding: ``get_input_embeddings()`` where it has one, else its first ``nn.Embedding``."""
    get = getattr(model, "get_input_embeddings", None)
    if callable(get):
        try:
            emb = get()
        except Exception:  # noqa: BLE001 - a model without one: look for the first embedding
            emb = None
        if isinstance(emb, nn.Embedding):
            return emb
    return next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)


def _input_vocab(model: nn.Module) -> int | None:
    emb = input_embedding(model)
    return None if emb is None else int(emb.num_embeddings)


def _output_classes(model: nn.Module) -> int | None:
    get = getattr(model, "get_output_embeddings", None)
    head = None
    if callable(get):
        try:
            head = get()
        except Exception:  # noqa: BLE001 - not every model has one
            head = None
    if head is None:
        head = dict(model.named_children()).get("lm_head")
    return int(head.out_features) if isinstance(head, nn.Linear) else None


@dataclass(frozen=True)
class IdRanges:
    """The ranges a batch's ids must lie in: ``[0, vocab)`` for ``input_ids``, ``[0, classes)`` or -100 for labels."""

    vocab: int | None
    classes: int | None

    @classmethod
    def of(cls, model: nn.Module, *, default_loss: bool) -> IdRanges:
        """The ranges of ``model`` (the whole model, before it is split or sharded)."""
        return cls(_input_vocab(model), _output_classes(model) if default_loss else None)

    def check(self, inputs: Any, labels: Any, step: int, where: Any = None) -> bool:
        """``ValueError`` naming ``step``, the sample and the value of the first id out of range.

        ``where(row)`` names the sample of row ``row`` of this rank's batch (default: the row).
        Returns whether the input ids were checked against ``vocab`` (then the vocab-parallel embedding
        need not check them again on the device: ``ParallelEngine.step(ids_checked=...)``).
        """
        name = where or (lambda row: f"row {row} of this rank's batch")
        ids = inputs.get("input_ids") if isinstance(inputs, Mapping) else inputs
        if self.vocab is not None and _is_ids(ids):
            if found := _first(ids, (ids < 0) | (ids >= self.vocab), name):
                raise ValueError(
                    f"step {step}: input_ids hold token id {found}, outside the model's vocabulary of "
                    f"{self.vocab} (ids 0..{self.vocab - 1}); fix the tokenizer or the data, or build the "
                    "model with a vocabulary that covers every id"
                )
        if self.classes is not None and _is_ids(labels):
            bad = ((labels < 0) | (labels >= self.classes)) & (labels != IGNORE_INDEX)
            if found := _first(labels, bad, name):
                raise ValueError(
                    f"step {step}: labels hold class id {found}, outside the model's {self.classes} outputs "
                    f"(ids 0..{self.classes - 1}, or {IGNORE_INDEX} to ignore a position); fix the labels or "
                    "the model's output size"
                )
        return self.vocab is not None and _is_ids(ids)


def _is_ids(t: Any) -> TypeGuard[torch.Tensor]:
    return (
        isinstance(t, torch.Tensor)
        and t.dim() >= 1
        and t.numel() > 0
        and not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)
    )


def _first(t: torch.Tensor, bad: torch.Tensor, name: Any) -> str | None:
    """``'VALUE (SAMPLE)'`` of the first element of ``t`` where ``bad`` (``name(row)`` names its sample), or
    None when there is none."""
    if not bool(bad.any()):
        return None
    row = int(bad.reshape(t.shape[0], -1).any(dim=1).nonzero()[0, 0])
    return f"{int(t[row][bad[row]].flatten()[0])} ({name(row)})"


def sample_namer(loader: Any) -> Any:
    """``row -> 'sample N of the training set'`` for the batch ``loader`` just handed out (map-style only)."""
    if getattr(loader, "iterable", True):
        return None
    epoch, step = loader.epoch, loader.batches_consumed - 1
    start = step * loader.global_batch_size + loader.dp_rank * loader.batch_size

    def name(row: int) -> str:  # the permutation is drawn only for an error
        perm = loader.epoch_permutation(epoch)
        return f"sample {int(perm[(start + row) % len(perm)])} of the training set, epoch {epoch}"

    return name
