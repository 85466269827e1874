"""Stage-aware data loading: disjoint deterministic DP shards, read only where needed.

In a pipeline only the first stage consumes inputs and only the last stage
consumes labels; the ranks in between never touch the dataset.
:class:`StageAwareDataLoader` gives every rank the same *number* of batches per
epoch (the schedules count on it) but reads and collates the dataset only on
ranks that need inputs or labels; the others get empty ``StageBatch(None, None)``
items.

[Note: DP sharding] For a map-style dataset of ``n`` samples, epoch ``e`` uses the
permutation ``torch.randperm(n)`` drawn from a generator seeded with ``seed + e``
(the identity with ``shuffle=False``). Step ``s`` takes the global batch
``perm[s*G:(s+1)*G]`` with ``G = dp_size * batch_size``, and DP rank ``r`` takes
rows ``[r*batch_size, (r+1)*batch_size)`` of it. So the concatenation of the DP
ranks' batches at step ``s`` is the global batch a single process would use, the
shards are disjoint, and their union over an epoch is the epoch's permutation
(truncated to whole global batches with ``drop_last=True``, padded by wrapping
around to the permutation's start otherwise, as ``DistributedSampler`` does; then
each batch says how many of its leading rows are real, ``StageBatch.num_real``, so
evaluation can mask the padding and count every sample exactly once).
An iterable dataset is read as a stream and cut the same way (its order is the
stream's; ``set_epoch`` is forwarded to the dataset when it has one).

The position (epoch, batches consumed in it) is kept in the loader:
iterating continues where the last iteration stopped, an epoch advances when its
batches are exhausted, and ``state_dict``/``load_state_dict`` resume exactly.

[Note: unshifted labels] With ``labels: unshifted`` (the job file's ``data.labels``) a batch's labels
follow the transformers convention, ``labels = input_ids`` (-100 where ignored), and the loss must
shift them. :func:`shift_labels` does it where the labels are read, on the whole batch of this rank:
``labels[..., 1:]`` padded at the end with -100, exactly as transformers' ``ForCausalLMLoss`` pads and
shifts before its cross-entropy over every position of the logits. So output t is compared with
label t + 1, the last position is ignored, and each microbatch's default loss (the mean over its
labels other than -100) is transformers' loss of that microbatch. The shift is along the sequence,
rows stay rows: the microbatch split (along the batch), DP shards (whole samples), the pipeline
(labels on the last stage only) and TP (the loss sees the whole logits, or with a vocab-parallel loss,
``merak_tp.vocab_parallel_cross_entropy``, the same -100 rule over vocab-sharded logits; sequence
parallelism gathers the sequence before the head) all get the same shifted rows as one process, so every
layout that is exact for shifted labels is exact for unshifted ones, with the same loss normalisation
([Note: loss scaling] in ``engine.py``: the mean over microbatches of each one's token mean, as the
single-process references of the tests compute it). Metrics get the shifted labels too.

Not done here: moving batches to a device, splitting into microbatches (the
trainer does both), and sample-level shuffling of iterable datasets.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate

from merak_core.config import TrainingArguments
from merak_core.data.fingerprint import dataset_fingerprint
from merak_core.parallel.layout import ParallelLayout

logger = logging.getLogger(__name__)

SplitFn = Callable[[Any], tuple[Any, Any]]


@dataclass(frozen=True)
class StageBatch:
    """What one rank gets per step: ``inputs`` on the first stage, ``labels`` on the last, else None."""

    inputs: Any = None
    """Model inputs (e.g. a dict of tensors without "labels"); None where not needed."""
    labels: Any = None
    """Targets for the loss; None where not needed."""
    num_real: int | None = None
    """Rows of this batch that are real samples, the first ``num_real`` (the rest pad the last batch of an
    epoch by wrapping around, ``drop_last=False``); None: every row is real."""

    @property
    def is_empty(self) -> bool:
        """True on ranks that read nothing (middle pipeline stages)."""
        return self.inputs is None and self.labels is None


def split_inputs_labels(batch: Any) -> tuple[Any, Any]:
    """The default split: a mapping's ``"labels"`` entry vs the rest, or a 2-sequence ``(inputs, labels)``."""
    if isinstance(batch, Mapping):
        if "labels" not in batch:
            raise ValueError(
                f"the collated batch is a mapping with keys {sorted(batch)} but no 'labels': add labels in the "
                "collate function or pass split_inputs_labels=... to StageAwareDataLoader"
            )
        return {k: v for k, v in batch.items() if k != "labels"}, batch["labels"]
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise ValueError(
        f"cannot split a collated batch of type {type(batch).__name__} into inputs and labels: return a dict "
        "with 'labels' or an (inputs, labels) pair from the collate function, or pass split_inputs_labels=..."
    )


