"""PipelineStage in one process (no process group): split backward, recompute, boundary values."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from merak_pipe.comm import flatten_boundary, spec_metas, unflatten_boundary
from merak_pipe.runner import _split_batch
from merak_pipe.stage import PipelineStage
from tests.pipe._runtime_support import build_model, model_units, split_units
from tests.support.compare import assert_tensors_close


def _middle_stage(fraction_units: int = 0) -> tuple[nn.Sequential, tuple[torch.Tensor, ...]]:
    """Stage 1 of a 3-stage Llama split: input (x, cos, sin) with x requiring grad."""
    model = build_model("llama", num_layers=4)
    stage = split_units(model_units("llama", model), 3)[1]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 32, dtype=torch.float64, generator=g)
    cos, sin = model.rope_cos[:5].double(), model.rope_sin[:5].double()
    return stage, (x, cos, sin)


def _run(
    stage_module: nn.Module,
    inputs: tuple[torch.Tensor, ...],
    *,
    split: bool,
    fraction: float,
    recompute_first: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    stage = PipelineStage(stage_module, stage_index=1, num_stages=3)
    args = tuple(t.clone().requires_grad_(i == 0) for i, t in enumerate(inputs))
    out, _ = stage.forward(0, args, {}, recompute_fraction=fraction)
    g = torch.Generator().manual_seed(5)
    grad_out = [torch.randn(out[0].shape, dtype=torch.float64, generator=g)]
    if recompute_first:
        stage.recompute(0)
    if split:
        (dx,) = stage.backward_input(0, grad_out)
        assert all(p.grad is None for p in stage_module.parameters()), "I must not touch parameter grads"
        stage.backward_weight(0)
    else:
        (dx,) = stage.backward(0, grad_out)
    assert stage.pending_microbatches() == []
    return dx, {n: p.grad.clone() for n, p in stage_module.named_parameters()}


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("recompute_first", [False, True])
def test_split_backward_equals_full_backward(fraction: float, recompute_first: bool) -> None:
    module, inputs = _middle_stage()
    dx_ref, grads_ref = _run(copy.deepcopy(module), inputs, split=False, fraction=0.0)
    dx, grads = _run(
        copy.deepcopy(module), inputs, split=True, fraction=fraction, recompute_first=recompute_first
    )
    assert_tensors_close(dx, dx_ref, name="input grad")
    for name, ref in grads_ref.items():
        assert_tensors_close(grads[name], ref, name=f"grad[{name}]")


def test_split_backward_runs_only_parameter_branches() -> None:
    from merak_pipe._split_backward import _WeightPlan
    from merak_pipe.stage import _run_units

    module, inputs = _middle_stage()
    x = inputs[0].clone().requires_grad_(True)
    out = _run_units(list(module), (x, inputs[1], inputs[2]), {})[0]
    plan = _WeightPlan([out], [torch.ones_like(out)], [x], [p for p in module.parameters()])
    assert not plan.fallback
    covered = {id(p) for _, params in plan.boundaries for p in params}
    assert covered == {id(p) for p in module.parameters()}  # every weight is reached from a boundary


def test_weight_used_twice_falls_back_and_stays_exact() -> None:
    from merak_pipe._split_backward import _WeightPlan

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4).double()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.lin(torch.tanh(self.lin(x))))

    torch.manual_seed(0)
    module = Twice()
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    out = module(x)
    assert _WeightPlan([out], [torch.ones_like(out)], [x], list(module.parameters())).fallback
    results = []
    for split in (False, True):
        m = copy.deepcopy(module)
        stage = PipelineStage(m, stage_index=1, num_stages=3)
        y, _ = stage.forward(0, (x.detach().clone().requires_grad_(True),), {})
        grad = [torch.ones_like(y)]
        dx = stage.backward_input(0, grad)[0] if split else stage.backward(0, grad)[0]
        if split:
            stage.backward_weight(0)
        results.append((dx, m.lin.weight.grad.clone(), m.lin.bias.grad.clone()))
    for a, b in zip(*results, strict=True):
        assert_tensors_close(a, b, name="twice")


def test_boundary_round_trip_with_constants() -> None:
    t = torch.arange(6.0).reshape(2, 3).requires_grad_(True)
    value = {"h": t, "meta": (3, "x", None, 1.5, True), "ids": [torch.tensor([1, 2])]}
    spec, tensors = flatten_boundary(value)
    assert [m.requires_grad for m in spec_metas(spec)] == [True, False]
    rebuilt = unflatten_boundary(spec, tensors)
    assert rebuilt["meta"] == (3, "x", None, 1.5, True) and rebuilt["h"] is t
    with pytest.raises(TypeError, match="string keys"):
        flatten_boundary({1: t})
    with pytest.raises(TypeError, match="object"):
        flatten_boundary(object())


def test_split_batch_checks_sizes() -> None:
    parts = _split_batch({"a": torch.arange(8), "k": 3}, 4, "inputs")
    assert [p["a"].tolist() for p in parts] == [[0, 1], [2, 3], [4, 5], [6, 7]] and parts[0]["k"] == 3
    with pytest.raises(ValueError, match="batch size 6, not divisible into 4 microbatches"):
        _split_batch(torch.zeros(6, 2), 4, "inputs")
    with pytest.raises(ValueError, match="fewer than the schedule's 4 microbatches"):
        _split_batch((torch.zeros(2),), 4, "inputs")


def test_stage_rejects_bad_indices() -> None:
    with pytest.raises(ValueError, match="stage_index=2 is outside 0..1"):
        PipelineStage(nn.Linear(2, 2), stage_index=2, num_stages=2)
    with pytest.raises(ValueError, match="empty"):
        PipelineStage(nn.Sequential(), stage_index=0, num_stages=2)
