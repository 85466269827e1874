"""DataParallelGradSync against single-process references (float64, every gradient by name).

- GPT / Llama with gradient accumulation: the DP-averaged gradient after the
  overlapped bucketed all-reduce equals the gradient of the same model on the
  concatenated global batch in one process;
- data-dependent control flow: ranks use different parameters in different
  orders, some parameters are unused everywhere; the result equals the average of
  each rank's single-process gradient (zeros for the unused ones);
- overlap really happens: buckets are launched from the hooks during backward.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from merak_core.parallel.data_parallel import DataParallelGradSync, allreduce_gradients_per_parameter
from tests.support.compare import assert_grads_match, assert_tensors_close
from tests.support.dist import run_on_ranks
from tests.support.models import REFERENCE_MODELS, build_reference

PER_RANK_BATCH = 2
SEQ = 8
NUM_MICROBATCHES = 2


def _global_batch(name: str, world: int, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    ref = REFERENCE_MODELS[name]
    batch = world * PER_RANK_BATCH * NUM_MICROBATCHES
    return ref.make_inputs(batch, SEQ, seed)[0], ref.make_labels(batch, SEQ, seed)


def _reference_grads(name: str, world: int) -> tuple[float, dict[str, torch.Tensor]]:
    ref = REFERENCE_MODELS[name]
    model = build_reference(name, seed=11)
    ids, labels = _global_batch(name, world)
    loss = ref.loss(model(ids), labels)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _dp_grads(
    name: str, mode: str, bucket_size_bytes: int
) -> tuple[float, dict[str, torch.Tensor], int, int]:
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = REFERENCE_MODELS[name]
    model = build_reference(name, seed=11)
    ids, labels = _global_batch(name, world)
    # Rank r's shard of the global batch: rows [r*b*m, (r+1)*b*m), then cut into microbatches.
    rows = PER_RANK_BATCH * NUM_MICROBATCHES
    my_ids, my_labels = ids[rank * rows : (rank + 1) * rows], labels[rank * rows : (rank + 1) * rows]
    sync = DataParallelGradSync(model, None, bucket_size_bytes=bucket_size_bytes)
    total = torch.zeros((), dtype=torch.float64)
    if mode == "step":  # a pipeline-style driver: arm once for all microbatches of the step
        sync.prepare_step(NUM_MICROBATCHES)
    for mb in range(NUM_MICROBATCHES):
        sl = slice(mb * PER_RANK_BATCH, (mb + 1) * PER_RANK_BATCH)
        loss = ref.loss(model(my_ids[sl]), my_labels[sl]) / NUM_MICROBATCHES
        total += loss.detach()
        if mb < NUM_MICROBATCHES - 1 or mode in ("blocking", "step"):
            loss.backward()
        else:
            with sync.sync_on_this_backward():
                loss.backward()
    if mode == "blocking":
        sync.sync()
    elif mode == "step":
        sync.finish()
    dist.all_reduce(total)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    sync.remove_hooks()
    return total.item() / world, grads, len(sync.buckets), sync.buckets_launched_in_backward


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name,mode", [("gpt", "overlap"), ("llama", "overlap"), ("gpt", "step")])
def test_overlapped_bucketed_allreduce_matches_global_batch(world: int, name: str, mode: str) -> None:
    ref_loss, ref_grads = _reference_grads(name, world)
    results = run_on_ranks(world, _dp_grads, name, mode, 4096)
    for rank, (loss, grads, num_buckets, early) in enumerate(results):
        assert_tensors_close(torch.tensor(loss), torch.tensor(ref_loss), name=f"loss rank {rank}")
        assert_grads_match(grads, ref_grads)
        assert num_buckets > 4, "small buckets should give many buckets"
        # Overlap: all but the buckets that wait for the very first layers were launched by hooks.
        assert early >= num_buckets - 1, (early, num_buckets)


@pytest.mark.parametrize("bucket_size_bytes", [1, 1 << 30])
def test_blocking_sync_and_bucket_extremes(bucket_size_bytes: int) -> None:
    ref_loss, ref_grads = _reference_grads("gpt", 2)
    results = run_on_ranks(2, _dp_grads, "gpt", "blocking", bucket_size_bytes)
    num_params = len(ref_grads)
    for loss, grads, num_buckets, early in results:
        assert_tensors_close(torch.tensor(loss), torch.tensor(ref_loss), name="loss")
        assert_grads_match(grads, ref_grads)
        assert num_buckets == (num_params if bucket_size_bytes == 1 else 1)
        assert early == 0  # sync() launches everything after backward


# ---------------------------------------------------------------------------- control flow


class _Branchy(nn.Module):
    """Six linears; which ones run, and in which order, depends on ``route``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.layers = nn.ModuleList(nn.Linear(6, 6).double() for _ in range(6))

    def forward(self, x: torch.Tensor, route: list[int]) -> torch.Tensor:
        for i in route:
            x = torch.tanh(self.layers[i](x))
        return x.pow(2).sum()


