"""``training.moe_capacity_factor`` ([Note: expert capacity]) in transformers' own MoE blocks, against one process.

The reference is written here, independently of merak_core: transformers' own experts forward with the
routing weight of every dropped (token, choice) pair set to zero, the dropped pairs chosen by the rule:
each expert keeps its first ``ceil(c * n * k / E)`` pairs by token (the block's rows: batch, then
position), then by choice, over the ``n`` tokens of the dispatch (the EP group's microbatch, EP ranks in
order). A zero weight removes the pair's output and every gradient through it, as a drop does.

- ep=1, no process group: Mixtral's experts module with Merak's capacity gives the reference's output and
  gradients (tokens, routing weights, both fused parameters), pairs really dropped (float64);
- three SGD steps of Mixtral at dp2·ep2, and at one rank (ep=1), with a factor that drops pairs, equal the
  reference on the global batch in the loader's order (losses, every parameter after the steps); Qwen3-MoE
  and DeepSeek-V3 (a shared expert that still sees every token, grouped routing) at dp2·ep2 too; Mixtral
  at dp2·ep2·pp2 and ep=1·pp2 with two microbatches (the capacity per EP group and microbatch); float32;
- the refusals of a capacity Merak cannot apply: fused experts whose forward it cannot reproduce, and
  ep=1 with tp > 1 (the plan splits each expert over TP).
"""

from __future__ import annotations

import copy
import math
from fractions import Fraction
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.e2e.test_expert_parallel_hf import ATOL, BATCH, LR, RTOL, VOCAB, Tokens, _args, _model, _sgd
from tests.support.dist import run_on_ranks

pytest.importorskip("transformers")
pytestmark = pytest.mark.transformers

FACTOR, STEPS, EXPERTS = 0.75, 3, 4


def kept_pairs(experts_nk: torch.Tensor, num_experts: int, factor: float) -> torch.Tensor:
    """``[n, k]`` bools: the pairs each expert keeps, its first ``ceil(factor * n * k / E)`` in row-major order."""
    n, k = experts_nk.shape
    capacity = math.ceil(Fraction(str(factor)) * n * k / num_experts)
    seen = [0] * num_experts
    keep = torch.zeros(n * k, dtype=torch.bool)
    for i, e in enumerate(experts_nk.reshape(-1).tolist()):
        seen[e] += 1
        keep[i] = seen[e] <= capacity
    return keep.reshape(n, k)


def capped_reference(model: torch.nn.Module, factor: float, drops: list[int]) -> None:
    """Every fused experts module of ``model`` runs its own forward with the dropped pairs' weights zeroed."""
    for module in model.modules():
        if type(module).__name__.endswith("Experts") and hasattr(module, "gate_up_proj"):
            own = module.forward

            def capped(h: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, _own: Any = own) -> torch.Tensor:
                keep = kept_pairs(idx, EXPERTS, factor)
                drops.append(int((~keep).sum()))
                return _own(h, idx, w * keep.to(w.dtype))

            module.forward = capped


# ---------------------------------------------------------------------------- one process


def test_fused_experts_drop_exactly_the_rule_at_ep1() -> None:
    from merak_core.parallel.expert_hf import set_fused_capacity

    model = _model("mixtral").double()
    reference = model.model.layers[0].mlp.experts
    merak = copy.deepcopy(reference)
    set_fused_capacity(merak, FACTOR, ep=1)
    assert type(merak).__name__ == "EPMixtralExperts"
    g = torch.Generator().manual_seed(11)
    n = 10
    x = torch.randn(n, 32, generator=g, dtype=torch.float64)
    experts = torch.tensor([[0, 1]] * 6 + [[1, 2], [3, 0], [2, 1], [0, 3]])  # experts 0 and 1 over capacity
    w = torch.rand(n, 2, generator=g, dtype=torch.float64)
    c = torch.randn(n, 32, generator=g, dtype=torch.float64)
    keep = kept_pairs(experts, EXPERTS, FACTOR)  # capacity ceil(0.75 * 10 * 2 / 4) = 4
    assert int((~keep).sum()) == 8  # experts 0 and 1: 8 pairs each

    def run(module: torch.nn.Module, weights: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        xs, ws = x.clone().requires_grad_(True), weights.clone().requires_grad_(True)
        out = module(xs, experts, ws * keep if module is reference else ws)
        (out * c).sum().backward()
        grads = {"x": xs.grad, "w": ws.grad, **{name: p.grad for name, p in module.named_parameters()}}
        return out.detach(), grads

    want_out, want = run(reference, w)
    got_out, got = run(merak, w)
    torch.testing.assert_close(got_out, want_out, rtol=1e-12, atol=1e-13)
    assert set(got) == set(want) == {"x", "w", "gate_up_proj", "down_proj"}
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-12, atol=1e-13, msg=name)
    assert torch.all(got["w"][~keep] == 0) and torch.all(got["w"][keep] != 0)  # the dropped pairs, exactly
    dropless = reference(x, experts, w)
    assert not torch.allclose(dropless, got_out)


