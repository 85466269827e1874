"""Expert-parallel training (training.ep) of the reference MoE Llama against one process in float64.

Two Trainer steps (SGD, no clipping or decay) of a tiny MoE Llama (4 experts, top-2 softmax routing,
weights normalised) at dp=2 x ep=2 (2 ranks) and dp=2 x ep=2 x pp=2 (4 ranks), against the same model
trained by one process on the whole batch: both steps' losses and every parameter (dense and expert)
after the two steps, so both steps' gradients, the second with the routing the first step changed.
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from tests.support.compare import replayable_arguments
from tests.support.dist import run_on_ranks
from tests.support.moe import MoEConfig, MoELlama

SEQ, VOCAB, BATCH, LR, STEPS = 8, 96, 4, 0.5, 2


class Tokens(Dataset):
    """``BATCH`` random sequences (every label counts: the DP ranks' losses are means over equal counts)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)

    def __len__(self) -> int:
        return BATCH

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i, :-1], "labels": self.ids[i, 1:].clone()}


def _model(routing: str = "mixtral") -> MoELlama:
    torch.manual_seed(0)
    return MoELlama(MoEConfig(vocab_size=VOCAB, routing=routing)).double()


def _args(**overrides: Any) -> Any:
    sizes = dict(
        per_device_train_batch_size=BATCH // 2,
        learning_rate=LR,
        max_steps=STEPS,
        dtype="float64",
    )
    return replayable_arguments("merak-ep-", **{**sizes, **overrides})