def _route(rank: int) -> list[int]:
    # Different ranks touch different parameters in different orders; layer 5 is never used.
    return [[0, 3, 1], [2, 0, 4], [4, 1], [3, 2, 0, 1]][rank % 4]


def _branchy_input(rank: int) -> torch.Tensor:
    return torch.randn(3, 6, generator=torch.Generator().manual_seed(100 + rank), dtype=torch.float64)


def _branchy_dp(bucket_size_bytes: int) -> dict[str, torch.Tensor]:
    rank = dist.get_rank()
    model = _Branchy()
    sync = DataParallelGradSync(model, None, bucket_size_bytes=bucket_size_bytes)
    with sync.sync_on_this_backward():
        model(_branchy_input(rank), _route(rank)).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    # A second armed step reuses the buckets: grads are accumulated (not zeroed) and re-averaged.
    with sync.sync_on_this_backward():
        model(_branchy_input(rank), _route(rank)).backward()
    again = {n: p.grad.clone() for n, p in model.named_parameters()}
    sync.remove_hooks()
    return {**grads, **{f"again.{n}": g for n, g in again.items()}}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("bucket_size_bytes", [100, 400])
def test_any_grad_order_and_unused_params(world: int, bucket_size_bytes: int) -> None:
    expected: dict[str, torch.Tensor] = {}
    per_rank = []
    for rank in range(world):
        model = _Branchy()
        model(_branchy_input(rank), _route(rank)).backward()
        per_rank.append(
            {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
        )
    for n in per_rank[0]:
        expected[n] = sum(g[n] for g in per_rank) / world
        # Second step: every rank holds avg + own grad, the average of which is 2 * avg.
        expected[f"again.{n}"] = 2 * expected[n]
    assert torch.count_nonzero(expected["layers.5.weight"]) == 0
    for grads in run_on_ranks(world, _branchy_dp, bucket_size_bytes):
        assert_grads_match(grads, expected)


def _second_backward_raises() -> str:
    model = _Branchy()
    sync = DataParallelGradSync(model, None, bucket_size_bytes=1 << 20)
    x = _branchy_input(0)
    sync.prepare_last_microbatch()
    model(x, [0, 1]).backward()
    try:
        model(x, [0, 1]).backward()
    except RuntimeError as err:
        message = str(err)
    else:
        message = ""
    sync._abort()
    sync.remove_hooks()
    return message


def test_second_backward_while_armed_is_an_error() -> None:
    for message in run_on_ranks(2, _second_backward_raises):
        assert "received more gradients than the 1 backward(s)" in message and "layers.1." in message


def _naive_baseline() -> dict[str, torch.Tensor]:
    rank = dist.get_rank()
    model = _Branchy()
    model(_branchy_input(rank), _route(rank)).backward()
    allreduce_gradients_per_parameter(model.parameters())
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_per_parameter_baseline_matches_bucketed() -> None:
    bucketed = run_on_ranks(2, _branchy_dp, 64)
    naive = run_on_ranks(2, _naive_baseline)
    for b, n in zip(bucketed, naive, strict=True):
        assert_grads_match(n, {k: v for k, v in b.items() if not k.startswith("again.")})


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="bucket_size_bytes must be a positive integer, got 0"):
        DataParallelGradSync(nn.Linear(2, 2), None, bucket_size_bytes=0)


def _bf16_sync() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[torch.dtype]]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Linear(8, 4).to(torch.bfloat16)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(10 + rank)).to(torch.bfloat16)
    model(x).float().pow(2).sum().backward()
    local = {n: p.grad.clone() for n, p in model.named_parameters()}
    sync = DataParallelGradSync(model, None, reduce_dtype=torch.float32)
    sync.sync()
    synced = {n: p.grad.clone() for n, p in model.named_parameters()}
    dtypes = [b.dtype for b in sync.buckets]
    sync.remove_hooks()
    return local, synced, dtypes


