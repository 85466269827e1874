"""Opaque leaves under torch.export return tensors and None in any tuple/list/dict structure.

A transformers attention returns ``(attn_output, None)``; an overlapped TP region
wrapping it returns the same. The traced graph and a 2-stage partition must equal
the eager model (output, loss, every gradient), and a leaf returning a value that is
neither a tensor nor None is refused with its position and type.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from merak_graph import TraceError, partition, trace
from tests.graph._graph_support import run_stages
from tests.support.compare import assert_grads_match, assert_tensors_close, reference_step


class WithNone(nn.Module):
    """Returns ``(y, None)`` like a transformers attention without attention weights, after a data-dependent
    branch (so it must stay a leaf)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        y = self.linear(x)
        return (torch.relu(y) if y.sum() > 0 else torch.tanh(y)), None


class Nested(nn.Module):
    """Returns a dict holding a None and a nested tuple: the tensors are read by their paths."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.a = nn.Linear(dim, dim)
        self.b = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> dict[str, object]:
        if x.sum() > 1e9:  # data-dependent
            x = x * 0
        return {"skip": None, "pair": (None, self.b(x), self.a(x))}


class Net(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.first = WithNone(dim)
        self.second = Nested(dim)
        self.out = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        y, _ = self.first(x)
        x = x + y
        pair = self.second(x)["pair"]
        return self.out(x + pair[1] * pair[2])


class ReturnsInt(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        return x * 2, int(x.shape[0])


def test_leaf_with_none_and_nested_outputs_traces_and_partitions_exactly() -> None:
    torch.manual_seed(0)
    model = Net().double()
    x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    leaves = (WithNone, Nested)
    gm = trace(model, example_inputs=(x,), leaf_modules=leaves, method="export")
    assert {str(n.target) for n in gm.graph.nodes if n.op == "call_module"} >= {"first", "second"}
    assert_tensors_close(gm(x), model(x), name="traced output", rtol=0, atol=0)

    labels = torch.randn(4, 3, dtype=torch.float64)

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((out - y) ** 2).mean()

    part = partition(
        model, 2, example_inputs=(x,), leaf_modules=leaves, trace_method="export", split_points=["second"]
    )
    stages = [part.build_stage(i, device="cpu", state_dict=model.state_dict()) for i in range(2)]
    ref_out, ref_loss, ref_grads = reference_step(model, (x,), labels, loss_fn)
    out, loss, grads = run_stages(part, stages, (x,), labels, loss_fn)
    assert_tensors_close(out, ref_out, name="output")
    assert_tensors_close(loss, ref_loss, name="loss")
    assert_grads_match(grads, ref_grads)


def test_leaf_returning_a_non_tensor_value_is_refused() -> None:
    model = nn.Sequential(nn.Linear(4, 4), ReturnsInt())
    with pytest.raises(TraceError, match=r"leaf module '1' returns non-tensor values \[\(1, 'int'\)\]"):
        trace(model, example_inputs=(torch.randn(2, 4),), leaf_modules=(ReturnsInt,), method="export")
