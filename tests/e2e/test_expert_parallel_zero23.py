"""Expert parallelism with ZeRO-2/3 (FSDP2) against one process in float64.

Dense parameters are sharded by FSDP2 over the DP group, experts by their own ``fully_shard`` over their
replica group (dp / ep ranks; at dp == ep a one-rank mesh: nothing sharded, their gradients reduced by the
dispatch's backward alone). Three SGD steps of the tiny MoE Llama with clipping below the
gradient's norm (SGD: an update is its gradient, so a wrong expert scale or a norm that counts an expert
twice moves the parameters), against one process on the whole batch: every step's loss and every
parameter after the three steps; and the sharding itself (dense parameters over dp ranks, experts over
dp / ep). Then a ZeRO-3 checkpoint at ep=2 resumes at ep=2 bit for bit and at ep=1 or ep=4 to rounding.
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.e2e.test_expert_parallel import BATCH, VOCAB, Tokens, _args, _model
from tests.support.dist import run_on_ranks
from tests.support.moe import MoEConfig, MoELlama

LR, MAX_NORM, STEPS = 0.5, 0.05, 3


def _sgd(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    return torch.optim.SGD(groups, lr=LR)


def _shard_ranks(param: torch.Tensor) -> int:
    """How many ranks ``param`` is sharded over (1: a plain tensor, whole here)."""
    from torch.distributed.tensor import DTensor

    return param.device_mesh.size() if isinstance(param, DTensor) else 1


def _train(overrides: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    from merak_core import Trainer

    args = _args(max_steps=STEPS, max_grad_norm=MAX_NORM, **overrides)
    trainer = Trainer(_model(), args, Tokens(), optimizer_factory=_sgd)
    history = trainer.train()
    state = trainer.full_state_dict()
    return {
        "losses": [h["loss"] for h in history if "loss" in h],
        "state": state if dist.get_rank() == 0 else None,
        "shards": {n: _shard_ranks(p) for n, p in trainer.engine.model.named_parameters()},
    }


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _model()
    data = Tokens()
    ids = torch.stack([data[i]["input_ids"] for i in range(BATCH)])
    labels = torch.stack([data[i]["labels"] for i in range(BATCH)])
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = F.cross_entropy(model(ids).reshape(-1, VOCAB), labels.reshape(-1))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        assert norm > MAX_NORM  # clipping is active: the norm's value moves every parameter
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


PP2 = {"pp": 2, "per_device_train_batch_size": 1, "gradient_accumulation_steps": 2}


@pytest.mark.parametrize(
    ("zero_stage", "dp", "layout"),
    [(2, 2, {}), (3, 2, {}), (3, 4, {}), (3, 2, PP2), (3, 2, {"tp": 2})],
    ids=["zero2-dp2-ep2", "zero3-dp2-ep2", "zero3-dp4-ep2", "zero3-dp2-ep2-pp2", "zero3-dp2-ep2-tp2"],
)
def test_zero23_with_experts_equals_one_process(zero_stage: int, dp: int, layout: dict[str, Any]) -> None:
    """dp2·ep2: experts on a one-rank replica mesh (nothing to shard), dense parameters sharded over 2 ranks;
    dp4·ep2: experts sharded over their 2-rank replica groups, dense parameters over 4 ranks; dp2·ep2·pp2 (each
    stage's experts and dense units sharded apart, two microbatches) and dp2·ep2·tp2 (experts whole per TP rank,
    attention TP-sharded, both sharded over DP)."""
    ep = 2
    overrides = {"ep": ep, "zero_stage": zero_stage, "per_device_train_batch_size": BATCH // dp, **layout}
    world = dp * layout.get("pp", 1) * layout.get("tp", 1)
    results = run_on_ranks(world, _train, overrides)
    losses, params = _reference()
    state = results[0]["state"]
    assert state is not None and set(state) == set(params)
    for got in results:
        assert got["losses"] == pytest.approx(losses, rel=1e-12)
        for name, ranks in got["shards"].items():
            assert ranks == (dp // ep if ".experts." in name else dp), (name, ranks)
    for name, value in params.items():
        torch.testing.assert_close(state[name], value, rtol=1e-10, atol=1e-12, msg=name)


def _resume(save: dict[str, Any], resume: dict[str, Any]) -> dict[str, Any]:
    """3 SGD steps saving every step; a fresh Trainer (``resume``'s settings) resumes step_1, trains to 3."""
    import torch.distributed as dist

    from merak_core import Trainer

    out_dir = tempfile.mkdtemp(prefix="merak-ep-zero3-") if dist.get_rank() == 0 else ""
    shared = [out_dir]
    dist.broadcast_object_list(shared, src=0)
    common: dict[str, Any] = dict(
        output_dir=shared[0], max_steps=3, save_steps=1, learning_rate=0.01, max_grad_norm=MAX_NORM
    )
    full = Trainer(_model(), _args(**common, **save), Tokens())
    full_losses = [h["loss"] for h in full.train() if "loss" in h]
    full_state = full.full_state_dict()
    dist.barrier()
    resumed = Trainer(_model(), _args(**common, **resume), Tokens())
    step = resumed.resume("step_1")
    losses = [h["loss"] for h in resumed.train() if "loss" in h]
    return {"step": step, "full": (full_losses, full_state), "resumed": (losses, resumed.full_state_dict())}


ZERO3_EP2 = {"ep": 2, "zero_stage": 3}


@pytest.mark.parametrize(
    ("dp", "resume"),
    [(2, ZERO3_EP2), (2, {"ep": 1, "zero_stage": 0}), (4, {"ep": 4, "zero_stage": 2})],
    ids=["dp2-same-layout", "dp2-ep1-zero0", "dp4-ep4-zero2"],
)
def test_zero3_with_experts_resumes(dp: int, resume: dict[str, Any]) -> None:
    """Experts are saved by their global names, gathered from their shards (AdamW states too): the same layout
    resumes bit for bit, ep=1 without ZeRO (every expert on each rank) to rounding, and a dp4 checkpoint (experts
    sharded over 2-rank replica groups) at ep=4 ZeRO-2 (one expert per rank) to rounding."""
    batch = {"per_device_train_batch_size": BATCH // dp}
    got = run_on_ranks(dp, _resume, {**ZERO3_EP2, **batch}, {**resume, **batch})[0]
    assert got["step"] == 1
    full_losses, full_state = got["full"]
    losses, final_state = got["resumed"]
    exact = resume == ZERO3_EP2
    assert len(full_losses) == 3
    assert losses == (full_losses[1:] if exact else pytest.approx(full_losses[1:], rel=1e-12))
    assert set(final_state) == set(full_state)
    for name, value in full_state.items():
        if exact:
            assert torch.equal(final_state[name], value), name
        else:
            torch.testing.assert_close(final_state[name], value, rtol=1e-10, atol=1e-12, msg=name)


def _train_bf16(overrides: dict[str, Any]) -> tuple[list[float], dict[str, torch.Tensor] | None]:
    """3 SGD steps in bf16 autocast with float32 master weights (FSDP2 gathers bf16 parameters)."""
    import torch.distributed as dist

    from merak_core import Trainer

    torch.manual_seed(0)
    model = MoELlama(MoEConfig(vocab_size=VOCAB))
    args = _args(max_steps=STEPS, max_grad_norm=MAX_NORM, dtype="float32", bf16=True, **overrides)
    trainer = Trainer(model, args, Tokens(), optimizer_factory=_sgd)
    losses = [h["loss"] for h in trainer.train() if "loss" in h]
    state = trainer.full_state_dict()
    return losses, state if dist.get_rank() == 0 else None


def test_zero3_bf16_gathers_with_experts() -> None:
    """bf16 parameter gathers on the expert units too: ep=2 equals ep=1 (both ZeRO-3 bf16, the same two ranks)
    within bf16 rounding (measured: 3e-6 on parameters of ~0.2)."""
    (losses, state), _ = run_on_ranks(2, _train_bf16, {"ep": 2, "zero_stage": 3})
    (ref_losses, ref_state), _ = run_on_ranks(2, _train_bf16, {"ep": 1, "zero_stage": 3})
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert state is not None and ref_state is not None and set(state) == set(ref_state)
    for name, value in ref_state.items():
        torch.testing.assert_close(state[name], value, rtol=1e-4, atol=5e-5, msg=name)
