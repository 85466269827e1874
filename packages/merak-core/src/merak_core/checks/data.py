"""Preflight: the datasets, their first batch, and that batch against the model and the default loss."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from merak_core.checks.base import PreflightError
from merak_core.data.batch_ids import input_embedding

SHAPE_SCAN_SAMPLES = 64
"""Samples whose tensor shapes are compared with the first one (ragged data), beyond the first batch."""


def check_dataset(dataset: Any, what: str) -> int | None:
    """A map-style dataset (``__len__`` + ``__getitem__``) or an iterable one; returns its length."""
    from torch.utils.data import IterableDataset

    if isinstance(dataset, IterableDataset):
        return None
    if isinstance(dataset, Mapping):
        raise PreflightError(
            f"data.factory returned a dict with keys {sorted(map(str, dataset))} as the {what} set: "
            "return a dataset, or the pair (train_dataset, eval_dataset)"
        )
    if isinstance(dataset, (str, bytes)) or not (
        hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")
    ):
        raise PreflightError(
            f"data.factory returned {type(dataset).__name__} ({_short(dataset)}) as the {what} set: "
            "return a dataset (a torch.utils.data.Dataset, a list of samples, or an "
            "IterableDataset), or the pair (train_dataset, eval_dataset)"
        )
    size = len(dataset)
    if size == 0:
        raise PreflightError(f"the {what} set from data.factory is empty: it needs at least one sample")
    return int(size)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _shapes(sample: Any, prefix: str = "") -> dict[str, tuple[int, ...]]:
    """Tensor shapes inside one sample by path (``['input_ids']``, ``[0]``)."""
    if isinstance(sample, torch.Tensor):
        return {prefix or "sample": tuple(sample.shape)}
    out: dict[str, tuple[int, ...]] = {}
    if isinstance(sample, Mapping):
        for k, v in sample.items():
            out.update(_shapes(v, f"{prefix}[{k!r}]"))
    elif isinstance(sample, (list, tuple)) and not isinstance(sample, str):
        if sample and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in sample) and prefix:
            return {prefix: (len(sample),)}
        for i, v in enumerate(sample):
            out.update(_shapes(v, f"{prefix}[{i}]"))
    return out


def _ragged(dataset: Any, count: int, what: str) -> str | None:
    first = _shapes(dataset[0])
    for index in range(1, count):
        shapes = _shapes(dataset[index])
        for path, shape in first.items():
            if path in shapes and shapes[path] != shape:
                return (
                    f"samples 0 and {index} of the {what} set have different shapes at {path}: "
                    f"{list(shape)} vs {list(shapes[path])}, so they cannot be stacked into a batch. Pad the "
                    "samples to one length in the dataset, or give the job a collate function that pads "
                    "(collate: file.py:function, e.g. with torch.nn.utils.rnn.pad_sequence)"
                )
    return None


def first_batch(dataset: Any, collate: Callable[[list[Any]], Any] | None, batch_size: int, what: str) -> Any:
    """The first ``batch_size`` samples collated (ragged samples named when the default collate is used)."""
    from torch.utils.data import IterableDataset, default_collate

    if isinstance(dataset, IterableDataset):
        samples = []
        for sample in dataset:
            samples.append(sample)
            if len(samples) == batch_size:
                break
        if not samples:
            raise PreflightError(f"the {what} set from data.factory yields no sample")
    else:
        n = len(dataset)
        if collate is None:
            message = _ragged(dataset, min(n, max(batch_size, SHAPE_SCAN_SAMPLES)), what)
            if message is not None:
                raise PreflightError(message)
        samples = [dataset[i] for i in range(min(n, batch_size))]
    try:
        return (collate or default_collate)(samples)
    except Exception as exc:  # noqa: BLE001 - named with the data set and the fix
        who = (
            "the job's collate function"
            if collate is not None
            else "the default collate (torch default_collate)"
        )
        raise PreflightError(
            f"{who} cannot build a batch from the first {len(samples)} samples of the {what} set: "
            f"{type(exc).__name__}: {exc}. Fix the samples or the collate function"
        ) from None


def _id_tensors(inputs: Any) -> dict[str, torch.Tensor]:
    """Inputs that feed an embedding: ``input_ids`` of a dict, or a lone integer tensor."""
    if isinstance(inputs, Mapping):
        return {k: v for k, v in inputs.items() if k == "input_ids" and isinstance(v, torch.Tensor)}
    if isinstance(inputs, torch.Tensor):
        return {"inputs": inputs}
    return {}


def _bad_row(t: torch.Tensor, bad: torch.Tensor) -> int:
    return int(bad.reshape(t.shape[0], -1).any(dim=1).nonzero()[0, 0]) if t.dim() else 0


def check_batch(model: nn.Module, inputs: Any, labels: Any, *, default_loss: bool) -> None:
    """Dtypes and id ranges of the first batch against the model (see the module docstring)."""
    emb = input_embedding(model)
    for key, ids in _id_tensors(inputs).items():
        if emb is None:
            break
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise PreflightError(
                f"batch {key} has dtype {ids.dtype}, but the model looks them up in an embedding "
                f"(num_embeddings={emb.num_embeddings}): return integer token ids (torch.long) "
                "from the dataset or the collate function"
            )
        if ids.numel():
            top, low = int(ids.max()), int(ids.min())
            if top >= emb.num_embeddings or low < 0:
                bad = (ids >= emb.num_embeddings) | (ids < 0)
                value = top if top >= emb.num_embeddings else low
                raise PreflightError(
                    f"batch {key} holds token id {value} (sample {_bad_row(ids, bad)} of the first batch), outside "
                    f"the model's vocabulary of {emb.num_embeddings} (ids 0..{emb.num_embeddings - 1}); fix the "
                    "tokenizer or the data, or build the model with a vocabulary that covers every id"
                )
    if not default_loss or not isinstance(labels, torch.Tensor):
        return
    if labels.is_floating_point() or labels.dtype == torch.bool:
        raise PreflightError(
            f"labels have dtype {labels.dtype}, but the default loss (cross-entropy) needs integer "
            "class ids (torch.long): convert them in the dataset or the collate function, or set "
            "'loss: file.py:function' for another loss (e.g. mean squared error)"
        )
    if labels.dtype != torch.long:
        raise PreflightError(
            f"labels have dtype {labels.dtype}, but the default loss (cross-entropy) needs torch.long "
            "(int64) class ids: convert them with .long() in the dataset or the collate function"
        )
    classes = _output_classes(model, inputs)
    if classes is not None and labels.numel():
        bad = ((labels >= classes) | (labels < 0)) & (labels != -100)
        if bool(bad.any()):
            value = int(labels[bad].flatten()[0])
            raise PreflightError(
                f"labels hold class id {value} (sample {_bad_row(labels, bad)} of the first batch), "
                f"outside the model's {classes} outputs (ids 0..{classes - 1}, or -100 to ignore a "
                "position); fix the labels or the model's output size"
            )


def _output_classes(model: nn.Module, inputs: Any) -> int | None:
    """The size of the model's last output dim, from a forward on the meta device (None if that fails)."""

    def meta(x: Any) -> Any:
        return x.to("meta") if isinstance(x, torch.Tensor) else x

    try:
        with torch.no_grad():
            if isinstance(inputs, Mapping):
                out = model(**{k: meta(v) for k, v in inputs.items()})
            elif isinstance(inputs, (list, tuple)):
                out = model(*[meta(v) for v in inputs])
            else:
                out = model(meta(inputs))
    except Exception:  # noqa: BLE001 - not every model runs on meta tensors; the ranks check the loss then
        return None
    logits = getattr(out, "logits", out)
    if isinstance(logits, (tuple, list)) and logits:
        logits = logits[0]
    return int(logits.shape[-1]) if isinstance(logits, torch.Tensor) and logits.dim() >= 1 else None


def check_labels_not_inputs(inputs: Any, labels: Any, what: str) -> None:
    """Under ``data.labels: shifted`` (label t is the target of output t), refuse a first batch whose labels
    equal its input ids wherever a label counts: the transformers convention (``labels = input_ids``, the
    loss shifts them), which trained unshifted teaches the model to copy its input."""
    ids = _id_tensors(inputs)
    if len(ids) != 1 or not isinstance(labels, torch.Tensor):
        return
    (key, tokens), counted = next(iter(ids.items())), labels != -100
    if tokens.shape != labels.shape or labels.dim() < 2 or labels.shape[-1] < 2 or not bool(counted.any()):
        return
    if bool((labels[counted] == tokens[counted]).all()):
        raise PreflightError(
            f"the first {what} batch has labels equal to its {key} at every labelled position, the transformers "
            "convention (labels = input_ids, the loss shifts them), but labels are read as already shifted (label t "
            "is the target of output t), so the model would learn to copy its input: set data.labels: unshifted "
            "(Merak then shifts them), or give labels[t] = input_ids[t + 1] in the data"
        )