_default_split = split_inputs_labels

IGNORE_INDEX = -100


def shift_labels(labels: Any) -> torch.Tensor:
    """transformers-convention labels made position-aligned (see [Note: unshifted labels]): ``labels[..., 1:]``
    padded with -100 at the end. ValueError unless ``labels`` are integer token labels ``[batch, seq]``."""
    if (
        not isinstance(labels, torch.Tensor)
        or labels.dim() < 2
        or labels.is_floating_point()
        or labels.is_complex()
        or labels.dtype == torch.bool
    ):
        what = (
            f"a {labels.dim()}-d {labels.dtype} tensor of shape {list(labels.shape)}"
            if isinstance(labels, torch.Tensor)
            else type(labels).__name__
        )
        raise ValueError(
            f"labels: unshifted (data.labels) shifts token labels [batch, seq] by one position, but the labels "
            f"are {what}: return integer token labels (labels = input_ids, -100 to ignore), or set "
            "data.labels: shifted for labels already aligned with the outputs"
        )
    return torch.nn.functional.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


def label_split(labels: str, split: SplitFn | None = None) -> SplitFn:
    """The split of a batch into ``(inputs, labels)`` under the label convention ``labels`` (``shifted``:
    ``split`` itself; ``unshifted``: the labels shifted by :func:`shift_labels`)."""
    base = split or _default_split
    if labels == "shifted":
        return base
    if labels != "unshifted":
        raise ValueError(f"labels={labels!r} is invalid: expected 'shifted' or 'unshifted'")

    def split_and_shift(batch: Any) -> tuple[Any, Any]:
        inputs, raw = base(batch)
        return inputs, shift_labels(raw)

    return split_and_shift


class _BatchIndices:
    """Batch sampler over one epoch of a map-style dataset (see [Note: DP sharding])."""

    def __init__(self, indices: list[list[int]]) -> None:
        self._indices = indices

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._indices)

    def __len__(self) -> int:
        return len(self._indices)


