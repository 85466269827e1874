"""ZeRO stages at dp=1: nothing to shard, so the run is ZeRO-0; it says so once, and the planner too.

- the message (pure) names the value, why and what to set; none where there is something to shard;
- one Trainer step at dp=1 x pp=2 with zero_stage 3 logs it once (rank 0), shards nothing and
  gives the same loss and parameters as zero_stage 0;
- the memory prediction at dp=1 is ZeRO-0's for every stage and logs the same message.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from merak_core.parallel import fsdp
from merak_core.parallel.fsdp import nothing_to_shard_message, warn_nothing_to_shard
from merak_core.planner import ModelProfile
from merak_core.planner.memory import predict_stage_memory
from tests.support.dist import run_on_ranks


def test_message_names_the_value_why_and_the_fix() -> None:
    message = nothing_to_shard_message(3, 1)
    assert message is not None
    assert "zero_stage=3 with dp=1" in message and "zero_stage 0" in message and "dp >= 2" in message
    assert nothing_to_shard_message(2, 1) is not None and nothing_to_shard_message(1, 1) is not None
    assert nothing_to_shard_message(0, 1) is None
    assert nothing_to_shard_message(3, 2) is None


def _captured(logger_name: str) -> tuple[logging.Handler, list[str]]:
    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = Keep(level=logging.WARNING)
    logging.getLogger(logger_name).addHandler(handler)
    return handler, messages


def test_warning_is_logged_once_per_zero_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fsdp, "_WARNED_NOTHING_TO_SHARD", set())
    handler, messages = _captured("merak_core.parallel.fsdp")
    try:
        for _ in range(3):
            warn_nothing_to_shard(2, 1)
        warn_nothing_to_shard(2, 4)
    finally:
        logging.getLogger("merak_core.parallel.fsdp").removeHandler(handler)
    assert messages == [nothing_to_shard_message(2, 1)]


def test_memory_prediction_at_dp1_is_zero0_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fsdp, "_WARNED_NOTHING_TO_SHARD", set())
    prof = ModelProfile(
        layer_forward_s=[1.0] * 4,
        layer_backward_s=[2.0] * 4,
        layer_activation_bytes=[100.0] * 4,
        layer_param_bytes=[1000.0, 500.0, 500.0, 1000.0],
        shared_param_bytes=400.0,
        boundary_bytes=10.0,
    )
    kw: dict[str, Any] = dict(stage_layers=[2, 2], schedule="1f1b", num_microbatches=4, micro_batch_size=1)
    handler, messages = _captured("merak_core.parallel.fsdp")
    try:
        zero3 = predict_stage_memory(prof, dp=1, zero_stage=3, **kw)
    finally:
        logging.getLogger("merak_core.parallel.fsdp").removeHandler(handler)
    assert zero3 == predict_stage_memory(prof, dp=1, zero_stage=0, **kw)
    assert messages == [nothing_to_shard_message(3, 1)]


def dp1_body(zero_stage: int) -> dict[str, Any]:
    import tempfile

    import torch.distributed as dist

    from merak_core import Trainer
    from merak_core.config import TrainingArguments
    from tests.core.test_memory_model import _addition

    fsdp._WARNED_NOTHING_TO_SHARD.clear()
    handler, messages = _captured("merak_core")
    try:
        model, data, _ = _addition()
        args = TrainingArguments(
            output_dir=tempfile.mkdtemp(prefix="merak-zero-dp1-"),
            dp=1,
            pp=2,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            max_steps=1,
            zero_stage=zero_stage,
            logging_steps=1,
            seed=0,
        )
        trainer = Trainer(model, args, data)
        history = trainer.train()
    finally:
        logging.getLogger("merak_core").removeHandler(handler)
    params = {n: p.detach().clone() for n, p in trainer.model.module.named_parameters()}
    return {
        "rank": dist.get_rank(),
        "warnings": [m for m in messages if "nothing is sharded" in m],
        "sharded": trainer.engine.sharded is not None,
        "loss": history[0]["loss"] if history else None,
        "params": params,
    }


def test_trainer_zero3_at_dp1_warns_once_and_equals_zero0() -> None:
    zero3 = run_on_ranks(2, dp1_body, 3, timeout_s=300)
    zero0 = run_on_ranks(2, dp1_body, 0, timeout_s=300)
    assert [r["warnings"] for r in zero3] == [[nothing_to_shard_message(3, 1)], []]  # rank 0 only, once
    assert [r["warnings"] for r in zero0] == [[], []]
    assert not any(r["sharded"] for r in zero3)
    for a, b in zip(zero3, zero0, strict=True):
        assert a["loss"] == b["loss"]
        assert a["params"].keys() == b["params"].keys()
        for name in a["params"]:
            assert torch.equal(a["params"][name], b["params"][name]), name
