"""ZeRO-1 (ZeroOptimizer) against the unsharded torch optimizer, float64.

- same gradients on every rank: 3 steps of ZeRO-1 AdamW (with parameter groups and
  an LR scheduler) give *bit-identical* parameters and optimizer state to plain AdamW;
- composed with DataParallelGradSync on DP shards of a batch: equal to plain AdamW
  on the global batch in one process (tight tolerance);
- checkpoint round trips: per-rank shards and the consolidated (unsharded) form.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from merak_core.parallel.data_parallel import DataParallelGradSync
from merak_core.parallel.zero import ZeroOptimizer, partition_parameters
from tests.support.compare import assert_tensors_close
from tests.support.dist import run_on_ranks
from tests.support.models import REFERENCE_MODELS, build_reference

STEPS = 3
BATCH = 4
SEQ = 8


def test_partition_is_balanced_and_deterministic() -> None:
    numels = [100, 10, 10, 50, 40, 1, 1, 30]
    owners = partition_parameters(numels, 3)
    assert owners == partition_parameters(numels, 3)
    loads = [sum(n for n, o in zip(numels, owners, strict=True) if o == s) for s in range(3)]
    # By hand: 100->s0, 50->s1, 40->s2, 30->s2 (70), 10->s1 (60), 10->s1 (70), 1->s1 (71), 1->s2 (71).
    assert loads == [100, 71, 71]
    assert partition_parameters(numels, 1) == [0] * len(numels)
    assert set(partition_parameters([5], 4)) == {0}  # more shards than parameters: some own nothing


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def _adamw(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=1e-2, betas=(0.8, 0.95), eps=1e-8)


def _sgd(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    return torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True)


FACTORIES = {"adamw": _adamw, "sgd": _sgd}


def _schedule(step: int) -> float:
    return [1.0, 0.5, 0.25, 0.125][step]


def _batch(step: int, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    ref = REFERENCE_MODELS["gpt"]
    return ref.make_inputs(BATCH * world, SEQ, 50 + step)[0], ref.make_labels(BATCH * world, SEQ, 50 + step)


def _plain_run(kind: str, world: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    model = build_reference("gpt", seed=1)
    opt = FACTORIES[kind](_groups(model))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule)
    for step in range(STEPS):
        ids, labels = _batch(step, world)
        opt.zero_grad()
        REFERENCE_MODELS["gpt"].loss(model(ids), labels).backward()
        opt.step()
        sched.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, opt.state_dict()


def _zero_same_grads(kind: str) -> tuple[dict[str, torch.Tensor], dict[str, Any], int]:
    model = build_reference("gpt", seed=1)
    opt = ZeroOptimizer(_groups(model), FACTORIES[kind], group=None)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule)
    for step in range(STEPS):
        ids, labels = _batch(step)
        opt.zero_grad()
        REFERENCE_MODELS["gpt"].loss(model(ids), labels).backward()
        opt.step()
        sched.step()
    owned = sum(len(v) for v in opt.inner.state.values())
    return (
        {n: p.detach().clone() for n, p in model.named_parameters()},
        opt.consolidate_state_dict(),
        len(opt.inner.state) and owned,
    )


def _assert_state_equal(actual: dict[str, Any], expected: dict[str, Any], *, exact: bool) -> None:
    assert sorted(actual["state"]) == sorted(expected["state"])
    for index, ref_state in expected["state"].items():
        for key, ref_value in ref_state.items():
            value = actual["state"][index][key]
            if exact:
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(ref_value)), (index, key)
            else:
                assert_tensors_close(
                    torch.as_tensor(value), torch.as_tensor(ref_value), name=f"state[{index}][{key}]"
                )
    for got, ref in zip(actual["param_groups"], expected["param_groups"], strict=True):
        assert got == ref


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_zero1_bit_identical_to_plain_optimizer(world: int, kind: str) -> None:
    ref_params, ref_state = _plain_run(kind, 1)
    results = run_on_ranks(world, _zero_same_grads, kind)
    for rank, (params, state, _) in enumerate(results):
        for name, ref in ref_params.items():
            assert torch.equal(params[name], ref), f"rank {rank}: parameter {name} differs from plain {kind}"
        _assert_state_equal(state, ref_state, exact=True)
    # The state really is sharded: every rank holds some, and none holds all of it.
    counts = [r[2] for r in results]
    assert all(c > 0 for c in counts) and max(counts) < sum(counts)


def _zero_with_dp(kind: str) -> dict[str, torch.Tensor]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_reference("gpt", seed=1)
    sync = DataParallelGradSync(model, None, bucket_size_bytes=8192)
    opt = ZeroOptimizer(_groups(model), FACTORIES[kind])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule)
    for step in range(STEPS):
        ids, labels = _batch(step, world)
        mine = slice(rank * BATCH, (rank + 1) * BATCH)
        opt.zero_grad()
        with sync.sync_on_this_backward():
            REFERENCE_MODELS["gpt"].loss(model(ids[mine]), labels[mine]).backward()
        opt.step()
        sched.step()
    sync.remove_hooks()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("world", [2, 4])
def test_zero1_with_dp_sync_equals_global_batch_training(world: int) -> None:
    ref_params, _ = _plain_run("adamw", world)
    for params in run_on_ranks(world, _zero_with_dp, "adamw"):
        for name, ref in ref_params.items():
            assert_tensors_close(params[name], ref, name=name)


def _checkpoint_round_trip() -> tuple[bool, bool, str]:
    def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
        for step in steps:
            ids, labels = _batch(step)
            opt.zero_grad()
            REFERENCE_MODELS["gpt"].loss(model(ids), labels).backward()
            opt.step()

    model = build_reference("gpt", seed=1)
    opt = ZeroOptimizer(_groups(model), _adamw)
    train(model, opt, range(2))
    shard = copy.deepcopy(opt.state_dict())  # like torch optimizers, state_dict() shares live tensors
    full = opt.consolidate_state_dict()
    snapshot = {n: p.detach().clone() for n, p in model.named_parameters()}
    train(model, opt, range(2, 3))
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}

    results = []
    for how in ("shard", "full"):
        model2 = build_reference("gpt", seed=1)
        with torch.no_grad():
            for n, p in model2.named_parameters():
                p.copy_(snapshot[n])
        opt2 = ZeroOptimizer(_groups(model2), _adamw)
        if how == "shard":
            opt2.load_state_dict(shard)
        else:
            opt2.load_full_state_dict(full)
        train(model2, opt2, range(2, 3))
        results.append(all(torch.equal(p, expected[n]) for n, p in model2.named_parameters()))
    # A shard from another rank is refused with a message naming the mismatch.
    wrong = dict(shard, dp_rank=(shard["dp_rank"] + 1) % shard["dp_size"])
    try:
        opt.load_state_dict(wrong)
        message = ""
    except ValueError as err:
        message = str(err)
    return results[0], results[1], message


def test_zero1_checkpoint_round_trip() -> None:
    for shard_ok, full_ok, message in run_on_ranks(2, _checkpoint_round_trip):
        assert shard_ok and full_ok
        assert "dp_rank" in message and "consolidate_state_dict" in message


def test_full_state_dict_loads_into_plain_optimizer() -> None:
    # The consolidated form is a plain optimizer's state dict: plain AdamW can resume from it.
    ref_params, ref_state = _plain_run("adamw", 1)
    _, state, _ = run_on_ranks(2, _zero_same_grads, "adamw")[0]
    model = build_reference("gpt", seed=1)
    opt = _adamw(_groups(model))
    opt.load_state_dict(state)
    _assert_state_equal(opt.state_dict(), ref_state, exact=True)


@settings(max_examples=60, deadline=None)
@given(numels=st.lists(st.integers(1, 10_000), min_size=1, max_size=40), shards=st.integers(1, 8))
def test_partition_properties(numels: list[int], shards: int) -> None:
    owners = partition_parameters(numels, shards)
    assert len(owners) == len(numels) and all(0 <= o < shards for o in owners)
    loads = [sum(n for n, o in zip(numels, owners, strict=True) if o == s) for s in range(shards)]
    # Largest-first greedy: the spread between shards never exceeds the largest parameter.
    assert max(loads) - min(loads) <= max(numels)
    assert owners == partition_parameters(list(numels), shards)
