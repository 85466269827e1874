"""The foundations composed: DP sync + TP-aware clipping + ZeRO-1 + LR schedule on DP/TP subgroups.

A two-layer MLP is tensor-parallel by hand, Megatron style (column-parallel first
linear, row-parallel second, with the two mirrored autograd collectives written
out here so this test needs no other package), replicated over DP, trained for 3
steps with 2 microbatches, the overlapped DP all-reduce, global clipping (which
must clip: the threshold is below the norm) and ZeRO-1 AdamW with warm-up and
cosine decay, all over the layout's *subgroups* (dp_group / tp_group are not the
default group). The losses and every re-assembled parameter must equal plain
single-process training on the global batch in float64.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from merak_core.config import TrainingArguments, build_lr_scheduler
from merak_core.parallel.clip import clip_grad_norm_
from merak_core.parallel.data_parallel import DataParallelGradSync
from merak_core.parallel.layout import ParallelLayout
from merak_core.parallel.zero import ZeroOptimizer
from merak_tp.shard_spec import ShardSpec, set_shard_spec
from tests.support.compare import assert_tensors_close
from tests.support.dist import run_on_ranks

IN, HIDDEN, OUT = 6, 8, 3
GLOBAL_BATCH, MICRO = 8, 2
STEPS = 3
ARGS = dict(
    learning_rate=0.05,
    lr_scheduler_type="cosine",
    warmup_steps=1,
    max_steps=STEPS,
    max_grad_norm=0.05,
    weight_decay=0.1,
    gradient_accumulation_steps=MICRO,
)


class _CopyToTP(torch.autograd.Function):
    """Identity forward, all-reduce of the input gradient over TP backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce over TP forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _full_params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    return {
        "w1": torch.randn(HIDDEN, IN, generator=g, dtype=torch.float64) * 0.5,
        "b1": torch.randn(HIDDEN, generator=g, dtype=torch.float64) * 0.1,
        "w2": torch.randn(OUT, HIDDEN, generator=g, dtype=torch.float64) * 0.5,
        "b2": torch.randn(OUT, generator=g, dtype=torch.float64) * 0.1,
    }


TP_DIMS = {"w1": 0, "b1": 0, "w2": 1, "b2": None}


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return (
        torch.randn(GLOBAL_BATCH, IN, generator=g, dtype=torch.float64),
        torch.randn(GLOBAL_BATCH, OUT, generator=g, dtype=torch.float64),
    )


def _groups(params: dict[str, nn.Parameter]) -> list[dict[str, Any]]:
    return [
        {"params": [params["w1"], params["w2"]]},
        {"params": [params["b1"], params["b2"]], "weight_decay": 0.0},
    ]


def _adamw(args: TrainingArguments) -> Any:
    return lambda groups: torch.optim.AdamW(groups, lr=args.learning_rate, weight_decay=args.weight_decay)


def _reference() -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    args = TrainingArguments(**ARGS)
    params = {n: nn.Parameter(t.clone()) for n, t in _full_params().items()}
    opt = _adamw(args)(_groups(params))
    sched = build_lr_scheduler(opt, args)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = _data(step)
        opt.zero_grad()
        out = F.linear(F.gelu(F.linear(x, params["w1"], params["b1"])), params["w2"], params["b2"])
        loss = F.mse_loss(out, y)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(params.values(), args.max_grad_norm).item())
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses, norms, {n: p.detach() for n, p in params.items()}


def _train(
    dp: int, tp: int, zero: bool
) -> tuple[tuple[int, int], list[float], list[float], dict[str, torch.Tensor]]:
    args = TrainingArguments(**ARGS, dp=dp, tp=tp, zero_stage=int(zero))
    layout = ParallelLayout.build(dp, tp, 1, device="cpu")
    params: dict[str, nn.Parameter] = {}
    for name, full in _full_params().items():
        dim = TP_DIMS[name]
        p = nn.Parameter(full.clone() if dim is None else full.chunk(tp, dim)[layout.tp_rank].clone())
        set_shard_spec(p, ShardSpec(dim))
        params[name] = p
    module = nn.Module()
    for name, p in params.items():
        module.register_parameter(name, p)
    sync = DataParallelGradSync(module, layout.dp_group, bucket_size_bytes=64)
    opt = (
        ZeroOptimizer(_groups(params), _adamw(args), group=layout.dp_group)
        if zero
        else _adamw(args)(_groups(params))
    )
    sched = build_lr_scheduler(opt, args)
    rows = GLOBAL_BATCH // dp
    losses, norms = [], []
    for step in range(STEPS):
        x, y = _data(step)
        x, y = (
            x[layout.dp_rank * rows : (layout.dp_rank + 1) * rows],
            y[layout.dp_rank * rows : (layout.dp_rank + 1) * rows],
        )
        opt.zero_grad()
        total = torch.zeros((), dtype=torch.float64)
        for i, (xm, ym) in enumerate(zip(x.chunk(MICRO), y.chunk(MICRO), strict=True)):
            h = F.gelu(F.linear(_CopyToTP.apply(xm, layout.tp_group), params["w1"], params["b1"]))
            out = _ReduceFromTP.apply(F.linear(h, params["w2"]), layout.tp_group) + params["b2"]
            loss = F.mse_loss(out, ym) / MICRO
            total += loss.detach()
            if i < MICRO - 1:
                loss.backward()
            else:
                with sync.sync_on_this_backward():
                    loss.backward()
        norms.append(clip_grad_norm_(module.parameters(), args.max_grad_norm, layout=layout).item())
        opt.step()
        sched.step()
        dist.all_reduce(total, group=layout.dp_group)
        losses.append(total.item() / dp)
    sync.remove_hooks()
    return (layout.dp_rank, layout.tp_rank), losses, norms, {n: p.detach() for n, p in params.items()}


@pytest.mark.parametrize("dp,tp", [(2, 2), (2, 1), (1, 2)])
@pytest.mark.parametrize("zero", [True, False])
def test_composed_training_equals_single_process(dp: int, tp: int, zero: bool) -> None:
    ref_losses, ref_norms, ref_params = _reference()
    assert all(n > ARGS["max_grad_norm"] for n in ref_norms)  # clipping is active every step
    results = run_on_ranks(dp * tp, _train, dp, tp, zero)
    for (d, t), losses, norms, _ in results:
        assert_tensors_close(torch.tensor(losses), torch.tensor(ref_losses), name=f"losses dp{d} tp{t}")
        assert_tensors_close(torch.tensor(norms), torch.tensor(ref_norms), name=f"grad norms dp{d} tp{t}")
    for d in range(dp):
        shards = [r[3] for r in results if r[0][0] == d]
        for name, ref in ref_params.items():
            dim = TP_DIMS[name]
            got = shards[0][name] if dim is None else torch.cat([s[name] for s in shards], dim=dim)
            assert_tensors_close(got, ref, name=f"{name} on dp rank {d}")
