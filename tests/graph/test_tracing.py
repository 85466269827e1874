"""Tracing: leaf modules stay opaque, failures name the module and line, inputs are checked."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from merak_graph import InputMismatchError, PartitionError, TraceError, partition, trace
from tests.graph._graph_support import run_stages
from tests.support.compare import assert_grads_match, assert_tensors_close, reference_step


class _ScaleGrad(torch.autograd.Function):
    """A custom autograd Function (like a TP collective): identity forward, scaled backward."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def, override]
        return x.clone()

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def, override]
        return g * 1.0


class DataDependentLinear(nn.Module):
    """Breaks symbolic tracing: Python control flow on a tensor value, plus a custom Function."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _ScaleGrad.apply(self.linear(x))
        if y.sum() > 0:  # data-dependent branch
            return torch.relu(y)
        return torch.tanh(y)


class Net(nn.Module):
    def __init__(self, dim: int = 8, depth: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(DataDependentLinear(dim) for _ in range(depth))
        self.out = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(x)
        return self.out(x)


def _net() -> Net:
    torch.manual_seed(0)
    return Net().double()


@pytest.mark.parametrize("method", ["fx", "auto"])
def test_untraceable_module_error_names_module_and_line(method: str) -> None:
    model = _net()
    x = torch.randn(4, 8, dtype=torch.float64)
    with pytest.raises(TraceError) as info:
        trace(model, example_inputs=(x,), method=method)
    msg = str(info.value)
    assert "blocks.0" in msg and "DataDependentLinear" in msg
    assert "if y.sum() > 0" in msg
    assert "leaf_modules=(DataDependentLinear,)" in msg


@pytest.mark.parametrize("method", ["fx", "export"])
@pytest.mark.parametrize("leaf", [DataDependentLinear, "names"])
def test_leaf_modules_stay_opaque_and_partition_matches(leaf: object, method: str) -> None:
    model = _net()
    leaves = (DataDependentLinear,) if leaf is DataDependentLinear else tuple(f"blocks.{i}" for i in range(4))
    x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    gm = trace(model, example_inputs=(x,), leaf_modules=leaves, method=method)
    calls = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert [c for c in calls if str(c).startswith("blocks")] == [f"blocks.{i}" for i in range(4)]
    assert_tensors_close(gm(x), model(x), name="traced output")

    labels = torch.randn(4, 3, dtype=torch.float64)

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((out - y) ** 2).mean()

    part = partition(model, 3, example_inputs=(x,), leaf_modules=leaves, trace_method=method)
    stages = [part.build_stage(i, device="cpu", state_dict=model.state_dict()) for i in range(3)]
    ref_out, ref_loss, ref_grads = reference_step(model, (x,), labels, loss_fn)
    out, loss, grads = run_stages(part, stages, (x,), labels, loss_fn)
    assert_tensors_close(out, ref_out, name="output")
    assert_tensors_close(loss, ref_loss, name="loss")
    assert_grads_match(grads, ref_grads)
    # The leaf is one node: its parameters keep their names under the leaf's path.
    all_names = {n for i in range(3) for n in part.stage_parameter_names(i).values()}
    assert "blocks.2.linear.weight" in all_names


def test_input_mismatches_are_reported() -> None:
    model = _net()
    x = torch.randn(4, 8, dtype=torch.float64)
    with pytest.raises(InputMismatchError, match="positional"):
        trace(model, example_inputs=(x, x), leaf_modules=(DataDependentLinear,))
    with pytest.raises(InputMismatchError, match="one example value per name"):
        trace(model, example_inputs=(x,), input_names=("a", "b"), leaf_modules=(DataDependentLinear,))
    with pytest.raises(InputMismatchError, match="does not accept"):
        trace(model, example_inputs={"y": x}, leaf_modules=(DataDependentLinear,))
    part = partition(model, 2, example_inputs=(x,), leaf_modules=(DataDependentLinear,))
    with pytest.raises(InputMismatchError, match="takes 1 inputs"):
        part.run(x, x)
    with pytest.raises(InputMismatchError, match="stage takes"):
        part.stages[0](x, x)
    with pytest.raises(InputMismatchError, match="dtype"):
        part.stages[0](x.float())
    exported = partition(
        model, 2, example_inputs=(x,), leaf_modules=(DataDependentLinear,), trace_method="export"
    )
    with pytest.raises(InputMismatchError, match="shapes specialised"):
        exported.run(torch.randn(5, 8, dtype=torch.float64))
    fx_part = partition(model, 2, example_inputs=(x,), leaf_modules=(DataDependentLinear,), trace_method="fx")
    other = torch.randn(5, 8, dtype=torch.float64)
    assert_tensors_close(fx_part.run(other), model(other), name="fx graphs keep shapes symbolic")


def test_too_few_shards_and_impossible_memory_limit() -> None:
    model = _net()
    x = torch.randn(4, 8, dtype=torch.float64)
    with pytest.raises(PartitionError, match="only .* shards"):
        partition(model, 20, example_inputs=(x,), leaf_modules=(DataDependentLinear,))
    with pytest.raises(PartitionError, match="memory_limit"):
        partition(model, 2, example_inputs=(x,), leaf_modules=(DataDependentLinear,), memory_limit=100)
    with pytest.raises(ValueError, match="not one of"):
        partition(model, 2, example_inputs=(x,), method="fastest")
    with pytest.raises(ValueError, match="not a submodule"):
        trace(model, example_inputs=(x,), leaf_modules=("blocks.9",))


def test_memory_limit_shapes_the_partition() -> None:
    model = _net()
    x = torch.randn(4, 8, dtype=torch.float64)
    free = partition(model, 2, example_inputs=(x,), leaf_modules=(DataDependentLinear,))
    tight = max(free.stage_memory) * 0.999
    try:
        limited = partition(
            model, 2, example_inputs=(x,), leaf_modules=(DataDependentLinear,), memory_limit=tight
        )
    except PartitionError:
        return  # no assignment fits: also a correct answer for this limit
    assert max(limited.stage_memory) <= tight
    assert limited.bounds != free.bounds


@pytest.mark.parametrize("method", ["uniform", "parameters", "cost"])
def test_methods_give_valid_contiguous_partitions(method: str) -> None:
    model = _net()
    x = torch.randn(4, 8, dtype=torch.float64)
    part = partition(model, 3, example_inputs=(x,), leaf_modules=(DataDependentLinear,), method=method)
    assert part.bounds[0] == 0 and part.bounds[-1] == len(part.shards)
    assert_tensors_close(part.run(x), model(x), name="output")
    if method == "uniform":
        sizes = [len(s) for s in part.stages]
        assert max(sizes) - min(sizes) <= 1
