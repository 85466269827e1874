"""StageAwareDataLoader: DP shards, stage awareness, epochs, iterable datasets, exact resume.

The single-process reference is the global batch: at every step, the DP ranks'
batches concatenated in rank order must equal rows ``[s*G, (s+1)*G)`` of the epoch
permutation, the shards are disjoint, and their union is the permutation.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import Dataset, IterableDataset

from merak_core.config import TrainingArguments
from merak_core.data.loader import StageAwareDataLoader, StageBatch, split_inputs_labels
from merak_core.parallel.layout import ParallelLayout
from tests.support.dist import run_on_ranks


class _Samples(Dataset):
    """Sample i is {"input_ids": [i, i], "labels": [-i]}; records which indices were read."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.reads: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        self.reads.append(i)
        return {"input_ids": torch.tensor([i, i]), "labels": torch.tensor([-i])}


class _Stream(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for i in range(self.n):
            yield {"input_ids": torch.tensor([i, i]), "labels": torch.tensor([-i])}


def _ids(batch: StageBatch) -> list[int]:
    return batch.inputs["input_ids"][:, 0].tolist()


def _epoch_by_rank(dataset: Any, dp: int, bs: int, **kw: Any) -> list[list[list[int]]]:
    """Per rank, per step: the sample ids this rank gets in one epoch."""
    out = []
    for r in range(dp):
        loader = StageAwareDataLoader(dataset, batch_size=bs, dp_rank=r, dp_size=dp, **kw)
        out.append([_ids(b) for b in loader])
    return out


@pytest.mark.parametrize("dp,bs,n", [(1, 4, 20), (2, 3, 20), (4, 2, 37)])
@pytest.mark.parametrize("shuffle", [True, False])
def test_dp_shards_concatenate_to_the_epoch_permutation(dp: int, bs: int, n: int, shuffle: bool) -> None:
    ds = _Samples(n)
    per_rank = _epoch_by_rank(ds, dp, bs, seed=7, shuffle=shuffle)
    steps = n // (dp * bs)
    perm = StageAwareDataLoader(ds, batch_size=bs, dp_size=dp, seed=7, shuffle=shuffle).epoch_permutation(0)
    assert sorted(perm.tolist()) == list(range(n))
    if not shuffle:
        assert perm.tolist() == list(range(n))
    for r in range(dp):
        assert len(per_rank[r]) == steps
    for s in range(steps):
        global_batch = [i for r in range(dp) for i in per_rank[r][s]]
        assert global_batch == perm[s * dp * bs : (s + 1) * dp * bs].tolist()
    flat = [i for r in range(dp) for step in per_rank[r] for i in step]
    assert len(flat) == len(set(flat)) == steps * dp * bs  # disjoint


def test_epochs_reshuffle_reproducibly() -> None:
    ds = _Samples(24)
    loader = StageAwareDataLoader(ds, batch_size=2, dp_rank=1, dp_size=3, seed=3)
    epoch0 = [_ids(b) for b in loader]
    assert loader.epoch == 1  # an exhausted epoch advances
    epoch1 = [_ids(b) for b in loader]
    assert epoch0 != epoch1
    again = StageAwareDataLoader(ds, batch_size=2, dp_rank=1, dp_size=3, seed=3)
    again.set_epoch(1)
    assert [_ids(b) for b in again] == epoch1
    again.set_epoch(0)
    assert [_ids(b) for b in again] == epoch0
    other_seed = StageAwareDataLoader(ds, batch_size=2, dp_rank=1, dp_size=3, seed=4)
    assert [_ids(b) for b in other_seed] != epoch0


def test_drop_last_false_pads_by_wrapping() -> None:
    n, dp, bs = 10, 2, 3  # global batch 6: one full step, one padded
    ds = _Samples(n)
    per_rank = _epoch_by_rank(ds, dp, bs, seed=1, drop_last=False)
    perm = StageAwareDataLoader(ds, batch_size=bs, dp_size=dp, seed=1).epoch_permutation(0).tolist()
    assert all(len(steps) == 2 for steps in per_rank)
    second = [i for r in range(dp) for i in per_rank[r][1]]
    assert second == perm[6:] + perm[:2]
    assert {i for r in range(dp) for s in per_rank[r] for i in s} == set(range(n))


def test_only_first_and_last_stages_read() -> None:
    n, dp, bs = 12, 2, 3
    middle_ds = _Samples(n)
    middle = StageAwareDataLoader(
        middle_ds, batch_size=bs, dp_rank=0, dp_size=dp, needs_inputs=False, needs_labels=False
    )
    items = list(middle)
    assert len(items) == len(middle) == 2 and all(b.is_empty for b in items)
    assert middle_ds.reads == []
    first = list(StageAwareDataLoader(_Samples(n), batch_size=bs, dp_size=dp, needs_labels=False))
    last = list(StageAwareDataLoader(_Samples(n), batch_size=bs, dp_size=dp, needs_inputs=False))
    for f, la in zip(first, last, strict=True):
        assert f.labels is None and la.inputs is None
        # The labels on the last stage belong to the inputs on the first stage.
        assert torch.equal(la.labels[:, 0], -f.inputs["input_ids"][:, 0])


def test_iterable_dataset_sharded_in_stream_order() -> None:
    n, dp, bs = 23, 2, 3
    per_rank = _epoch_by_rank(_Stream(n), dp, bs)
    steps = n // (dp * bs)
    for s in range(steps):
        assert [i for r in range(dp) for i in per_rank[r][s]] == list(range(s * 6, (s + 1) * 6))
    stream = _Stream(n)
    loader = StageAwareDataLoader(stream, batch_size=bs, dp_rank=0, dp_size=dp)
    list(loader)
    list(loader)
    assert stream.epochs == [0, 1]  # set_epoch forwarded: the dataset can reshuffle itself
    padded = _epoch_by_rank(_Stream(n), dp, bs, drop_last=False)
    assert [i for r in range(dp) for i in padded[r][-1]] == [18, 19, 20, 21, 22, 18]
    endless = StageAwareDataLoader(
        _Stream(n), batch_size=bs, dp_size=dp, needs_inputs=False, needs_labels=False
    )
    it = iter(endless)
    assert all(next(it).is_empty for _ in range(50))  # no length: middle stages never run dry
    with pytest.raises(TypeError, match="no __len__"):
        len(endless)


@pytest.mark.parametrize("dataset", ["map", "iterable"])
def test_resume_is_exact(dataset: str) -> None:
    def make() -> StageAwareDataLoader:
        ds = _Samples(20) if dataset == "map" else _Stream(20)
        return StageAwareDataLoader(ds, batch_size=2, dp_rank=1, dp_size=2, seed=5)

    reference = make()
    full = [_ids(b) for _ in range(3) for b in reference]  # three epochs, 5 batches each
    for stop in (0, 3, 5, 7, 10, 14):
        loader = make()
        got: list[list[int]] = []
        while len(got) < stop:
            for b in loader:
                got.append(_ids(b))
                if len(got) == stop:
                    break
        state = loader.state_dict()
        resumed = make()
        resumed.load_state_dict(state)
        while len(got) < len(full):
            got.extend(_ids(b) for b in resumed)
        assert got == full, f"resume after {stop} batches"


def test_split_hook_and_errors() -> None:
    pairs = [(torch.tensor([float(i)]), torch.tensor(i)) for i in range(8)]
    batch = next(iter(StageAwareDataLoader(pairs, batch_size=4, shuffle=False)))
    assert batch.inputs[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0] and batch.labels.tolist() == [0, 1, 2, 3]
    custom = StageAwareDataLoader(
        _Samples(8),
        batch_size=4,
        shuffle=False,
        split_inputs_labels=lambda b: (b["input_ids"], b["labels"].squeeze(-1)),
    )
    b = next(iter(custom))
    assert torch.equal(b.inputs, torch.tensor([[0, 0], [1, 1], [2, 2], [3, 3]]))
    with pytest.raises(ValueError, match="no 'labels'"):
        split_inputs_labels({"input_ids": 1})
    with pytest.raises(ValueError, match="fewer than one global batch"):
        StageAwareDataLoader(_Samples(5), batch_size=3, dp_size=2)
    with pytest.raises(ValueError, match="batch_size .* must be a positive integer"):
        StageAwareDataLoader(_Samples(5), batch_size=0)
    loader = StageAwareDataLoader(_Samples(8), batch_size=2, seed=1)
    with pytest.raises(ValueError, match="seed=1 but this loader has seed=2"):
        StageAwareDataLoader(_Samples(8), batch_size=2, seed=2).load_state_dict(loader.state_dict())


# ---------------------------------------------------------------------------- with a layout


def _layout_batches(dp: int, tp: int, pp: int) -> tuple[tuple[int, int, int], list[tuple[Any, Any]], int]:
    layout = ParallelLayout.build(dp, tp, pp, device="cpu")
    ds = _Samples(16)
    # One optimizer step = 2 microbatches of 1 sample per DP rank.
    args = TrainingArguments(
        per_device_train_batch_size=1, gradient_accumulation_steps=2, seed=11, dp=dp, tp=tp, pp=pp
    )
    loader = StageAwareDataLoader.from_training_args(ds, args, layout)
    assert loader.batch_size == 2 and loader.shuffle and loader.drop_last
    evaluation = StageAwareDataLoader.from_training_args(
        _Samples(5), args.with_overrides(["per_device_eval_batch_size=3"]), layout, evaluation=True
    )
    # 3 samples per microbatch, 2 microbatches per step: 6 per DP rank and step, as the Trainer evaluates
    assert (evaluation.batch_size, evaluation.shuffle, len(evaluation)) == (6, False, -(-5 // (6 * dp)))
    out = []
    for b in loader:
        out.append(
            (
                None if b.inputs is None else b.inputs["input_ids"][:, 0].tolist(),
                None if b.labels is None else (-b.labels[:, 0]).tolist(),
            )
        )
    return (layout.pp_rank, layout.dp_rank, layout.tp_rank), out, len(ds.reads)


@pytest.mark.parametrize("dp,tp,pp", [(2, 1, 2), (1, 2, 2), (2, 2, 1), (1, 1, 4)])
def test_layout_driven_loading(dp: int, tp: int, pp: int) -> None:
    world = dp * tp * pp
    results = run_on_ranks(world, _layout_batches, dp, tp, pp)
    ref = StageAwareDataLoader(_Samples(16), batch_size=2, dp_size=dp, seed=11)
    perm = ref.epoch_permutation(0).tolist()
    steps = len(ref)
    for (p, d, _t), batches, reads in results:
        assert len(batches) == steps
        mine = [perm[s * 2 * dp + d * 2 : s * 2 * dp + d * 2 + 2] for s in range(steps)]
        first, last = p == 0, p == pp - 1
        for (inputs, labels), expected in zip(batches, mine, strict=True):
            assert inputs == (expected if first else None)
            assert labels == (expected if last else None)
        assert reads == (steps * 2 if first or last else 0)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 60),
    dp=st.integers(1, 4),
    bs=st.integers(1, 5),
    seed=st.integers(0, 99),
    epoch=st.integers(0, 3),
    drop_last=st.booleans(),
)
def test_sharding_properties(n: int, dp: int, bs: int, seed: int, epoch: int, drop_last: bool) -> None:
    if drop_last and n < dp * bs:
        return
    ds = list(range(n))
    loaders = [
        StageAwareDataLoader(ds, batch_size=bs, dp_rank=r, dp_size=dp, seed=seed, drop_last=drop_last)
        for r in range(dp)
    ]
    for loader in loaders:
        loader.set_epoch(epoch)
    per_rank = [[b.inputs for b in _plain(loader)] for loader in loaders]
    steps = len(loaders[0])
    assert all(len(p) == steps for p in per_rank)
    perm = loaders[0].epoch_permutation(epoch).tolist()
    flat = [i for s in range(steps) for r in range(dp) for i in per_rank[r][s]]
    if drop_last:
        assert flat == perm[: steps * dp * bs]  # concatenation = permutation prefix, hence disjoint
    else:
        assert flat == [perm[i % n] for i in range(steps * dp * bs)] and set(flat) == set(range(n))


def _plain(loader: StageAwareDataLoader) -> Iterator[StageBatch]:
    # Samples are bare ints: treat each collated batch as inputs only.
    loader.split = lambda batch: (batch.tolist(), None)
    return iter(loader)


@pytest.mark.parametrize("dp,bs,n", [(2, 3, 10), (2, 4, 3), (4, 2, 37), (2, 3, 12)])
def test_padded_batches_say_how_many_rows_are_real(dp: int, bs: int, n: int) -> None:
    # Every sample is real exactly once: the real rows of all ranks' batches are the epoch's order.
    ds = _Samples(n)
    real_ids = []
    for step_batches in zip(
        *[
            StageAwareDataLoader(ds, batch_size=bs, dp_rank=r, dp_size=dp, seed=3, drop_last=False)
            for r in range(dp)
        ],
        strict=True,
    ):
        for b in step_batches:
            real = bs if b.num_real is None else b.num_real
            assert b.num_real is None or 0 <= b.num_real < bs
            real_ids += _ids(b)[:real]
    perm = StageAwareDataLoader(ds, batch_size=bs, dp_size=dp, seed=3, drop_last=False).epoch_permutation(0)
    assert real_ids == perm.tolist()
    # drop_last: every row of every batch is real.
    if n >= dp * bs:
        assert all(b.num_real is None for b in StageAwareDataLoader(ds, batch_size=bs, dp_size=dp, seed=3))


def test_padded_stream_batches_say_how_many_rows_are_real() -> None:
    n, dp, bs = 23, 2, 3  # the last global batch holds 18..22 (5 real): rank 0 gets 3, rank 1 gets 2
    last = [
        list(StageAwareDataLoader(_Stream(n), batch_size=bs, dp_rank=r, dp_size=dp, drop_last=False))[-1]
        for r in range(dp)
    ]
    assert [b.num_real for b in last] == [3, 2]
    assert _ids(last[1])[:2] == [21, 22]
    middle = list(
        StageAwareDataLoader(
            _Samples(5), batch_size=4, dp_size=1, drop_last=False, needs_inputs=False, needs_labels=False
        )
    )
    assert len(middle) == 2 and all(b.is_empty for b in middle)  # middle stages read nothing, count the same
