"""Expert-parallel dispatch (merak_core.parallel.expert_parallel.dispatch) at ep=2 against one process in float64.

Each rank routes its own tokens by a fixed, uneven routing (rank 0 sends four times more rows to one
expert than to another, expert 3 is chosen by no token at all, rank 1 sends nothing to rank 0's
experts in one case); the outputs, the gradients of the tokens and of the routing weights, and every
expert's weight gradient equal those of one process running the whole MoE block on both ranks' tokens.
Also the EP groups of the layout (pure rank arithmetic and the real groups) and the refusals.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.support.dist import run_on_ranks
from tests.support.moe import MoEBlock

HIDDEN, INNER, EXPERTS, TOP_K = 8, 6, 4, 2

# (tokens, experts_nk) per rank: expert 3 unused everywhere; uneven counts.
ROUTINGS = {
    "uneven": (
        [[0, 1], [0, 2], [0, 1], [1, 0], [2, 0], [0, 1]],
        [[2, 1], [1, 0], [2, 1]],
    ),
    "one_rank_only": (  # rank 1 routes everything to rank 1's expert 2; rank 0 sends 0 rows to rank 1
        [[0, 1], [1, 0]],
        [[2, 2], [2, 2], [2, 2], [2, 2]],
    ),
}


def _block() -> MoEBlock:
    torch.manual_seed(0)
    return MoEBlock(HIDDEN, INNER, EXPERTS, TOP_K).double()


def _rank_data(rank: int, case: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    experts_nk = torch.tensor(ROUTINGS[case][rank])
    g = torch.Generator().manual_seed(11 + rank)
    n = experts_nk.size(0)
    x = torch.randn(n, HIDDEN, generator=g, dtype=torch.float64)
    w = torch.rand(n, TOP_K, generator=g, dtype=torch.float64)
    c = torch.randn(n, HIDDEN, generator=g, dtype=torch.float64)  # the loss is sum(out * c)
    return x, w, experts_nk, c


def _ep_worker(case: str) -> dict[str, torch.Tensor]:
    import torch.distributed as dist

    from merak_core.parallel.expert_parallel import apply_expert_parallel
    from merak_core.parallel.layout import ParallelLayout

    layout = ParallelLayout.build(dp=2, ep=2, device="cpu")
    assert layout.ep_ranks == [0, 1] and layout.expert_replica_ranks == [layout.rank]
    block = _block()
    apply_expert_parallel(block, layout)
    x, w, experts_nk, c = _rank_data(dist.get_rank(), case)
    x.requires_grad_(True)
    w.requires_grad_(True)
    out = block.run_experts(x, w, experts_nk)
    (out * c).sum().backward()
    result = {"out": out.detach(), "x.grad": x.grad, "w.grad": w.grad}
    for name, p in block.experts.named_parameters():
        result[f"experts.{name}"] = p.grad if p.grad is not None else torch.zeros_like(p)
    return result


@pytest.mark.parametrize("case", sorted(ROUTINGS))
def test_dispatch_ep2_equals_one_process(case: str) -> None:
    results = run_on_ranks(2, _ep_worker, case)
    block = _block()
    data = [_rank_data(r, case) for r in range(2)]
    x = torch.cat([d[0] for d in data]).requires_grad_(True)
    w = torch.cat([d[1] for d in data]).requires_grad_(True)
    out = block.run_experts(x, w, torch.cat([d[2] for d in data]))
    (out * torch.cat([d[3] for d in data])).sum().backward()
    assert x.grad is not None and w.grad is not None
    sizes = [d[0].size(0) for d in data]
    for rank, (lo, n) in enumerate(zip([0, sizes[0]], sizes, strict=True)):
        got = results[rank]
        torch.testing.assert_close(got["out"], out.detach()[lo : lo + n], rtol=1e-12, atol=1e-13)
        torch.testing.assert_close(got["x.grad"], x.grad[lo : lo + n], rtol=1e-12, atol=1e-13)
        torch.testing.assert_close(got["w.grad"], w.grad[lo : lo + n], rtol=1e-12, atol=1e-13)
    expert_grads = {k: v for r in results for k, v in r.items() if k.startswith("experts.")}
    assert len(expert_grads) == len([n for n, _ in block.experts.named_parameters()])
    for name, p in block.experts.named_parameters():
        torch.testing.assert_close(expert_grads[f"experts.{name}"], p.grad, rtol=1e-12, atol=1e-13, msg=name)


def _groups_worker() -> tuple[list[int], list[int], int]:
    from merak_core.parallel.layout import ParallelLayout

    layout = ParallelLayout.build(dp=4, ep=2, device="cpu")
    import torch.distributed as dist

    assert dist.get_process_group_ranks(layout.ep_group) == layout.ep_ranks
    assert dist.get_process_group_ranks(layout.expert_replica_group) == layout.expert_replica_ranks
    return layout.ep_ranks, layout.expert_replica_ranks, layout.ep_rank


def test_ep_groups_carved_from_dp() -> None:
    got = run_on_ranks(4, _groups_worker)
    assert got == [
        ([0, 1], [0, 2], 0),
        ([0, 1], [1, 3], 1),
        ([2, 3], [0, 2], 0),
        ([2, 3], [1, 3], 1),
    ]


def _args(**kw: object) -> SimpleNamespace:
    base: dict[str, object] = dict(ep=2, dp=2, zero_stage=0, virtual_stages=1, cp=1, max_grad_norm=0.0)
    base.update(kw)
    return SimpleNamespace(**base)


@pytest.mark.parametrize(
    ("overrides", "lora", "words"),
    [
        ({"dp": 3}, None, "ep=2 does not divide dp=3"),
        ({"virtual_stages": 2}, None, "virtual_stages=2"),
        ({"cp": 2}, None, "cp=2"),
        ({}, object(), "LoRA"),
        ({"ep": 3, "dp": 3}, None, "does not divide the 4 experts"),
    ],
)
def test_refusals(overrides: dict[str, object], lora: object, words: str) -> None:
    from merak_core.parallel.expert_parallel import check_ep_model

    with pytest.raises(ValueError, match=words):
        check_ep_model(_block(), _args(**overrides), lora=lora)


def test_layout_auto_with_ep_is_accepted() -> None:
    """The planner keeps or replaces the job's ep (it was refused: "the planner does not choose ep yet"); the
    job's dp, cp and virtual stages are replaced with it, so they are not held against the job's ep."""
    from merak_core import TrainingArguments
    from merak_core.parallel.expert_parallel import check_ep_model

    check_ep_model(_block(), _args(layout="auto", dp=None))
    check_ep_model(_block(), _args(layout="auto", dp=3, cp=2, virtual_stages=2))
    assert TrainingArguments(layout="auto", ep=2).ep == 2
    with pytest.raises(ValueError, match="LoRA"):  # what the model refuses at the job's ep still is
        check_ep_model(_block(), _args(layout="auto"), lora=object())


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_zero_stages_are_accepted(zero_stage: int) -> None:
    """ZeRO-1/2/3 shard the experts over their replica group (zero_experts; refused at 2 and 3 before)."""
    from merak_core.parallel.expert_parallel import check_ep_model

    check_ep_model(_block(), _args(zero_stage=zero_stage))


def test_refuses_a_model_without_moe_block() -> None:
    from merak_core.parallel.expert_parallel import check_ep_model

    with pytest.raises(ValueError, match="no mixture-of-experts block"):
        check_ep_model(torch.nn.Linear(2, 2), _args())


def test_refuses_a_foreign_moe_block_by_name() -> None:
    """A mixture-of-experts block that is neither the protocol nor transformers' fused experts is named
    (transformers' Mixtral, Qwen3-MoE and DeepSeek-V3 blocks are sharded: tests/core/test_expert_hf_checks.py)."""
    from merak_core.parallel.expert_parallel import check_ep_model

    class SwitchMoE(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(4))

    with pytest.raises(ValueError, match=r"SwitchMoE at '0' is a mixture-of-experts block.*set ep: 1"):
        check_ep_model(torch.nn.Sequential(SwitchMoE()), _args())


def test_accepts_a_block_with_a_router_aux_loss() -> None:
    """Added over the global microbatch at any ep (tests/e2e/test_moe_block_router_aux.py)."""
    from merak_core.parallel.expert_parallel import check_ep_model

    block = _block()
    block.router_aux_loss_coef = 0.01
    check_ep_model(block, _args())


def test_generation_refused_at_ep2() -> None:
    from merak_core.generation.run_api import check_run_options

    with pytest.raises(ValueError, match="ep=2: generation is not supported.*generate with ep: 1"):
        check_run_options(_args(), pp=1)
    check_run_options(_args(ep=1), pp=1)


def test_refuses_a_block_whose_expert_count_disagrees() -> None:
    from merak_core.parallel.expert_parallel import check_ep_model

    block = _block()
    block.num_experts = 6
    with pytest.raises(ValueError, match="num_experts=6 but holds 4 experts"):
        check_ep_model(block, _args())