class StageAwareDataLoader:
    """Per-rank batches for a (dp, pp) layout: disjoint DP shards, read only on first/last stages.

    Args:
        dataset: a map-style dataset (``__getitem__`` + ``__len__``) or a
            ``torch.utils.data.IterableDataset``.
        batch_size: samples per DP rank per batch (the global batch is ``dp_size * batch_size``).
        layout: takes ``dp_rank``, ``dp_size`` (``layout.dp``), ``needs_inputs``
            (``is_first_stage``) and ``needs_labels`` (``is_last_stage``) from it.
        dp_rank, dp_size, needs_inputs, needs_labels: the same, given explicitly instead of ``layout``.
        collate_fn: builds a batch from a list of samples (default: ``default_collate``).
        shuffle: reshuffle map-style datasets every epoch (ignored for iterable datasets).
        seed: base seed of the epoch permutations (identical on every rank).
        drop_last: drop the last incomplete global batch (else pad it by wrapping around).
        split_inputs_labels: maps a collated batch to ``(inputs, labels)``; default
            :func:`split_inputs_labels`.
        num_workers, pin_memory: passed to the ``torch.utils.data.DataLoader`` that reads
            map-style datasets on the reading ranks (``num_workers=None``: 0; the trainer chooses
            :func:`default_num_workers` and pins memory on CUDA). The batches do not depend on them.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        batch_size: int,
        layout: ParallelLayout | None = None,
        dp_rank: int | None = None,
        dp_size: int | None = None,
        needs_inputs: bool | None = None,
        needs_labels: bool | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        split_inputs_labels: SplitFn | None = None,
        num_workers: int | None = 0,
        pin_memory: bool = False,
    ) -> None:
        explicit = (dp_rank, dp_size, needs_inputs, needs_labels)
        if layout is not None:
            if any(v is not None for v in explicit):
                raise ValueError("pass either layout or dp_rank/dp_size/needs_inputs/needs_labels, not both")
            dp_rank, dp_size = layout.dp_rank, layout.dp
            needs_inputs, needs_labels = layout.is_first_stage, layout.is_last_stage
        else:
            dp_rank = 0 if dp_rank is None else dp_rank
            dp_size = 1 if dp_size is None else dp_size
            needs_inputs = True if needs_inputs is None else needs_inputs
            needs_labels = True if needs_labels is None else needs_labels
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size (per DP rank) must be a positive integer, got {batch_size!r}")
        if not isinstance(dp_size, int) or dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"need 0 <= dp_rank < dp_size, got dp_rank={dp_rank} dp_size={dp_size}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.needs_inputs = bool(needs_inputs)
        self.needs_labels = bool(needs_labels)
        self.collate_fn = collate_fn or default_collate
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.split = split_inputs_labels or _default_split
        self.num_workers = 0 if num_workers is None else num_workers
        self.pin_memory = pin_memory
        self.iterable = isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__")
        self._epoch = 0
        self._consumed = 0
        self._fingerprint: str | None = None
        self._fingerprinted = False
        if not self.iterable:
            n = len(dataset)
            if self.drop_last and n < self.global_batch_size:
                raise ValueError(
                    f"the dataset has {n} samples, fewer than one global batch of {self.global_batch_size} "
                    f"(dp_size={dp_size} x batch_size={batch_size}) with drop_last=True: use a smaller batch (the "
                    "Trainer's is per_device_train_batch_size x gradient_accumulation_steps x dp), more samples, or "
                    "drop_last=False"
                )

    @classmethod
    def from_training_args(
        cls,
        dataset: Any,
        args: TrainingArguments,
        layout: ParallelLayout,
        *,
        evaluation: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        split_inputs_labels: SplitFn | None = None,
        device: torch.device | None = None,
        eval_micro_batch_size: int | None = None,
    ) -> StageAwareDataLoader:
        """The loader of a run (the Trainer's, its evaluation's, the probes'): one batch per step.

        Training: ``micro_batch_size * num_microbatches`` samples per DP rank, shuffled with ``args.seed``,
        the incomplete last batch dropped, ``dataloader_num_workers`` (null: 2 on CUDA, 0 on CPU), pinned
        on CUDA. Evaluation: ``eval_micro_batch_size`` (default ``per_device_eval_batch_size``) per
        microbatch, in order, the last batch padded and masked. Inputs are read where the rank holds the
        first stage, labels where it holds the last; ``args.labels``: [Note: unshifted labels].
        """
        from merak_core.parallel.virtual_stages import stage_data_roles

        device = device if device is not None else torch.device("cpu")
        micro = (
            (eval_micro_batch_size or args.per_device_eval_batch_size)
            if evaluation
            else args.micro_batch_size
        )
        return cls(
            dataset,
            batch_size=micro * args.num_microbatches,
            **stage_data_roles(args, layout),
            collate_fn=collate_fn,
            split_inputs_labels=label_split(args.labels, split_inputs_labels),
            seed=args.seed,
            shuffle=not evaluation,
            drop_last=not evaluation,
            num_workers=0 if evaluation else default_num_workers(args.dataloader_num_workers, device),
            pin_memory=not evaluation and device.type == "cuda",  # the step copies batches with non_blocking
        )

    # ------------------------------------------------------------------ sizes

    @property
    def global_batch_size(self) -> int:
        """Samples per step over all DP ranks."""
        return self.dp_size * self.batch_size

    @property
    def reads_data(self) -> bool:
        """True on ranks that need inputs or labels (the only ones that touch the dataset)."""
        return self.needs_inputs or self.needs_labels

    def _dataset_len(self) -> int | None:
        return len(self.dataset) if isinstance(self.dataset, Sized) else None

    def __len__(self) -> int:
        """Batches per epoch (the same on every rank)."""
        n = self._dataset_len()
        if n is None:
            raise TypeError(
                "the iterable dataset has no __len__, so the number of batches per epoch is unknown"
            )
        full, rest = divmod(n, self.global_batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        return self._epoch

    @property
    def batches_consumed(self) -> int:
        """Batches of the current epoch already handed out."""
        return self._consumed

    def set_epoch(self, epoch: int) -> None:
        """Move to ``epoch`` (its first batch), unless the loader is already in it (resume-safe)."""
        if epoch != self._epoch:
            self._epoch = epoch
            self._consumed = 0

    # ------------------------------------------------------------------ order

    def epoch_permutation(self, epoch: int | None = None) -> torch.Tensor:
        """Sample order of a map-style dataset in ``epoch`` (see [Note: DP sharding])."""
        if self.iterable:
            raise TypeError("an iterable dataset has no index permutation: its order is the stream's")
        n = len(self.dataset)
        epoch = self._epoch if epoch is None else epoch
        if not self.shuffle:
            return torch.arange(n)
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(n, generator=generator)

    def _rank_indices(self, epoch: int) -> list[list[int]]:
        perm = self.epoch_permutation(epoch).tolist()
        n, g, b = len(perm), self.global_batch_size, self.batch_size
        start = self.dp_rank * b
        return [[perm[(step * g + start + j) % n] for j in range(b)] for step in range(len(self))]

    # ------------------------------------------------------------------ iteration

    def __iter__(self) -> Iterator[StageBatch]:
        n = self._dataset_len()
        if n is not None and self._consumed >= len(self):
            # Stopped (or saved) right after an epoch's last batch: the next batch opens the next epoch.
            self._epoch, self._consumed = self._epoch + 1, 0
        epoch, start = self._epoch, self._consumed
        source: Iterable[Any]
        if not self.reads_data:
            source = _nothing(len(self) - start if n is not None else None)
        elif self.iterable:
            source = self._iterable_batches(epoch, start)
        else:
            indices = self._rank_indices(epoch)[start:]
            # A private generator: torch's DataLoader otherwise draws its worker base seed from the
            # global generator, so a resumed run (a new iterator mid-epoch) would shift the global
            # stream that dropout reads (see [Note: random streams] in merak_core.checkpoint.state).
            source = DataLoader(
                self.dataset,
                batch_sampler=_BatchIndices(indices),
                collate_fn=self.collate_fn,
                num_workers=self.num_workers,
                pin_memory=self.pin_memory,
                generator=torch.Generator().manual_seed(self.seed + epoch),
            )
        for offset, item in enumerate(source):
            batch, real = (
                item if self.iterable and self.reads_data else (item, self._real_rows(start + offset))
            )
            self._consumed += 1
            yield self._stage_batch(batch, real)
        if self._epoch == epoch:
            self._epoch += 1
            self._consumed = 0

    def _real_rows(self, step: int) -> int | None:
        """Real samples in this rank's batch ``step`` of a map-style epoch (None: all of them)."""
        n = self._dataset_len()
        if self.drop_last or n is None:
            return None
        real = min(
            self.batch_size, max(0, n - step * self.global_batch_size - self.dp_rank * self.batch_size)
        )
        return None if real == self.batch_size else real

    def _stage_batch(self, batch: Any, real: int | None = None) -> StageBatch:
        if batch is None:
            return StageBatch(num_real=real)
        inputs, labels = self.split(batch)
        return StageBatch(inputs if self.needs_inputs else None, labels if self.needs_labels else None, real)

    def _iterable_batches(self, epoch: int, skip: int) -> Iterator[tuple[Any, int | None]]:
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        g, b = self.global_batch_size, self.batch_size
        lo = self.dp_rank * b
        chunk: list[Any] = []
        step = 0
        for sample in self.dataset:
            chunk.append(sample)
            if len(chunk) == g:
                if step >= skip:
                    yield self.collate_fn(chunk[lo : lo + b]), None
                step += 1
                chunk = []
        if chunk and not self.drop_last and step >= skip:
            padded = [chunk[i % len(chunk)] for i in range(g)]
            yield self.collate_fn(padded[lo : lo + b]), min(b, max(0, len(chunk) - lo))

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """The position: epoch and batches consumed in it (plus what must match on resume).

        The training set's fingerprint (text data: its token cache and cutting; a map-style dataset: its
        length and a hash of a few samples, :mod:`merak_core.data.fingerprint`) is recorded, so a resume
        over other data is refused instead of repeating or skipping samples.
        """
        return {
            "epoch": self._epoch,
            "batches_consumed": self._consumed,
            "seed": self.seed,
            "global_batch_size": self.global_batch_size,
            "shuffle": self.shuffle,
            "dataset": self.dataset_fingerprint(),
        }

    def dataset_fingerprint(self) -> str | None:
        """The fingerprint of the dataset (computed once: it reads a few samples); None for an iterable one."""
        if not self._fingerprinted:
            self._fingerprint, self._fingerprinted = dataset_fingerprint(self.dataset), True
        return self._fingerprint

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at a saved position: the next batch is the one after the last one handed out."""
        for key, mine in (
            ("seed", self.seed),
            ("global_batch_size", self.global_batch_size),
            ("shuffle", self.shuffle),
        ):
            if key in state and state[key] != mine:
                raise ValueError(
                    f"data loader state was saved with {key}={state[key]!r} but this loader has {key}={mine!r}: "
                    "resume with the same seed, shuffle and dp_size*batch_size, or start a new epoch"
                )
        mine_data = self.dataset_fingerprint() if state.get("dataset") is not None else None
        if (
            mine_data is not None
            and state["dataset"] != mine_data
            and getattr(self.dataset, "fingerprint", None) is None
        ):
            raise ValueError(
                f"data loader state was saved over a training set of {state['dataset']!r} but this loader reads "
                f"{mine_data!r}: the training set changed (its size or its samples), so the saved position would "
                "repeat or skip samples and the run would not continue the checkpoint's; resume with the same data "
                "(the data factory and its kwargs), or start a new run (a new output_dir) from the checkpoint's weights"
            )
        if mine_data is not None and state["dataset"] != mine_data:
            raise ValueError(
                f"data loader state was saved over the samples {state['dataset']!r} but this loader reads "
                f"{mine_data!r}: the data, the tokenizer or the cutting (seq_len, packing, eval_fraction) changed, "
                "so the saved position would repeat or skip samples; resume with the same data, or start a new "
                "run from the checkpoint's weights"
            )
        self._epoch = int(state["epoch"])
        self._consumed = int(state["batches_consumed"])


def default_num_workers(num_workers: int | None, device: torch.device) -> int:
    """``training.dataloader_num_workers``, or when None: 2 on CUDA (reading overlaps the step), 0 on CPU
    (the ranks share the cores)."""
    if num_workers is not None:
        return num_workers
    return 2 if device.type == "cuda" else 0


def _nothing(count: int | None) -> Iterator[None]:
    """``count`` empty items (forever when the dataset length is unknown)."""
    if count is None:
        while True:
            yield None
    else:
        for _ in range(count):
            yield None


__all__ = [
    "IGNORE_INDEX",
    "StageAwareDataLoader",
    "StageBatch",
    "default_num_workers",
    "label_split",
    "shift_labels",
    "split_inputs_labels",
]
