"""transformers' fused experts (Mixtral) under expert parallelism with ZeRO-3, against one process in float32.

The fused ``gate_up_proj [E/ep, 2I, H]`` and ``down_proj [E/ep, H, I]`` of each EP rank are sharded by their own
``fully_shard`` over the expert-replica group (merak_core.parallel.zero_experts), the rest over DP. Two SGD steps
at dp4·ep2 (2-rank replica groups: each replica rank holds one expert's rows of the two) with clipping below the
gradient's norm equal one process; a ZeRO-3 ep=2 checkpoint (the fused experts gathered over their replica mesh,
written as a DTensor over the EP mesh by their one-process names) resumes at ep=2 ZeRO-3 bit for bit and at
ep=1 without ZeRO to rounding.
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch

from tests.e2e.test_expert_parallel_hf import ATOL, RTOL, Tokens, _args, _check, _model, _train
from tests.support.dist import run_on_ranks

pytest.importorskip("transformers")
pytestmark = pytest.mark.transformers


def test_mixtral_dp4_ep2_zero3_clipped_equals_one_process() -> None:
    overrides = {"ep": 2, "zero_stage": 3, "per_device_train_batch_size": 1, "max_grad_norm": 0.05}
    _check(run_on_ranks(4, _train, "mixtral", overrides), "mixtral", max_norm=0.05)


def _resume_zero3() -> dict[str, Any]:
    """3 AdamW steps at ep=2 ZeRO-3 saving every step; fresh Trainers at ep=2 ZeRO-3 and ep=1 ZeRO-0 resume
    step_1 and train to 3, each in its own output_dir."""
    import torch.distributed as dist

    from merak_core import Trainer

    shared = [tempfile.mkdtemp(prefix="merak-ep-hf-zero3-") if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(shared, src=0)
    out, common = shared[0], dict(max_steps=3, save_steps=1, learning_rate=0.01)
    full = Trainer(_model("mixtral"), _args(ep=2, zero_stage=3, output_dir=f"{out}/run", **common), Tokens())
    got: dict[str, Any] = {"full": ([h["loss"] for h in full.train() if "loss" in h], full.full_state_dict())}
    dist.barrier()
    for name, layout in (("same", dict(ep=2, zero_stage=3)), ("ep1", dict(ep=1, zero_stage=0))):
        resumed = Trainer(_model("mixtral"), _args(output_dir=f"{out}/{name}", **layout, **common), Tokens())
        assert resumed.resume(f"{out}/run/checkpoints/step_1") == 1
        got[name] = ([h["loss"] for h in resumed.train() if "loss" in h], resumed.full_state_dict())
        dist.barrier()
    return got


def test_mixtral_zero3_checkpoint_at_ep2_resumes() -> None:
    got = run_on_ranks(2, _resume_zero3)[0]
    full_losses, full_state = got["full"]
    assert full_state["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 32)
    same_losses, same_state = got["same"]
    assert same_losses == full_losses[1:]
    for name, value in full_state.items():
        assert torch.equal(same_state[name], value), name
    losses, state = got["ep1"]
    assert losses == pytest.approx(full_losses[1:], rel=RTOL)
    assert set(state) == set(full_state)
    for name, value in full_state.items():
        torch.testing.assert_close(state[name], value, rtol=RTOL, atol=ATOL, msg=name)
