"""The memory model and the planner with frozen weights (a LoRA run): weights only, no gradient, no
optimizer state ([Note: frozen weights] in merak_core.planner.memory).

Pure tests: the per-rank state of a LoRA job against the full fine-tune of the same model (the
gradient and optimizer bytes are the adapters' alone, the weights are the base's plus the
adapters'), the profile's trainable bytes measured from ``requires_grad``, and a planner that
refuses the full fine-tune in a memory the LoRA job fits, choosing another layout for it. The
measured-against-predicted LoRA case is in ``test_memory_model.py``.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from merak_core import LoraConfig
from merak_core.autoplan.auto import with_adapters
from merak_core.planner import ModelProfile, plan, profile_model
from merak_core.planner.memory import model_state_bytes, predict_stage_memory
from tests.support.models import build_reference

BASE = [1000.0, 500.0, 500.0, 1000.0]
ADAPTERS = [0.0, 20.0, 20.0, 0.0]


def test_model_state_bytes_of_frozen_weights() -> None:
    p, t = 1000.0, 10.0
    assert model_state_bytes(p, zero_stage=0, dp=4, trainable_bytes=t) == (p, t, 2 * t)
    assert model_state_bytes(p, zero_stage=1, dp=4, trainable_bytes=t) == (p, t, 2 * t / 4)
    # ZeRO-2: the frozen weights whole (FSDP2 leaves them alone), the adapters sharded and gathered
    assert model_state_bytes(p, zero_stage=2, dp=4, trainable_bytes=t) == (p - t + t / 4 + t, t, 2 * t / 4)
    assert model_state_bytes(p, zero_stage=1, dp=4, trainable_bytes=p) == model_state_bytes(
        p, zero_stage=1, dp=4
    )
    assert model_state_bytes(p, zero_stage=1, dp=4, trainable_bytes=0.0) == (p, 0.0, 0.0)
    with pytest.raises(ValueError, match="trainable_bytes=1001"):
        model_state_bytes(p, zero_stage=0, dp=1, trainable_bytes=1001.0)


def _full() -> ModelProfile:
    return ModelProfile(
        layer_forward_s=[1.0] * 4,
        layer_backward_s=[2.0] * 4,
        layer_activation_bytes=[100.0] * 4,
        layer_param_bytes=[b + a for b, a in zip(BASE, ADAPTERS, strict=True)],
        shared_param_bytes=400.0,
        boundary_bytes=10.0,
    )


def _lora() -> ModelProfile:
    return dataclasses.replace(_full(), layer_trainable_bytes=list(ADAPTERS), shared_trainable_bytes=0.0)


def test_profile_checks_trainable_bytes() -> None:
    with pytest.raises(ValueError, match="layer_trainable_bytes has 3 values"):
        dataclasses.replace(_full(), layer_trainable_bytes=[0.0] * 3)
    with pytest.raises(ValueError, match=r"layer_trainable_bytes\[1\]=600.0"):
        dataclasses.replace(_full(), layer_trainable_bytes=[0.0, 600.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="shared_trainable_bytes=500.0"):
        dataclasses.replace(_lora(), shared_trainable_bytes=500.0)
    assert ModelProfile.from_json(_lora().to_json()) == _lora()


@pytest.mark.parametrize(("dp", "tp", "zero_stage"), [(1, 1, 0), (2, 1, 1), (2, 2, 0), (4, 1, 1)])
def test_lora_rank_holds_the_adapters_gradients_and_optimizer_states_only(
    dp: int, tp: int, zero_stage: int
) -> None:
    kw = dict(
        stage_layers=[2, 2],
        schedule="1f1b",
        num_microbatches=4,
        micro_batch_size=1,
        tp=tp,
        dp=dp,
        zero_stage=zero_stage,
    )
    full, lora = predict_stage_memory(_full(), **kw), predict_stage_memory(_lora(), **kw)
    shards = dp if zero_stage else 1
    for s, (f, lo) in enumerate(zip(full, lora, strict=True)):
        stage = range(2 * s, 2 * s + 2)
        weights = sum(BASE[i] + ADAPTERS[i] for i in stage)  # each stage holds its copy of the tied 400
        adapters = sum(ADAPTERS[i] for i in stage)
        assert lo.param_bytes == f.param_bytes == pytest.approx(weights / tp)
        assert lo.grad_bytes == pytest.approx(adapters / tp)
        assert lo.optimizer_bytes == pytest.approx(2 * adapters / tp / shards)
        assert f.grad_bytes == pytest.approx(f.param_bytes)  # every weight trains
        assert f.optimizer_bytes == pytest.approx(2 * f.param_bytes / shards)
        assert lo.activation_bytes == f.activation_bytes
        # gradient + optimizer bytes of the adapters alone: 20/1020 of the full fine-tune's here
        ratio = (lo.grad_bytes + lo.optimizer_bytes) / (f.grad_bytes + f.optimizer_bytes)
        assert ratio == pytest.approx(adapters / f.param_bytes / tp)


def test_profile_measures_trainable_bytes_from_requires_grad() -> None:
    torch.manual_seed(0)
    model = build_reference("gpt").float()
    ids = torch.randint(0, 96, (2, 8))
    full = profile_model(model, ids, repeats=1)
    assert full.layer_trainable_bytes is None and full.trainable_bytes == full.layer_param_bytes
    lora = LoraConfig(r=2, alpha=4, target_modules=["q_proj", "v_proj", "fc_in"])
    with_adapters(model, lora)
    prof = profile_model(model, ids, repeats=1)
    assert prof.fingerprint != full.fingerprint
    assert prof.layer_trainable_bytes is not None
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):
        adapters = sum(p.numel() * p.element_size() for n, p in block.named_parameters() if "lora_" in n)
        assert adapters > 0 and all(p.requires_grad == ("lora_" in n) for n, p in block.named_parameters())
        assert prof.layer_trainable_bytes[i] == adapters
        assert prof.layer_param_bytes[i] == full.layer_param_bytes[i] + adapters
    assert prof.shared_param_bytes == full.shared_param_bytes and prof.shared_trainable_bytes == 0.0


def _big(trainable: list[float] | None) -> ModelProfile:
    """Four layers of 1 GB of weights each (with a LoRA profile: 1 MB of adapters each)."""
    gb = 1e9
    return ModelProfile(
        layer_forward_s=[1e-2] * 4,
        layer_backward_s=[2e-2] * 4,
        layer_activation_bytes=[1e6] * 4,
        layer_param_bytes=[gb + (1e6 if trainable is not None else 0.0)] * 4,
        layer_trainable_bytes=trainable,
        boundary_bytes=1e5,
    )


def test_planner_fits_a_lora_job_where_the_full_fine_tune_does_not() -> None:
    full, lora = _big(None), _big([1e6] * 4)
    kw = dict(memory_per_device=6e9, global_batch_size=8, zero_stage=1)
    # One device: the full fine-tune needs weights + gradients + Adam states (16 GB); LoRA the weights.
    with pytest.raises(ValueError, match="nothing fits"):
        plan(full, world_size=1, **kw)
    assert plan(lora, world_size=1, **kw)[0].layout == "dp1-tp1-pp1"
    # Four devices: the full fine-tune must shard its weights (pp or tp), even ZeRO-1 over dp=4
    # holds 10 GB per rank; the LoRA job fits pure data parallelism and chooses it.
    full_layouts = {c.layout for c in plan(full, world_size=4, **kw)}
    assert "dp4-tp1-pp1" not in full_layouts and full_layouts
    lora_cands = plan(lora, world_size=4, **kw)
    assert lora_cands[0].layout == "dp4-tp1-pp1"
    assert (
        max(lora_cands[0].peak_memory_bytes) < 4.5e9
    )  # the 4 GB of frozen weights, the adapters' state, activations


def _plan_command(memory: str, *lora: str) -> list[str]:
    root = Path(__file__).resolve().parents[2]
    config = str(root / "examples/addition/config.yaml")
    return [
        "plan",
        config,
        "data.kwargs.train_size=64",
        *lora,
        "--world-size",
        "1",
        "--memory-per-device",
        memory,
    ]


def test_merak_plan_fits_a_lora_job_in_memory_a_full_fine_tune_does_not(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from merak_core.cli import main

    lora = ("model.lora.r=2", "model.lora.target_modules=[query,value,up]")
    assert main(_plan_command("1KiB")) == 2
    full_needs = int(float(re.search(r"needs ([0-9.e+]+) bytes", capsys.readouterr().err).group(1)))
    assert main(_plan_command("1KiB", *lora)) == 2
    lora_needs = int(float(re.search(r"needs ([0-9.e+]+) bytes", capsys.readouterr().err).group(1)))
    # the demo's weights are most of its state: LoRA needs about a third of the full fine-tune's memory
    assert lora_needs < 0.6 * full_needs
    memory = str((lora_needs + full_needs) // 2)
    assert main(_plan_command(memory)) == 2
    assert "nothing fits" in capsys.readouterr().err
    assert main(_plan_command(memory, *lora)) == 0
    assert "feasible configurations for 1 ranks" in capsys.readouterr().out
