"""merak-tp's autograd functions carry the autocast state of their forward into backward.

[Note: autocast in backward] (merak_tp.collectives): on CUDA, autograd runs backward on its device
thread, outside the caller's ``torch.autocast``. The CPU emulation: forward under
``torch.autocast("cpu", bfloat16)``, backward *outside* it. Without the decorators a bf16 output
gradient meets a float32 weight in the backward matmul and fails; with them the gradients match
the unsharded model's (run the same way) within bf16 tolerance.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import merak_tp
from merak_tp import _linear_fns, collectives, loss, overlap
from tests.support.dist import run_on_ranks


def _autograd_functions() -> list[type]:
    found = []
    for module in (collectives, overlap, _linear_fns, loss):
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, torch.autograd.Function) and obj.__module__ == module.__name__:
                found.append(obj)
    return found


def test_every_tp_autograd_function_is_decorated() -> None:
    functions = _autograd_functions()
    assert len(functions) >= 10
    for fn in functions:
        assert getattr(fn.forward, "_merak_amp", None) == "forward", fn.__qualname__
        assert getattr(fn.backward, "_merak_amp", None) == "backward", fn.__qualname__


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def _grads(model: nn.Module, x: torch.Tensor, tp_loss: bool, group: object | None) -> dict[str, torch.Tensor]:
    """Forward under CPU bf16 autocast, backward outside it (as autograd's device thread runs it)."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x)
        labels = torch.arange(y.shape[0] * y.shape[1]).reshape(y.shape[:2]) % 8
        if tp_loss:
            value = merak_tp.vocab_parallel_cross_entropy(y, labels, group=group)
        else:
            value = F.cross_entropy(y.float().reshape(-1, 8), labels.reshape(-1))
    assert y.dtype == torch.bfloat16
    value.backward()  # outside autocast
    return {
        n: merak_tp.gather_tensor(p.grad, like=p, group=group) if group is not None else p.grad
        for n, p in model.named_parameters()
    }


def amp_body(mode: str, chunks: int) -> bool:
    import torch.distributed as dist

    group = dist.group.WORLD
    torch.manual_seed(0)
    ref = nn.Sequential(_MLP())
    model = copy.deepcopy(ref)
    x = torch.randn(4, 6, 8)
    expected = _grads(ref, x, False, None)
    if mode == "layers":
        mlp = model[0]
        mlp.fc1 = merak_tp.ColumnParallelLinear.from_linear(
            mlp.fc1, group=group, overlap_chunks=chunks, gather_output=False
        )
        mlp.fc2 = merak_tp.RowParallelLinear.from_linear(mlp.fc2, group=group, overlap_chunks=chunks)
    else:  # a sub-pipelined region (block-level overlap)
        plan = merak_tp.TPPlan(name="amp_mlp", layers={"0.fc1": "column", "0.fc2": "row"}, regions=("0",))
        merak_tp.parallelize(model, plan, group=group, overlap_chunks=chunks)
        _grads(model, x, False, group)  # the region's probe call
        model.zero_grad(set_to_none=True)
    got = _grads(model, x, False, group)
    for name, g in expected.items():
        assert got[name].dtype == torch.float32, (name, got[name].dtype)
        torch.testing.assert_close(got[name], g, rtol=3e-2, atol=3e-3, msg=lambda m, n=name: f"{n}: {m}")
    return True


def vocab_loss_body() -> bool:
    import torch.distributed as dist

    group = dist.group.WORLD
    torch.manual_seed(0)
    ref = _MLP()
    model = copy.deepcopy(ref)
    model.fc2 = merak_tp.ColumnParallelLinear.from_linear(model.fc2, group=group, gather_output=False)
    x = torch.randn(4, 6, 8)
    expected = _grads(ref, x, False, None)
    got = _grads(model, x, True, group)
    for name, g in expected.items():
        torch.testing.assert_close(got[name], g, rtol=3e-2, atol=3e-3, msg=lambda m, n=name: f"{n}: {m}")
    return True


@pytest.mark.parametrize(("mode", "chunks"), [("layers", 1), ("layers", 2), ("region", 2)])
def test_backward_outside_autocast_matches_unsharded(mode: str, chunks: int) -> None:
    assert run_on_ranks(2, amp_body, mode, chunks) == [True, True]


def test_vocab_parallel_loss_backward_outside_autocast() -> None:
    assert run_on_ranks(2, vocab_loss_body) == [True, True]
