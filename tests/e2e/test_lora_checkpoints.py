"""Adapter-only LoRA checkpoints ([Note: adapter-only checkpoints] in ``merak_core.checkpoint.frozen``).

A Llama (grouped-query attention) from a float64 folder trains 2 steps at tp2·pp2 and saves: the
checkpoint holds the adapters and their optimizer state only (no base weight), and both TP halves
of every sharded adapter (Megatron-Bridge #2240: TP shards lost on an adapter-only save). A run at
dp2 (another layout) resumes it and saves at once: its checkpoint equals the first bit for bit
(every adapter and optimizer state), and both equal the first run's adapters. A base other than
the one the adapters were trained on is refused by name before anything is loaded.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.e2e._pretrained_support import lm_loss
from tests.e2e._trainer_support import make_args
from tests.e2e.test_lora import TARGETS, _datasets, _folder
from tests.support.dist import run_on_ranks

pytestmark = pytest.mark.transformers


def _trainer(folder: str, text: str, out: str, **layout: Any) -> Any:
    from merak_core import Trainer
    from merak_core.lora import LoraConfig

    args = make_args(**layout, output_dir=out, max_steps=2, save_steps=2, gradient_accumulation_steps=2)
    train, _ = _datasets(Path(folder), Path(text))
    lora = LoraConfig(r=4, alpha=8, target_modules=TARGETS["llama"])
    return Trainer(None, args, train, loss_fn=lm_loss, pretrained=folder, lora=lora)


def save_body(folder: str, text: str, out: str) -> dict[str, Any] | None:
    """tp2·pp2: 2 steps, the step-2 checkpoint; the adapters at the end (rank 0)."""
    import torch.distributed as dist

    trainer = _trainer(folder, text, out, dp=1, tp=2, pp=2)
    trainer.train()
    state = trainer.full_state_dict()
    return state if dist.get_rank() == 0 else None


def resume_body(folder: str, other: str, text: str, checkpoint: str, out: str) -> str:
    """dp2 (the same global batch): a run on another base is refused; on the right one, resume and save at
    once. The refusal."""
    from merak_core.checkpoint.files import CheckpointError

    wrong = _trainer(other, text, out + "-wrong", dp=2, tp=1, pp=1, per_device_train_batch_size=1)
    try:
        wrong.resume(checkpoint)
    except CheckpointError as exc:
        refusal = str(exc)
    else:
        raise AssertionError("an adapter-only checkpoint was resumed on another base")
    trainer = _trainer(folder, text, out, dp=2, tp=1, pp=1, per_device_train_batch_size=1)
    assert trainer.resume(checkpoint) == 2
    trainer.checkpoints.save()
    return refusal


def _read(checkpoint: Path) -> dict[str, Any]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = Path(tempfile.mkdtemp(prefix="merak-lora-ckpt-")) / "all.pt"
    dcp_to_torch_save(str(checkpoint), str(target))
    return torch.load(str(target), weights_only=False)


def test_adapter_only_checkpoint_reshards_bit_identically() -> None:
    pytest.importorskip("transformers")
    root = Path(tempfile.mkdtemp(prefix="merak-lora-ckpt-"))
    folder, text = _folder("llama", root)
    other = root / "other"  # the same model with one frozen weight nudged
    shutil.copytree(folder, other)
    from safetensors.torch import load_file, save_file

    weights = load_file(str(other / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] * 1.001
    save_file(weights, str(other / "model.safetensors"), metadata={"format": "pt"})

    final = run_on_ranks(4, save_body, str(folder), str(text), str(root / "a"))[0]
    first = root / "a" / "checkpoints" / "step_2"
    refusals = run_on_ranks(2, resume_body, str(folder), str(other), str(text), str(first), str(root / "b"))
    second = root / "b" / "checkpoints" / "step_2"

    meta = json.loads((first / "merak_checkpoint.json").read_text())
    assert meta["adapter_only"] is True and meta["base"]["pretrained"] == str(folder)
    assert meta["layout"] == {"dp": 1, "tp": 2, "pp": 2, "world_size": 4}
    saved, resaved = _read(first), _read(second)
    tensors = sorted(k for k in saved if k.startswith(("model/", "optim/")))
    model_keys = [k for k in tensors if k.startswith("model/")]
    # Adapters only: every adapter of the 7 targets in 2 layers, no base weight.
    assert model_keys and all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in model_keys)
    assert len(model_keys) == 2 * 7 * 2
    states = [k.removeprefix("optim/").rpartition("/")[0] for k in tensors if k.startswith("optim/")]
    assert sorted(set(states)) == [k.removeprefix("model/") for k in model_keys]  # the adapters' states only
    assert tensors == sorted(k for k in resaved if k.startswith(("model/", "optim/")))
    for key in tensors:  # saved at tp2·pp2, resumed and saved again at dp2: bit for bit
        assert torch.equal(saved[key], resaved[key]), key
    for key in model_keys:  # every TP shard of every adapter is in the checkpoint
        assert torch.equal(saved[key], final[key.removeprefix("model/")]), key
    for refusal in refusals:
        assert "holds adapters only" in refusal and "model.norm.weight" in refusal, refusal
        assert str(folder) in refusal and "Set model.pretrained" in refusal, refusal
