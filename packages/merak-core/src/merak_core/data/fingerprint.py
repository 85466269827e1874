"""What a checkpointed data position depends on: a fingerprint of the training set, compared on resume.

A data loader's position (epoch, batches consumed) means something only over the samples it was
counted on: resumed over a training set of another size or other samples, the same position
repeats or skips samples and the run silently trains on something else.
:func:`dataset_fingerprint` names the samples:

- a dataset with its own ``fingerprint`` (text data: its token cache and cutting,
  :class:`merak_core.data.text.TokenSamples`) gives it;
- a map-style dataset (a factory's): its length and a SHA-256 of a few samples (the first, the
  last and two between), read with every global random stream seeded and restored afterwards, so
  reading them changes no random stream of the run and a sample drawn from the global generators is
  the same in every run. A dataset whose samples differ from one read to the next (its own
  unseeded generator) is named by its length alone;
- an iterable dataset: None (reading it would consume the stream; its position is not checked).

[Note: sample hash] Tensors and NumPy arrays count by dtype, shape and bytes, mappings by sorted
key, sequences in order, numbers, strings, bytes and None by value; any other object by its type
name only (its ``repr`` may hold a memory address that differs between runs).

Not done here: the comparison and its error (``merak_core.data.loader``, the loader's ``load_state_dict``).
"""

from __future__ import annotations

import contextlib
import hashlib
import random
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import IterableDataset

_SEED = 0


def _update(digest: Any, value: Any) -> None:
    """Feed ``value`` into ``digest`` (see [Note: sample hash])."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        digest.update(f"tensor {t.dtype} {list(t.shape)}".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif type(value).__module__ == "numpy" and hasattr(value, "tobytes"):
        digest.update(f"array {value.dtype} {list(getattr(value, 'shape', ()))}".encode())
        digest.update(value.tobytes())
    elif isinstance(value, Mapping):
        digest.update(b"{")
        for key in sorted(value, key=str):
            digest.update(repr(key).encode())
            _update(digest, value[key])
        digest.update(b"}")
    elif isinstance(value, (list, tuple)):
        digest.update(b"[")
        for item in value:
            _update(digest, item)
        digest.update(b"]")
    elif value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        digest.update(repr(value).encode())
    else:
        digest.update(f"<{type(value).__module__}.{type(value).__qualname__}>".encode())


def _numpy_random() -> Any:
    """``numpy.random``, or None without NumPy."""
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is optional
        return None
    return np.random


@contextlib.contextmanager
def _seeded_streams() -> Iterator[None]:
    """Every global random stream seeded inside, each restored as it was on exit."""
    python = random.getstate()
    numpy_random = _numpy_random()
    numpy_state = numpy_random.get_state() if numpy_random is not None else None
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(python)
            if numpy_random is not None:
                numpy_random.set_state(numpy_state)


def _reseed() -> None:
    torch.manual_seed(_SEED)
    random.seed(_SEED)
    numpy_random = _numpy_random()
    if numpy_random is not None:
        numpy_random.seed(_SEED)


def sample_indices(length: int) -> list[int]:
    """The samples the fingerprint reads: the first, the last and two between (fewer for tiny sets)."""
    return sorted({0, length // 3, (2 * length) // 3, length - 1}) if length > 0 else []


def dataset_fingerprint(dataset: Any) -> str | None:
    """The training set's fingerprint (see the module docstring), or None for an iterable dataset."""
    own = getattr(dataset, "fingerprint", None)
    if own is not None:
        return str(own)
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        return None
    length = len(dataset)
    picks = sample_indices(length)
    digests = []
    with _seeded_streams():
        for _ in range(2):  # twice: a set whose samples change from read to read is named by its length
            _reseed()
            digest = hashlib.sha256()
            for index in picks:
                _update(digest, dataset[index])
            digests.append(digest.hexdigest())
    if digests[0] != digests[1]:
        return f"{length} samples (they differ from one read to the next: not hashed)"
    return f"{length} samples, sha256 {digests[0][:16]} of samples {picks}"


__all__ = ["dataset_fingerprint", "sample_indices"]
