"""``training.moe_capacity_factor`` ([Note: expert capacity]) against one process in float64.

The reference is written here, independently of merak_core: a block whose experts each take their first
``ceil(c * n * k / E)`` (token, choice) pairs in position order over the ``n`` tokens it is given, the rest
contributing zero. Merak's dispatch with a capacity equals it on one process (ep=1, no group) and at ep=2
on the two ranks' tokens concatenated in rank order (outputs and every gradient); two Trainer steps at
dp2·ep2 and at one rank equal one process on the global batch (losses, every parameter), with pairs
really dropped. Plus the capacity arithmetic and the refusals (arguments, and a job before torchrun).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from merak_core.parallel.moe_capacity import check_capacity_factor, expert_capacity
from tests.e2e.test_expert_parallel import BATCH, STEPS, VOCAB, Tokens, _args, _model
from tests.support.dist import run_on_ranks
from tests.support.moe import MoEBlock

HIDDEN, INNER, EXPERTS, TOP_K = 8, 6, 4, 2


class CappedReference(MoEBlock):
    """``MoEBlock`` with the capacity rule, computed directly: per expert, the pairs in (token, choice) order."""

    capacity_factor = 1.0

    def run_experts(
        self, x_nh: torch.Tensor, weights_nk: torch.Tensor, experts_nk: torch.Tensor
    ) -> torch.Tensor:
        n, k = experts_nk.shape
        capacity = math.ceil(round(self.capacity_factor * n * k / self.num_experts, 9))
        out_nh = torch.zeros_like(x_nh)
        for e, expert in enumerate(self.experts):
            tokens, slots = (experts_nk == e).nonzero(as_tuple=True)  # row-major: token, then choice
            tokens, slots = tokens[:capacity], slots[:capacity]
            y_nh = expert(x_nh.index_select(0, tokens)) * weights_nk[tokens, slots].unsqueeze(-1)
            out_nh = out_nh.index_add(0, tokens, y_nh)
        return out_nh


def dropped_pairs(experts_nk: torch.Tensor, factor: float) -> int:
    n, k = experts_nk.shape
    capacity = math.ceil(round(factor * n * k / EXPERTS, 9))
    counts = torch.bincount(experts_nk.reshape(-1), minlength=EXPERTS)
    return int((counts - capacity).clamp(min=0).sum())


# ---------------------------------------------------------------------------- pure


def test_capacity_arithmetic_and_refusals() -> None:
    assert expert_capacity(6, 2, 4, 1.0) == 3
    assert expert_capacity(10, 2, 4, 1.1) == 6  # 5.5 -> 6
    assert (
        expert_capacity(100, 1, 10, 1.1) == 11
    )  # exactly 11 as a decimal (float 1.1 * 10 is 11.000000000000002)
    assert expert_capacity(3, 1, 4, 0.01) == 1
    check_capacity_factor(None)
    check_capacity_factor(2)
    for bad in (0, -1.0, float("inf"), float("nan"), True, "1.0"):
        with pytest.raises(ValueError, match="moe_capacity_factor"):
            check_capacity_factor(bad)


def test_arguments_refuse_a_bad_capacity_factor() -> None:
    from merak_core import TrainingArguments

    with pytest.raises(ValueError, match=r"moe_capacity_factor=0 is invalid"):
        TrainingArguments(output_dir="/tmp/unused", moe_capacity_factor=0)


def _block_and_data(rank: int) -> tuple[MoEBlock, list[torch.Tensor]]:
    torch.manual_seed(0)
    block = CappedReference(HIDDEN, INNER, EXPERTS, TOP_K).double()
    g = torch.Generator().manual_seed(5 + rank)
    n = 7 if rank == 0 else 4  # uneven token counts: the capacity counts the EP group's tokens
    x = torch.randn(n, HIDDEN, generator=g, dtype=torch.float64)
    experts = torch.tensor([[0, 1]] * (n - 2) + [[1, 0], [2, 0]])  # expert 0 and 1 over capacity
    w = torch.rand(n, TOP_K, generator=g, dtype=torch.float64)
    c = torch.randn(n, HIDDEN, generator=g, dtype=torch.float64)  # the loss is sum(out * c)
    return block, [x, w, experts, c]


def _grads(block: torch.nn.Module, x: torch.Tensor, w: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {"x": x.grad, "w": w.grad}
    out.update(
        {n: p.grad for n, p in block.named_parameters() if ".experts." in f".{n}" and p.grad is not None}
    )
    return out


def _reference(ranks: int, factor: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    block, _ = _block_and_data(0)
    block.capacity_factor = factor
    parts = [_block_and_data(r)[1] for r in range(ranks)]
    x, w, experts, c = (torch.cat([p[i] for p in parts]) for i in range(4))
    assert dropped_pairs(experts, factor) > 0
    x.requires_grad_(True)
    w.requires_grad_(True)
    out = block.run_experts(x, w, experts)
    (out * c).sum().backward()
    return out.detach(), _grads(block, x, w)


def test_local_dispatch_with_capacity_equals_reference() -> None:
    """ep=1 (no group): Merak's dispatch with every expert local drops exactly the reference's pairs."""
    from merak_core.parallel.expert_parallel import set_moe_capacity

    factor = 0.75
    want_out, want = _reference(1, factor)
    block, (x, w, experts, c) = _block_and_data(0)
    block.__class__ = MoEBlock  # Merak's rule, not the reference's
    set_moe_capacity(block, factor, ep=1)
    x.requires_grad_(True)
    w.requires_grad_(True)
    out = block.run_experts(x, w, experts)
    (out * c).sum().backward()
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-13)
    got = _grads(block, x, w)
    assert set(got) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-12, atol=1e-13, msg=name)


# ---------------------------------------------------------------------------- two ranks


def _ep_dispatch_worker(factor: float) -> dict[str, Any]:
    import torch.distributed as dist

    from merak_core.parallel.expert_parallel import apply_expert_parallel, set_moe_capacity
    from merak_core.parallel.layout import ParallelLayout

    layout = ParallelLayout.build(dp=2, ep=2, device="cpu")
    block, (x, w, experts, c) = _block_and_data(dist.get_rank())
    block.__class__ = MoEBlock
    set_moe_capacity(block, factor, ep=2)
    apply_expert_parallel(block, layout)
    x.requires_grad_(True)
    w.requires_grad_(True)
    out = block.run_experts(x, w, experts)
    (out * c).sum().backward()
    return {"out": out.detach(), "grads": _grads(block, x, w)}


def test_ep2_dispatch_with_capacity_equals_reference() -> None:
    """Each expert keeps its first pairs over both ranks' tokens (rank 0's first): outputs, the gradients
    of the tokens and routing weights (each rank's rows of the reference's) and of every expert."""
    factor = 0.75
    want_out, want = _reference(2, factor)
    got = run_on_ranks(2, _ep_dispatch_worker, factor)
    n0 = got[0]["out"].size(0)
    rows = [slice(0, n0), slice(n0, None)]
    for rank, result in enumerate(got):
        torch.testing.assert_close(result["out"], want_out[rows[rank]], rtol=1e-12, atol=1e-13)
        for key in ("x", "w"):
            torch.testing.assert_close(result["grads"][key], want[key][rows[rank]], rtol=1e-12, atol=1e-13)
    experts = {**got[0]["grads"], **got[1]["grads"]}
    for name, value in want.items():
        if name not in ("x", "w"):
            torch.testing.assert_close(experts[name], value, rtol=1e-12, atol=1e-13, msg=name)


# ---------------------------------------------------------------------------- Trainer


FACTOR = 0.75


def _train_capped(overrides: dict[str, Any]) -> tuple[list[float], dict[str, torch.Tensor] | None, list[Any]]:
    import torch.distributed as dist

    from merak_core import Trainer

    args = _args(moe_capacity_factor=FACTOR, **overrides)
    sgd = lambda groups: torch.optim.SGD(groups, lr=args.learning_rate)  # noqa: E731
    trainer = Trainer(_model(), args, Tokens(), optimizer_factory=sgd)
    history = trainer.train()
    state = trainer.full_state_dict()
    # One step per epoch (BATCH samples): step s reads epoch s's order, rank r the r-th part of it.
    orders = [trainer.train_loader.epoch_permutation(s).tolist() for s in range(STEPS)]
    return [h["loss"] for h in history if "loss" in h], state if dist.get_rank() == 0 else None, orders


def _capped_reference(
    orders: list[list[int]], dp: int = 1, microbatches: int = 1
) -> tuple[list[float], dict[str, torch.Tensor], int]:
    """One process on each step's batch in the loader's order: DP rank r reads the r-th part of the order,
    and microbatch j of the EP group (here every DP rank) is the j-th part of each rank's, in rank order:
    the capacity keeps the first pairs of those tokens. Gradients accumulate over the microbatches."""
    model = _model()
    drops = []
    for m in model.modules():
        if type(m) is MoEBlock:
            m.__class__ = CappedReference
            m.capacity_factor = FACTOR
            m.register_forward_pre_hook(
                lambda mod, inp: drops.append(dropped_pairs(mod.route(inp[0].flatten(0, 1))[1], FACTOR))
            )
    data = Tokens()
    opt = torch.optim.SGD(model.parameters(), lr=_args().learning_rate)
    losses = []
    per_rank = BATCH // dp
    per_micro = per_rank // microbatches
    for order in orders:
        opt.zero_grad()
        step_loss = 0.0
        for j in range(microbatches):
            picked = [order[r * per_rank + j * per_micro + i] for r in range(dp) for i in range(per_micro)]
            ids = torch.stack([data[i]["input_ids"] for i in picked])
            labels = torch.stack([data[i]["labels"] for i in picked])
            loss = F.cross_entropy(model(ids).reshape(-1, VOCAB), labels.reshape(-1)) / microbatches
            loss.backward()
            step_loss += loss.item()
        opt.step()
        losses.append(step_loss)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, sum(drops)


CASES = {  # ranks, overrides, (dp, microbatches)
    "dp2-ep2": (2, {"ep": 2}, (2, 1)),  # one microbatch: the EP group's tokens are the global batch
    "ep1": (1, {"per_device_train_batch_size": BATCH}, (1, 1)),
    "dp2-ep2-pp2": (
        4,
        {"ep": 2, "pp": 2, "per_device_train_batch_size": 1, "gradient_accumulation_steps": 2},
        (2, 2),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_trainer_with_capacity_equals_one_process(case: str) -> None:
    """dp2·ep2, one rank at ep=1, and dp2·ep2·pp2 with two microbatches (the capacity per EP group and
    microbatch; the block a pipeline trace leaf)."""
    ranks, overrides, (dp, microbatches) = CASES[case]
    results = run_on_ranks(ranks, _train_capped, overrides)
    losses, params, drops = _capped_reference(results[0][2], dp, microbatches)
    assert drops > 0  # the capacity really dropped pairs
    state = results[0][1]
    assert state is not None and set(state) == set(params)
    for got_losses, _, _ in results:
        assert got_losses == pytest.approx(losses, rel=1e-12)
    for name, value in params.items():
        torch.testing.assert_close(state[name], value, rtol=1e-10, atol=1e-12, msg=name)


def test_job_refused_before_torchrun(tmp_path: Path) -> None:
    """A capacity on a model without MoE blocks, and a capacity of 0: one line, exit 2."""
    from merak_core.run.exitcodes import BAD_INPUT
    from tests.e2e.test_expert_parallel_launch import _dry_run

    for model, training, words in (
        ("build_dense", {"moe_capacity_factor": 1.25}, "moe_capacity_factor=1.25 but Llama has no"),
        ("build_moe", {"moe_capacity_factor": 0}, "is invalid: expected a number > 0"),
    ):
        status, err = _dry_run(tmp_path, model, training)
        assert status == BAD_INPUT, err
        assert len(err.strip().splitlines()) == 1, err
        assert words in err, err
    status, err = _dry_run(tmp_path, "build_moe", {"moe_capacity_factor": 1.25})
    assert status == 0, err
