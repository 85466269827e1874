"""Leaves that run torch.distributed collectives (as tensor-parallel layers do).

On meta tensors the collectives are skipped during shape and cost propagation,
so a meta-built model with such leaves partitions without a process group; on
2 gloo ranks with real tensors, the partitioned chain equals the model itself
(outputs and every gradient, float64), for both tracers.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from merak_graph import empty_init, is_meta_module, partition
from tests.support.compare import assert_grads_match, assert_tensors_close, named_grads
from tests.support.dist import run_on_ranks


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def, override]
        out = x.clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def, override]
        return g


class RowParallelLike(nn.Module):
    """A row-parallel-style linear: local matmul, then an all-reduce in a custom autograd Function."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim, dim) / dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _AllReduceSum.apply(torch.nn.functional.linear(x, self.weight))


class TPNet(nn.Module):
    def __init__(self, dim: int = 8, depth: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(RowParallelLike(dim) for _ in range(depth))
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(depth))
        self.out = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block, norm in zip(self.blocks, self.norms, strict=True):
            x = x + block(norm(x))
        return self.out(x)


@pytest.mark.parametrize("method", ["fx", "export"])
def test_meta_model_with_collective_leaves_partitions_without_a_process_group(method: str) -> None:
    assert not dist.is_initialized()
    with empty_init():
        model = TPNet()
    x = torch.zeros(4, 8, device="meta")
    part = partition(model, 2, example_inputs=(x,), leaf_modules=(RowParallelLike,), trace_method=method)
    leaves = [n.target for n in part.graph_module.graph.nodes if n.op == "call_module"]
    assert [t for t in leaves if str(t).startswith("blocks")] == [f"blocks.{i}" for i in range(4)]
    assert sum(len(s) for s in part.stages) == len(part.shards)
    assert is_meta_module(model)


def _ranks_body(method: str) -> tuple[float, float]:
    torch.manual_seed(0)
    model = TPNet().double()
    x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(dist.get_rank()))
    model.zero_grad(set_to_none=True)
    ref = model(x)
    ref.square().sum().backward()
    ref_grads = named_grads(model)
    part = partition(model, 3, example_inputs=(x,), leaf_modules=(RowParallelLike,), trace_method=method)
    stages = [part.build_stage(i, device="cpu", state_dict=model.state_dict()) for i in range(3)]
    values: tuple[torch.Tensor, ...] = (x,)
    for stage in stages:
        out = stage(*values)
        values = out if isinstance(out, tuple) else (out,)
    out = values[0]
    out.square().sum().backward()
    grads: dict[str, torch.Tensor] = {}
    for i, stage in enumerate(stages):
        for local, p in stage.named_parameters():
            grads[part.stage_parameter_names(i)[local]] = p.grad
    assert_tensors_close(out.detach(), ref.detach(), name=f"rank {dist.get_rank()} output")
    assert_grads_match(grads, ref_grads)
    return float(out.sum()), float(ref.sum())


@pytest.mark.parametrize("method", ["fx", "export"])
def test_collective_leaves_on_two_ranks_match_the_model(method: str) -> None:
    results = run_on_ranks(2, _ranks_body, method)
    assert len(results) == 2
    for got, expected in results:
        assert got == expected
