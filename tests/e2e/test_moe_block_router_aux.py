"""A protocol MoE block's router auxiliary loss ([Note: a protocol block's router aux loss]) against one process.

The reference MoE Llama with ``router_aux_loss_coef`` (Switch's load-balancing loss per block) trained 3 SGD
steps of 2 microbatches in float64 at dp2·ep2 and dp2 (ep=1): every loss and every parameter equal to one
process on each global microbatch (microbatch m of both DP ranks together), loss = cross-entropy + coef *
each block's loss over those tokens. The mean of the ranks' own block losses is not that (checked: the
test tells them apart). The refusals (pp > 1, cp > 1, recompute) and a block that records no routing.
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from tests.e2e._trainer_support import reference_microbatches
from tests.support.compare import replayable_arguments
from tests.support.dist import run_on_ranks
from tests.support.moe import MoEBlock, MoEConfig, MoELlama

SEQ, VOCAB, LR, STEPS, COEF, MICRO = 8, 96, 0.5, 3, 0.5, 2
SAMPLES = STEPS * 2 * MICRO  # dp=2, one sample per microbatch


class Tokens(Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=torch.Generator().manual_seed(5))

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i, :-1], "labels": self.ids[i, 1:].clone()}


def _model() -> MoELlama:
    torch.manual_seed(0)
    return MoELlama(MoEConfig(vocab_size=VOCAB, router_aux_loss_coef=COEF)).double()


def _args(**overrides: Any) -> Any:
    sizes = dict(
        per_device_train_batch_size=1,
        gradient_accumulation_steps=MICRO,
        learning_rate=LR,
        max_steps=STEPS,
        dtype="float64",
    )
    return replayable_arguments("merak-block-aux-", **{**sizes, **overrides})


def _sgd(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    return torch.optim.SGD(groups, lr=LR)


def _train(overrides: dict[str, Any]) -> tuple[list[float], dict[str, torch.Tensor]]:
    from merak_core import Trainer

    trainer = Trainer(_model(), _args(**overrides), Tokens(), optimizer_factory=_sgd)
    losses = [h["loss"] for h in trainer.train() if "loss" in h]
    return losses, trainer.full_state_dict()


def _blocks(model: MoELlama) -> list[MoEBlock]:
    return [layer.moe for layer in model.layers]


def _reference(per_rank: bool = False) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, each global microbatch; ``per_rank``: the mean of each DP rank's own block losses instead."""
    model, data = _model(), Tokens()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for chunks in reference_microbatches(SAMPLES, _args(), 2):  # rank 0's microbatches, then rank 1's
        opt.zero_grad()
        total = 0.0
        for m in range(MICRO):
            parts = [chunks[m], chunks[MICRO + m]] if per_rank else [chunks[m] + chunks[MICRO + m]]
            loss = torch.zeros((), dtype=torch.float64)
            for part in parts:
                ids = data.ids[part]
                logits = model(ids[:, :-1])
                ce = F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
                aux = sum(COEF * b.load_balancing_loss() for b in _blocks(model))
                loss = loss + (ce + aux) / len(parts)
            (loss / MICRO).backward()
            total += loss.item() / MICRO
        opt.step()
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("ep", [2, 1])
def test_block_router_aux_loss_equals_one_process(ep: int) -> None:
    got = run_on_ranks(2, _train, {"ep": ep})
    losses, params = _reference()
    wrong, _ = _reference(per_rank=True)
    assert all(abs(a - b) > 1e-6 for a, b in zip(losses, wrong, strict=True))  # the test tells them apart
    for rank_losses, _ in got:
        assert rank_losses == pytest.approx(losses, rel=1e-12)
    state = got[0][1]  # the full state on rank 0
    assert set(state) == set(params)
    for name, value in params.items():
        torch.testing.assert_close(state[name], value, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize(
    ("pp", "cp", "recompute", "what"),
    [(2, 1, "none", "pp=2"), (1, 2, "none", "cp=2"), (1, 1, "full", "recompute='full'")],
)
def test_refusals(pp: int, cp: int, recompute: str, what: str) -> None:
    from merak_core.parallel.router_aux import check_router_aux

    with pytest.raises(
        ValueError, match=rf"'layers.0.moe' \(MoEBlock\) adds a router auxiliary loss.*with {what}"
    ):
        check_router_aux(_model(), pp, cp, recompute)
    check_router_aux(_model(), 1, 1, "none")


def test_a_block_without_router_stats_is_refused() -> None:
    from merak_core.parallel.router_aux import with_router_aux_loss

    model = _model()
    loss_fn = with_router_aux_loss(model, lambda out, labels: out.sum(), None, {})
    model.layers[1].moe.route = lambda x: MoEBlock.route(model.layers[0].moe, x)  # type: ignore[method-assign]
    with pytest.raises(ValueError, match=r"set no router_stats"):
        loss_fn(model(torch.zeros(1, 4, dtype=torch.long)), None)


def test_job_preflight() -> None:
    """Before torchrun (merak_core.checks.router_aux): what the run refuses, one line; accepted at pp = 1."""
    from types import SimpleNamespace

    from merak_core import TrainingArguments
    from merak_core.checks.base import PreflightError
    from merak_core.checks.router_aux import check_router_aux_job

    def job(**kw: Any) -> Any:
        return SimpleNamespace(training=TrainingArguments(output_dir=tempfile.mkdtemp(), **kw))

    with pytest.raises(PreflightError, match=r"with recompute='full' it cannot.*set recompute: none"):
        check_router_aux_job(job(recompute="full"), _model())
    with pytest.raises(PreflightError, match=r"with pp=2 it cannot.*set pp: 1"):
        check_router_aux_job(job(pp=2, gradient_accumulation_steps=2), _model())
    assert check_router_aux_job(job(ep=2), _model()) == [
        "router aux loss of 2 MoE block(s) over the global microbatch: counts summed over DP"
    ]
    assert check_router_aux_job(job(pp=2), MoELlama(MoEConfig(vocab_size=VOCAB))) == []
