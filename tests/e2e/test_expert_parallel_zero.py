"""Expert parallelism with ZeRO-1 against one process in float64.

Dense parameters are owned (optimizer states, reduce-scattered gradients) over the DP group, experts over
their expert-replica group (dp / ep ranks). Two AdamW steps of the tiny MoE Llama (so the owners' states
matter) with clipping, against one process on the whole batch: both losses and every parameter after the
two steps; and the ownership itself: over all ranks, the inner optimizers hold each dense parameter and
each expert exactly once per (dense: DP group, expert: replica group).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.e2e.test_expert_parallel import BATCH, STEPS, VOCAB, Tokens, _args, _model
from tests.support.dist import run_on_ranks

LR, MAX_NORM = 0.01, 0.05


def _adamw(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=LR, weight_decay=0.0)


def _train_zero1(overrides: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    from merak_core import Trainer

    args = _args(zero_stage=1, learning_rate=LR, max_grad_norm=MAX_NORM, **overrides)
    trainer = Trainer(_model(), args, Tokens(), optimizer_factory=_adamw)
    history = trainer.train()
    state = trainer.full_state_dict()
    names = {id(p): n for n, p in trainer.engine.model.named_parameters()}
    inner = trainer.engine.optimizer.inner  # type: ignore[attr-defined]
    owned = sorted(names[id(p)] for g in inner.param_groups for p in g["params"])
    return {
        "losses": [h["loss"] for h in history if "loss" in h],
        "state": state if dist.get_rank() == 0 else None,
        "owned": owned,
        "held": sorted(names.values()),
    }


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _model()
    data = Tokens()
    ids = torch.stack([data[i]["input_ids"] for i in range(BATCH)])
    labels = torch.stack([data[i]["labels"] for i in range(BATCH)])
    opt = _adamw([{"params": list(model.parameters())}])
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = F.cross_entropy(model(ids).reshape(-1, VOCAB), labels.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _check(results: list[dict[str, Any]], dp: int, ep: int) -> None:
    losses, params = _reference()
    state = results[0]["state"]
    assert state is not None and set(state) == set(params)
    for got in results:
        assert got["losses"] == pytest.approx(losses, rel=1e-12)
    for name, value in params.items():
        torch.testing.assert_close(state[name], value, rtol=1e-10, atol=1e-12, msg=name)
    # Ownership: a dense parameter once per DP group, an expert once per replica group (dp / ep ranks).
    owned = [n for got in results for n in got["owned"]]
    experts = {n for n in params if ".experts." in n}
    for name in params:
        assert owned.count(name) == 1, (name, owned.count(name))
    held = [n for got in results for n in got["held"]]
    assert all(held.count(n) == dp // ep for n in experts)  # each expert held by its replica group


@pytest.mark.parametrize(("dp", "ep", "pp"), [(4, 2, 1), (2, 2, 1), (2, 2, 2)])
def test_zero1_with_experts_equals_one_process(dp: int, ep: int, pp: int) -> None:
    """dp4·ep2: experts reduce-scattered and gathered over 2-rank replica groups; dp2·ep2: a replica group of
    one (the experts are not sharded further, their gradients whole on their one holder); dp2·ep2·pp2: each
    stage's parameters owned over its own groups, two microbatches."""
    overrides = {
        "ep": ep,
        "pp": pp,
        "per_device_train_batch_size": BATCH // dp // pp,
        "gradient_accumulation_steps": pp,
    }
    _check(run_on_ranks(dp * pp, _train_zero1, overrides), dp, ep)


def _resume_zero1(save: dict[str, Any], resume: dict[str, Any]) -> dict[str, Any]:
    """3 AdamW steps saving every step; a fresh Trainer (``resume``'s settings) resumes step_1, trains to 3."""
    import tempfile

    import torch.distributed as dist

    from merak_core import Trainer

    out_dir = tempfile.mkdtemp(prefix="merak-ep-zero-") if dist.get_rank() == 0 else ""
    shared = [out_dir]
    dist.broadcast_object_list(shared, src=0)
    common: dict[str, Any] = dict(output_dir=shared[0], max_steps=3, save_steps=1, learning_rate=LR)
    full = Trainer(_model(), _args(**common, **save), Tokens())
    full_losses = [h["loss"] for h in full.train() if "loss" in h]
    full_state = full.full_state_dict()
    dist.barrier()
    resumed = Trainer(_model(), _args(**common, **resume), Tokens())
    step = resumed.resume("step_1")
    losses = [h["loss"] for h in resumed.train() if "loss" in h]
    return {"step": step, "full": (full_losses, full_state), "resumed": (losses, resumed.full_state_dict())}


@pytest.mark.parametrize(
    ("save", "resume"),
    [
        ({"ep": 2, "zero_stage": 1}, {"ep": 2, "zero_stage": 1}),
        ({"ep": 2, "zero_stage": 1}, {"ep": 1, "zero_stage": 0}),
    ],
)
def test_zero1_with_experts_resumes(save: dict[str, Any], resume: dict[str, Any]) -> None:
    """The owners' AdamW states are saved by parameter name: the same layout resumes bit for bit, and ep=1
    without ZeRO (every expert and state on each rank) to rounding."""
    got = run_on_ranks(2, _resume_zero1, save, resume)[0]
    assert got["step"] == 1
    full_losses, full_state = got["full"]
    losses, final_state = got["resumed"]
    exact = save == resume
    assert losses == (full_losses[1:] if exact else pytest.approx(full_losses[1:], rel=1e-12))
    assert set(final_state) == set(full_state)
    for name, value in full_state.items():
        if exact:
            assert torch.equal(final_state[name], value), name
        else:
            torch.testing.assert_close(final_state[name], value, rtol=1e-10, atol=1e-12, msg=name)
