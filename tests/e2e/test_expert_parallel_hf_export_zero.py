"""The Hugging Face export of a Mixtral run at dp2·ep2 with ZeRO-2/3, against one process in float32.

Two SGD steps at dp2·ep2 with ZeRO-3 and at dp4·ep2 with ZeRO-2 (the dense parameters sharded over DP, each EP rank's fused experts
``fully_shard``-ed over their replica group: merak_core.parallel.zero_experts), then the run exported live
(``export_hf``: every DP rank takes part in the ZeRO gathers, the first EP group's ranks the experts'
gather over EP) and its step-2 checkpoint exported offline (``export_checkpoint``, what ``merak export
--to-hf`` runs). Both folders load with ``from_pretrained``; their tensors are the run's gathered
parameters bit for bit and their logits those of the same model trained by one process on the whole batch.
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch

from tests.e2e.test_expert_parallel_hf import ATOL, RTOL, STEPS, Tokens, _args, _model, _reference, _sgd
from tests.support.dist import run_on_ranks

pytest.importorskip("transformers")
pytestmark = pytest.mark.transformers


def _train_and_export(overrides: dict[str, Any]) -> dict[str, Any] | None:
    import torch.distributed as dist

    from merak_core import Trainer
    from merak_core.hf.export import export_hf

    shared = [tempfile.mkdtemp(prefix="merak-ep-zero-export-") if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(shared, src=0)
    out = shared[0]
    if dist.get_rank() == 0:
        _model("mixtral").save_pretrained(f"{out}/initial")
    dist.barrier()
    args = _args(ep=2, output_dir=f"{out}/run", save_steps=STEPS, **overrides)
    trainer = Trainer(_model("mixtral"), args, Tokens(), optimizer_factory=_sgd)
    losses = [h["loss"] for h in trainer.train() if "loss" in h]
    state = trainer.full_state_dict()
    export_hf(trainer.checkpoint_parts, f"{out}/live", pretrained=f"{out}/initial")
    dist.barrier()
    return {"losses": losses, "state": state, "out": out} if dist.get_rank() == 0 else None


CASES = {  # ranks, overrides
    "dp2-ep2-zero3": (2, {"zero_stage": 3}),
    # dp4: DP ranks 2 and 3 write nothing yet take part in the ZeRO gathers (2-rank expert-replica meshes)
    "dp4-ep2-zero2": (4, {"zero_stage": 2, "per_device_train_batch_size": 1}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_mixtral_ep2_zero_export_loads_with_one_process_logits(case: str) -> None:
    from safetensors.torch import load_file
    from transformers import MixtralForCausalLM

    from merak_core.hf.export import export_checkpoint

    ranks, overrides = CASES[case]
    got = run_on_ranks(ranks, _train_and_export, overrides)[0]
    assert got is not None
    losses, params, _ = _reference("mixtral")
    assert got["losses"] == pytest.approx(losses, rel=RTOL)
    state, out = got["state"], got["out"]
    assert set(state) == set(params)
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 32)
    export_checkpoint(f"{out}/run/checkpoints/step_{STEPS}", f"{out}/offline", pretrained=f"{out}/initial")
    reference = _model("mixtral").eval()
    reference.load_state_dict(params)
    ids = Tokens().ids[:, :-1]
    with torch.no_grad():
        want = reference(input_ids=ids).logits
    for folder in ("live", "offline"):
        written = load_file(f"{out}/{folder}/model.safetensors")
        assert set(written) == set(state), folder
        for name, value in state.items():
            assert torch.equal(written[name], value), f"{folder}: {name}"
        exported = MixtralForCausalLM.from_pretrained(f"{out}/{folder}").float().eval()
        with torch.no_grad():
            logits = exported(input_ids=ids).logits
        torch.testing.assert_close(logits, want, rtol=RTOL, atol=ATOL, msg=folder)