def _sgd(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    return torch.optim.SGD(groups, lr=LR)


def _train(
    overrides: dict[str, Any], routing: str = "mixtral"
) -> tuple[list[float], dict[str, torch.Tensor] | None]:
    import torch.distributed as dist

    from merak_core import Trainer

    trainer = Trainer(_model(routing), _args(**overrides), Tokens(), optimizer_factory=_sgd)
    history = trainer.train()
    state = trainer.full_state_dict()
    return [h["loss"] for h in history if "loss" in h], state if dist.get_rank() == 0 else None


def _reference(
    max_norm: float = 0.0, routing: str = "mixtral"
) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _model(routing)
    data = Tokens()
    ids = torch.stack([data[i]["input_ids"] for i in range(BATCH)])
    labels = torch.stack([data[i]["labels"] for i in range(BATCH)])
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = F.cross_entropy(model(ids).reshape(-1, VOCAB), labels.reshape(-1))
        loss.backward()
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _check(results: list[tuple[list[float], Any]], max_norm: float = 0.0, routing: str = "mixtral") -> None:
    losses, params = _reference(max_norm, routing)
    state = results[0][1]
    assert state is not None
    assert set(state) == set(params)
    for got_losses, _ in results:
        assert got_losses == pytest.approx(losses, rel=1e-12)
    for name, value in params.items():
        torch.testing.assert_close(state[name], value, rtol=1e-10, atol=1e-12, msg=name)


def test_dp2_ep2_equals_one_process() -> None:
    _check(run_on_ranks(2, _train, {"ep": 2}))


def test_dp2_ep2_clipped_equals_one_process() -> None:
    """Clipping at a norm below the gradient's: each expert's term is counted once (summed over the EP group)."""
    _check(run_on_ranks(2, _train, {"ep": 2, "max_grad_norm": 0.05}), max_norm=0.05)


@pytest.mark.parametrize("schedule", ["auto", "zb_h1"])
def test_dp2_ep2_pp2_equals_one_process(schedule: str) -> None:
    """1F1B, and ZB-H1 (split backward: the all-to-alls' backward in the input-gradient pass)."""
    overrides = {"ep": 2, "pp": 2, "per_device_train_batch_size": 1, "gradient_accumulation_steps": 2}
    _check(run_on_ranks(4, _train, {**overrides, "schedule": schedule}))


def _resume_pair(save_ep: int, resume_ep: int) -> dict[str, Any]:
    """3 AdamW steps at ``save_ep`` saving every step; a fresh Trainer at ``resume_ep`` resumes step_1, trains to 3."""
    import torch.distributed as dist

    from merak_core import Trainer

    out_dir = tempfile.mkdtemp(prefix="merak-ep-resume-") if dist.get_rank() == 0 else ""
    shared = [out_dir]
    dist.broadcast_object_list(shared, src=0)
    common = dict(output_dir=shared[0], max_steps=3, save_steps=1, learning_rate=0.01)
    full = Trainer(_model(), _args(ep=save_ep, **common), Tokens())
    full_losses = [h["loss"] for h in full.train() if "loss" in h]
    full_state = full.full_state_dict()
    dist.barrier()
    resumed = Trainer(_model(), _args(ep=resume_ep, **common), Tokens())
    step = resumed.resume("step_1")
    losses = [h["loss"] for h in resumed.train() if "loss" in h]
    final_state = resumed.full_state_dict()
    return {"step": step, "full": (full_losses, full_state), "resumed": (losses, final_state)}


@pytest.mark.parametrize(("save_ep", "resume_ep"), [(2, 2), (2, 1), (1, 2)])
def test_resume_at_another_ep(save_ep: int, resume_ep: int) -> None:
    """Experts are saved by their global names: a checkpoint of ep=2 resumes at ep=2 bit for bit, at ep=1
    (the same two ranks, every expert on each) to rounding, and one of ep=1 resumes at ep=2."""
    got = run_on_ranks(2, _resume_pair, save_ep, resume_ep)[0]
    assert got["step"] == 1
    full_losses, full_state = got["full"]
    losses, final_state = got["resumed"]
    assert len(full_losses) == 3 and len(losses) == 2
    exact = resume_ep == save_ep
    assert losses == (full_losses[1:] if exact else pytest.approx(full_losses[1:], rel=1e-12))
    assert set(final_state) == set(full_state)
    for name, value in full_state.items():
        if exact:
            assert torch.equal(final_state[name], value), name
        else:
            torch.testing.assert_close(final_state[name], value, rtol=1e-10, atol=1e-12, msg=name)


def test_dp2_ep2_tp2_equals_one_process() -> None:
    """Attention, embedding and head TP-sharded, experts whole on each EP rank (the EP groups within a TP rank)."""
    _check(run_on_ranks(4, _train, {"ep": 2, "tp": 2, "max_grad_norm": 0.05}), max_norm=0.05)


def test_dp4_ep4_equals_one_process() -> None:
    """One expert per rank; four ranks' tokens meet at each."""
    _check(run_on_ranks(4, _train, {"ep": 4, "per_device_train_batch_size": 1}))


def test_dp2_ep2_pp2_recompute_equals_one_process() -> None:
    """Full recomputation: each stage's forward (its dispatch and all-to-alls) runs again in backward."""
    overrides = {
        "ep": 2,
        "pp": 2,
        "per_device_train_batch_size": 1,
        "gradient_accumulation_steps": 2,
        "recompute": "full",
    }
    _check(run_on_ranks(4, _train, overrides))


def test_dp4_ep2_equals_one_process() -> None:
    """Two EP groups: each expert's gradient is summed over its replica group (2 ranks) and divided by dp=4."""
    _check(
        run_on_ranks(4, _train, {"ep": 2, "per_device_train_batch_size": 1, "max_grad_norm": 0.05}),
        max_norm=0.05,
    )


def test_deepseek_routing_dp2_ep2_pp2_equals_one_process() -> None:
    """DeepSeek-V3 routing (sigmoid, grouped, bias for the choice, scaled) with a shared expert, at dp2·ep2·pp2."""
    overrides = {"ep": 2, "pp": 2, "per_device_train_batch_size": 1, "gradient_accumulation_steps": 2}
    _check(run_on_ranks(4, _train, overrides, "deepseek"), routing="deepseek")
