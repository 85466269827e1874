"""Adapter dropout under tensor parallelism draws the single process's masks ([Note: adapter dropout under
TP] in merak_core.lora.layer), at tp = 2 against one process in float64.

A column -> gelu -> row block, both linears wrapped with LoRA (dropout 0.3, B nonzero so the adapters
count), runs forward and backward from the same generator state on every TP rank and in the one-process
reference (the same block of ``nn.Linear``s with whole adapters): the output, the input gradient and
every adapter gradient equal the reference's (each rank's block of it), with plain TP, with sequence
parallelism (the column layer's input split along the sequence) and for a row layer that splits a
whole input itself. Before the fix each rank drew the mask of its own block of a split input from the
same generator state: every block got the same mask, which no single process draws.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests.support.compare import assert_tensors_close
from tests.support.dist import run_on_ranks

P, R, SCALE, SEED = 0.3, 2, 1.5, 9


def _wrap(base: nn.Module, kind: str, a_full: torch.Tensor, b_full: torch.Tensor, tp: int, rank: int) -> Any:
    from merak_core.lora.apply import _adapters
    from merak_core.lora.layer import LoraLinear
    from merak_tp.shard_spec import get_shard_spec

    a, b = _adapters(base, kind, R)  # type: ignore[arg-type]
    with torch.no_grad():
        a.copy_(get_shard_spec(a).slice(a_full, tp, rank))
        b.copy_(get_shard_spec(b).slice(b_full, tp, rank))
    return LoraLinear(base, a, b, kind=kind, scaling=SCALE, dropout=P)  # type: ignore[arg-type]


def _adapter_values(row_in: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    shapes = ((R, 6), (8, R), (R, row_in), (6, R))
    return [torch.randn(*shape, generator=g, dtype=torch.float64) for shape in shapes]


def _run(col: nn.Module, row: nn.Module, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(SEED)  # the generator state every TP rank shares (the Trainer seeds them alike)
    y = row(nn.functional.gelu(col(x)))
    (y * w).sum().backward()
    return y


def dropout_body(mode: str) -> bool:
    import torch.distributed as dist

    import merak_tp

    group = dist.group.WORLD
    tp, rank = dist.get_world_size(), dist.get_rank()
    sp = mode == "sp"
    g = torch.Generator().manual_seed(1)
    x_full = torch.randn(2, 4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    w_full = torch.randn(2, 4, 6, generator=g, dtype=torch.float64)
    row_in = 6 if mode == "row_splits" else 8
    a1, b1, a2, b2 = _adapter_values(row_in)

    torch.manual_seed(5)
    ref_col = nn.Linear(6, 8).double()
    torch.manual_seed(6)
    ref_row = nn.Linear(row_in, 6).double()
    col_ref = _wrap(ref_col, "plain", a1, b1, 1, 0).train()
    row_ref = _wrap(ref_row, "plain", a2, b2, 1, 0).train()
    if mode == "row_splits":  # a row layer alone, splitting its whole input itself
        col_ref = nn.Identity()
    y_ref = _run(col_ref, row_ref, x_full, w_full)

    torch.manual_seed(5)
    col_base = merak_tp.ColumnParallelLinear(6, 8, group=group, sequence_parallel=sp).double()
    torch.manual_seed(6)
    row_kw: dict[str, Any] = dict(sequence_parallel=sp, input_is_parallel=mode != "row_splits")
    row_base = merak_tp.RowParallelLinear(row_in, 6, group=group, **row_kw).double()
    for p in (*col_base.parameters(), *row_base.parameters()):
        p.requires_grad_(False)
    col = _wrap(col_base, "column", a1, b1, tp, rank).train()
    row = _wrap(row_base, "row", a2, b2, tp, rank).train()
    x = (x_full.detach().chunk(tp, dim=1)[rank] if sp else x_full.detach()).requires_grad_(True)
    w = w_full.chunk(tp, dim=1)[rank] if sp else w_full
    y = _run(nn.Identity() if mode == "row_splits" else col, row, x, w)

    y_want = y_ref.chunk(tp, dim=1)[rank] if sp else y_ref
    assert_tensors_close(y, y_want, rtol=1e-12, atol=1e-12, name=f"{mode} output")
    x_grad = x_full.grad.chunk(tp, dim=1)[rank] if sp else x_full.grad
    assert_tensors_close(x.grad, x_grad, rtol=1e-12, atol=1e-12, name=f"{mode} input gradient")
    from merak_tp.shard_spec import get_shard_spec

    pairs = [(row, row_ref)] if mode == "row_splits" else [(col, col_ref), (row, row_ref)]
    for mine, ref in pairs:
        for part in ("lora_A", "lora_B"):
            p, q = getattr(mine, part).weight, getattr(ref, part).weight
            want = get_shard_spec(p).slice(q.grad, tp, rank)
            assert_tensors_close(p.grad, want, rtol=1e-12, atol=1e-12, name=f"{mode} {part} gradient")
    return True


@pytest.mark.parametrize("mode", ["tp", "sp", "row_splits"])
def test_adapter_dropout_at_tp2_draws_one_process_masks(mode: str) -> None:
    assert run_on_ranks(2, dropout_body, mode) == [True, True]
