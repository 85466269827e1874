"""DP gradient sync on the device's terms: float32 reduction of bf16 gradients, AVG where the backend
has it, and no bucket memory kept between steps ([Note: reduction precision and memory]).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from merak_core.parallel.data_parallel import DataParallelGradSync
from tests.support.dist import run_on_ranks


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to(dtype)


def _rank_grads(model: nn.Module, rank: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    return {n: torch.randn(p.shape, generator=gen).to(p.dtype) for n, p in model.named_parameters()}


def bf16_body(reduce_dtype: Any) -> dict[str, Any]:
    """Average bf16 gradients; compare with the exact (float64) average rounded once to bf16."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model = _model(torch.bfloat16)
    sync = DataParallelGradSync(model, None, reduce_dtype=reduce_dtype)
    mine = _rank_grads(model, rank)
    exact = {n: sum(_rank_grads(model, r)[n].double() for r in range(world)) / world for n in mine}
    for n, p in model.named_parameters():
        p.grad = mine[n].clone()
    sync.sync()
    equal = all(torch.equal(p.grad, exact[n].to(torch.bfloat16)) for n, p in model.named_parameters())
    return {
        "bucket_dtypes": sorted({str(b.dtype) for b in sync.buckets}),
        "exact": equal,
        "grad_dtypes": sorted({str(p.grad.dtype) for p in model.parameters()}),
    }


def test_bf16_gradients_are_reduced_in_float32() -> None:
    results = run_on_ranks(4, bf16_body, None)
    for r in results:
        assert r["bucket_dtypes"] == ["torch.float32"]
        assert r["grad_dtypes"] == ["torch.bfloat16"]
        assert r["exact"], "float32 reduction of 4 bf16 gradients must equal the exact average rounded once"


def test_bf16_reduction_in_bf16_is_not_exact() -> None:
    """The same data reduced in bf16 (the old default) misses the exact average: the test above has teeth."""
    results = run_on_ranks(4, bf16_body, torch.bfloat16)
    assert results[0]["bucket_dtypes"] == ["torch.bfloat16"]
    assert not results[0]["exact"]


def memory_body(dtype: torch.dtype, steps: int) -> dict[str, Any]:
    """Bytes held by gradients and buckets between steps, over the bytes of the gradients alone."""
    model = _model(dtype)
    sync = DataParallelGradSync(model, None, bucket_size_bytes=256)
    x = torch.randn(8, 16, dtype=dtype)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = None
        with sync.sync_on_this_backward():
            model(x).sum().backward()
    storages: dict[int, int] = {}
    for p in model.parameters():
        assert p.grad is not None
        s = p.grad.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
    for b in sync.buckets:
        if b.buffer is not None:
            storages[b.buffer.untyped_storage().data_ptr()] = b.buffer.untyped_storage().nbytes()
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "held_over_grads": sum(storages.values()) / grad_bytes,
        "buckets": len(sync.buckets),
        "buffers_kept": sum(b.buffer is not None for b in sync.buckets),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_bucket_memory_kept_between_steps(dtype: torch.dtype) -> None:
    for r in run_on_ranks(2, memory_body, dtype, 3):
        assert r["buckets"] > 1
        assert r["buffers_kept"] == 0
        assert r["held_over_grads"] == pytest.approx(1.0), r  # a persistent bucket would make it 2.0


def avg_body() -> list[bool]:
    model = _model(torch.float32)
    out = []
    for backend, device in (
        ("gloo", "cpu"),
        ("nccl", "cuda"),
        ("cpu:gloo,cuda:nccl", "cuda"),
        ("cpu:gloo,cuda:nccl", "cpu"),
    ):
        sync = DataParallelGradSync(model, None)
        real = dist.get_backend
        dist.get_backend = lambda group=None, b=backend: b  # type: ignore[assignment]
        try:
            out.append(sync._collective_averages(torch.device(device)))
        finally:
            dist.get_backend = real  # type: ignore[assignment]
            sync.remove_hooks()
    return out


def test_average_in_the_collective_only_on_nccl() -> None:
    assert run_on_ranks(2, avg_body)[0] == [False, True, True, False]
