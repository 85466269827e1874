"""The split backward's weight-gradient groups ([Note: weight-gradient groups] in merak_pipe/_split_backward.py):
sibling linears run in one ``W`` call, a chain does not, and ``I`` + ``W`` equals a full backward."""

from __future__ import annotations

import copy

import torch
from torch import nn

from merak_pipe._split_backward import _WeightPlan
from merak_pipe.stage import PipelineStage
from tests.support.compare import assert_tensors_close


class _Block(nn.Module):
    """Three sibling linears on one input (an attention block's q, k, v), then a chain of two."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(6, 6).double() for _ in range(3))
        self.up, self.down = nn.Linear(6, 8).double(), nn.Linear(8, 6).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.q(x) * torch.sigmoid(self.k(x)) + self.v(x)
        return self.down(torch.tanh(self.up(y)))


def test_siblings_share_a_weight_call_and_a_chain_does_not() -> None:
    torch.manual_seed(0)
    block = _Block()
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    out = block(x)
    plan = _WeightPlan([out], [torch.ones_like(out)], [x], list(block.parameters()))
    assert not plan.fallback
    name = {id(p): n.split(".")[0] for n, p in block.named_parameters()}
    groups = [sorted({name[id(p)] for b in g for p in plan.boundaries[b][1]}) for g in plan.groups]
    assert ["k", "q", "v"] in groups  # one torch.autograd.grad for the three siblings
    assert ["down"] in groups and ["up"] in groups  # a chain: down's input path holds up's weights


def test_grouped_split_backward_equals_full_backward() -> None:
    torch.manual_seed(1)
    block = _Block()
    x = torch.randn(3, 6, dtype=torch.float64)
    grad = torch.randn(3, 6, dtype=torch.float64)
    results = []
    for split in (False, True):
        module = copy.deepcopy(block)
        stage = PipelineStage(module, stage_index=1, num_stages=3)
        stage.forward(0, (x.clone().requires_grad_(True),), {})
        if split:
            (dx,) = stage.backward_input(0, [grad])
            stage.backward_weight(0)
        else:
            (dx,) = stage.backward(0, [grad])
        results.append((dx, {n: p.grad for n, p in module.named_parameters()}))
    (dx_ref, ref), (dx, got) = results
    assert_tensors_close(dx, dx_ref, name="input grad")
    for n, g in ref.items():
        assert_tensors_close(got[n], g, name=f"grad[{n}]")