def test_bf16_grads_reduced_in_float32() -> None:
    results = run_on_ranks(2, _bf16_sync)
    for _, synced, dtypes in results:
        assert dtypes == [torch.float32]
        for name, grad in synced.items():
            assert grad.dtype == torch.bfloat16
            # Two summands: the float32 sum is exact up to rounding once, then halved and cast.
            expected = ((results[0][0][name].float() + results[1][0][name].float()) / 2).to(torch.bfloat16)
            assert torch.equal(grad, expected), name


def _deferred(defer: bool) -> tuple[dict[str, torch.Tensor], list[list[str]]]:
    rank = dist.get_rank()
    model = _Branchy()
    tied = model.layers[0].weight
    sync = DataParallelGradSync(
        model, None, bucket_size_bytes=1 << 20, deferred_params=[tied] if defer else ()
    )
    sync.prepare_step(1)
    model(_branchy_input(rank), [0, 1, 2]).backward()
    # What a pipeline runner does to a tied parameter after its backwards: add the other
    # stage's copy (here: a rank-dependent tensor) before the DP sync finishes.
    tied.grad.add_(torch.full_like(tied, float(rank + 1)))
    sync.finish()
    names = sync.bucket_names()
    sync.remove_hooks()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, names


def test_deferred_params_are_reduced_from_their_final_gradient() -> None:
    per_rank = []
    for rank in range(2):
        model = _Branchy()
        model(_branchy_input(rank), [0, 1, 2]).backward()
        model.layers[0].weight.grad.add_(torch.full_like(model.layers[0].weight, float(rank + 1)))
        per_rank.append(
            {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
        )
    expected = {n: (per_rank[0][n] + per_rank[1][n]) / 2 for n in per_rank[0]}
    for grads, names in run_on_ranks(2, _deferred, True):
        assert names[-1] == ["layers.0.weight"]  # its own bucket, launched last
        assert_grads_match(grads, expected)
    # Without deferral the late change is lost: the test above can fail.
    grads, _ = run_on_ranks(2, _deferred, False)[0]
    assert not torch.allclose(grads["layers.0.weight"], expected["layers.0.weight"])


def _manual_accumulation() -> tuple[dict[str, torch.Tensor], int]:
    rank = dist.get_rank()
    model = _Branchy()
    sync = DataParallelGradSync(model, None, bucket_size_bytes=8)
    sync.prepare_step(1)
    params = list(model.parameters())
    grads = torch.autograd.grad(model(_branchy_input(rank), [5, 4, 3, 2, 1, 0]), params, allow_unused=True)
    used = []
    for p, g in zip(params, grads, strict=True):
        if g is not None:
            p.grad = g if p.grad is None else p.grad + g
            used.append(p)
    sync.notify_grad_ready(used)  # no autograd hook fired: tell the sync by hand
    early = sync.buckets_launched_in_backward
    sync.finish()
    sync.remove_hooks()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, early


def test_notify_grad_ready_for_hand_accumulated_grads() -> None:
    per_rank = []
    for rank in range(2):
        model = _Branchy()
        model(_branchy_input(rank), [5, 4, 3, 2, 1, 0]).backward()
        per_rank.append({n: p.grad for n, p in model.named_parameters()})
    expected = {n: (per_rank[0][n] + per_rank[1][n]) / 2 for n in per_rank[0]}
    for grads, early in run_on_ranks(2, _manual_accumulation):
        assert_grads_match(grads, expected)
        assert early >= 1


def _peer_skips_step() -> str:
    from datetime import timedelta

    from merak_core.parallel.layout import ParallelLayout

    layout = ParallelLayout.build(2, 1, 1, device="cpu", timeout=timedelta(seconds=2))
    model = _Branchy()
    sync = DataParallelGradSync(model, layout.dp_group, bucket_size_bytes=1 << 20)
    message = ""
    if layout.rank == 0:  # rank 1 never runs its step: rank 0 must fail with a clear error, not hang
        try:
            with sync.sync_on_this_backward():
                model(_branchy_input(0), [0, 1, 2, 3, 4, 5]).backward()
        except RuntimeError as err:
            message = str(err)
    sync.remove_hooks()
    dist.barrier()  # on the default group: both ranks leave together
    return message


def test_missing_peer_is_an_error_not_a_hang() -> None:
    message = run_on_ranks(2, _peer_skips_step)[0]
    assert "rank 0: DP gradient all-reduce of bucket 0 of 1" in message and "peer" in message