# ---------------------------------------------------------------------------- Trainer


def _train_capped(family: str, overrides: dict[str, Any]) -> tuple[list[float], Any, list[list[int]]]:
    import torch.distributed as dist

    from merak_core import Trainer

    args = _args(moe_capacity_factor=FACTOR, max_steps=STEPS, **overrides)
    trainer = Trainer(_model(family), args, Tokens(), optimizer_factory=_sgd)
    history = trainer.train()
    state = trainer.full_state_dict()
    # One step per epoch (BATCH samples): step s reads epoch s's order, DP rank r the r-th part of it.
    orders = [trainer.train_loader.epoch_permutation(s).tolist() for s in range(STEPS)]
    losses = [h["loss"] for h in history if "loss" in h]
    return losses, state if dist.get_rank() == 0 else None, orders


def _reference(
    family: str, orders: list[list[int]], dp: int, microbatches: int
) -> tuple[list[float], dict[str, torch.Tensor], int]:
    """One process on each step's batch in the loader's order: DP rank r reads the r-th part of the order,
    and microbatch j of the EP group (here every DP rank) is the j-th part of each rank's, in rank order;
    gradients accumulate over the microbatches."""
    model = _model(family)
    drops: list[int] = []
    capped_reference(model, FACTOR, drops)
    ids = Tokens().ids
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    per_rank = BATCH // dp
    per_micro = per_rank // microbatches
    for order in orders:
        opt.zero_grad()
        step_loss = 0.0
        for j in range(microbatches):
            batch = ids[
                [order[r * per_rank + j * per_micro + i] for r in range(dp) for i in range(per_micro)]
            ]
            logits = model(input_ids=batch[:, :-1]).logits
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1)) / microbatches
            loss.backward()
            step_loss += loss.item()
        opt.step()
        losses.append(step_loss)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, sum(drops)


_PP2 = {"pp": 2, "gradient_accumulation_steps": 2}
CASES = {  # family, ranks, overrides, (dp, microbatches)
    "mixtral-dp2-ep2": ("mixtral", 2, {"ep": 2}, (2, 1)),
    "mixtral-ep1": ("mixtral", 1, {"ep": 1, "per_device_train_batch_size": BATCH}, (1, 1)),
    "qwen3_moe-dp2-ep2": ("qwen3_moe", 2, {"ep": 2}, (2, 1)),
    "deepseek_v3-dp2-ep2": ("deepseek_v3", 2, {"ep": 2}, (2, 1)),
    # the fused experts a trace leaf in a stage; the capacity per EP group and microbatch
    "mixtral-dp2-ep2-pp2": ("mixtral", 4, {"ep": 2, "per_device_train_batch_size": 1, **_PP2}, (2, 2)),
    "mixtral-ep1-pp2": ("mixtral", 2, {"ep": 1, "per_device_train_batch_size": 2, **_PP2}, (1, 2)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_trainer_with_capacity_equals_one_process(case: str) -> None:
    family, ranks, overrides, (dp, microbatches) = CASES[case]
    results = run_on_ranks(ranks, _train_capped, family, overrides)
    losses, params, drops = _reference(family, results[0][2], dp, microbatches)
    assert drops > 0  # the capacity really dropped pairs
    state = results[0][1]
    assert state is not None and set(state) == set(params)
    for got_losses, _, _ in results:
        assert got_losses == pytest.approx(losses, rel=RTOL)
    for name, value in params.items():
        torch.testing.assert_close(state[name], value, rtol=RTOL, atol=ATOL, msg=name)


# ---------------------------------------------------------------------------- refusals


def test_capacity_refusals() -> None:
    from merak_core.parallel.expert_parallel import check_ep_model

    model = _model("mixtral")
    check_ep_model(model, _args(moe_capacity_factor=FACTOR))  # accepted at ep=1 and ep=2
    check_ep_model(model, _args(moe_capacity_factor=FACTOR, ep=2))
    with pytest.raises(ValueError, match=r"moe_capacity_factor=0.75 with tp=2 at ep=1: the TP plan splits"):
        check_ep_model(model, _args(moe_capacity_factor=FACTOR, tp=2))
    model.model.layers[1].mlp.experts.has_bias = True
    with pytest.raises(
        ValueError, match=r"MixtralExperts at 'model.layers.1.mlp.experts' cannot apply a capacity"
    ):
        check_ep_model(model, _args(moe_capacity_factor=FACTOR))
