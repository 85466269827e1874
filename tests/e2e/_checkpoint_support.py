"""Bodies of the checkpoint tests (run on every rank through tests.support.dist.run_on_ranks).

Every run uses the e2e trainer set-up (float64 reference models, tiny sizes); the
global batch is kept at 8 samples for every layout (``micro_batch 2 x microbatches
x dp``) so runs under different layouts see the same data and the same losses.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from tests.e2e._trainer_support import TokenDataset, build_model, make_args
from tests.support.models import REFERENCE_MODELS

GLOBAL_BATCH = 8
MICRO = 2


def layout_kwargs(dp: int, tp: int, pp: int, **extra: Any) -> dict[str, Any]:
    """TrainingArguments fields of a (dp, tp, pp) run with the shared global batch."""
    num_micro = GLOBAL_BATCH // (MICRO * dp)
    assert num_micro >= pp, (dp, tp, pp)
    return dict(dp=dp, tp=tp, pp=pp, per_device_train_batch_size=MICRO, gradient_accumulation_steps=num_micro,
                **extra)


def make_trainer(name: str, kwargs: dict[str, Any], dataset_size: int = 64) -> Any:
    """A Trainer of reference model ``name`` (or ``hf_gpt2``: a tiny transformers GPT-2, fused c_attn)."""
    from merak_core import Trainer

    args = make_args(**kwargs)
    if name == "hf_gpt2":
        from tests.tp._hf_bodies import build

        torch.manual_seed(0)
        model = build("gpt2")
        model.config.use_cache = False  # outputs without a KV-cache object
        loss = None  # default_loss reads output.logits
    else:
        model = build_model(name)
        loss = REFERENCE_MODELS[name].loss
    data = TokenDataset(dataset_size, model.config.vocab_size)
    return Trainer(model, args, data, loss_fn=loss)


def train_body(name: str, kwargs: dict[str, Any], resume: str | None = None,
               full_state_at: int | None = None) -> dict[str, Any]:
    """Train (optionally after resuming); losses by step, and the full state after loading / at the end."""
    trainer = make_trainer(name, kwargs)
    out: dict[str, Any] = {}
    if resume is not None:
        out["resumed_step"] = trainer.resume(resume)
        out["loaded_state"] = trainer.full_state_dict()
    history = trainer.train()
    out["losses"] = {int(h["step"]): h["loss"] for h in history}
    out["final_state"] = trainer.full_state_dict()
    out["checkpoints"] = [p.name for p in trainer.checkpoints.checkpoints()]
    return out if dist.get_rank() == 0 else {"losses": out["losses"]}


def saved_state_body(path: str) -> dict[str, torch.Tensor]:
    """The model part of a checkpoint, read by one process (no collectives)."""
    from merak_core.weights import read_checkpoint_model

    return read_checkpoint_model(path)


def die_during_save_body(name: str, kwargs: dict[str, Any], victim: int, die_at_step: int) -> None:
    """Train with periodic saves; rank ``victim`` dies inside the DCP write of step ``die_at_step``."""
    from torch.distributed.checkpoint import FileSystemWriter

    original = FileSystemWriter.write_data

    def write_data(self: Any, plan: Any, planner: Any) -> Any:
        if dist.get_rank() == victim and f"step_{die_at_step}.tmp" in str(self.path):
            os._exit(23)
        return original(self, plan, planner)

    FileSystemWriter.write_data = write_data  # type: ignore[method-assign]
    try:
        make_trainer(name, kwargs).train()
    finally:
        FileSystemWriter.write_data = original  # type: ignore[method-assign]


def import_export_body(name: str, save_kwargs: dict[str, Any], load_kwargs: dict[str, Any],
                       out_dir: str) -> dict[str, Any]:
    """Export a trained model (.pt and .safetensors), import both into a fresh trainer of another layout."""
    from merak_core.weights import export_full_state_dict, load_full_state_dict

    trainer = make_trainer(name, save_kwargs)
    trainer.train()
    exported = export_full_state_dict(trainer, os.path.join(out_dir, "model.pt"))
    export_full_state_dict(trainer, os.path.join(out_dir, "model.safetensors"))
    trained = trainer.full_state_dict()
    dist.barrier()
    results: dict[str, Any] = {"exported": exported, "trained": trained}
    for suffix in ("pt", "safetensors"):
        fresh = make_trainer(name, load_kwargs)
        before = fresh.full_state_dict()
        load_full_state_dict(fresh, os.path.join(out_dir, f"model.{suffix}"))
        results[f"before_{suffix}"] = before
        results[f"imported_{suffix}"] = fresh.full_state_dict()
    in_memory = make_trainer(name, load_kwargs)
    full = torch.load(os.path.join(out_dir, "model.pt"), weights_only=True)
    load_full_state_dict(in_memory, full)
    results["imported_dict"] = in_memory.full_state_dict()
    return results if dist.get_rank() == 0 else {}


def error_body(out_dir: str, other_ckpt: str) -> dict[str, str]:
    """Bad checkpoints each raise CheckpointError naming the path; returns the messages."""
    from merak_core.checkpoint import CheckpointError

    trainer = make_trainer("gpt", dict(output_dir=out_dir, max_steps=2))
    errors: dict[str, str] = {}
    trials = {
        "latest_missing": "latest",
        "no_such_dir": os.path.join(out_dir, "nope"),
        "other_model": other_ckpt,
    }
    for key, path in trials.items():
        try:
            trainer.resume(path)
        except CheckpointError as exc:
            errors[key] = str(exc)
    errors["auto_none"] = str(trainer.resume("auto"))
    return errors


def load_error_body(out_dir: str, path: str, name: str = "gpt") -> str:
    """The CheckpointError message of resuming ``path`` (or "no error")."""
    from merak_core.checkpoint import CheckpointError

    trainer = make_trainer(name, dict(output_dir=out_dir, max_steps=4, save_steps=2))
    try:
        trainer.resume(path)
    except CheckpointError as exc:
        return str(exc)
    return "no error"


def sgd_body(out_dir: str, resume: bool) -> dict[str, Any]:
    """SGD with momentum (another optimizer's states) plus a non-tensor state entry, saved and resumed."""
    from merak_core import Trainer

    args = make_args(**layout_kwargs(1, 1, 1, output_dir=out_dir, max_steps=4, save_steps=2))
    model = build_model("gpt")

    def sgd(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        opt = torch.optim.SGD(groups, lr=0.05, momentum=0.9)
        return opt

    trainer = Trainer(model, args, TokenDataset(64, model.config.vocab_size), loss_fn=REFERENCE_MODELS["gpt"].loss,
                      optimizer_factory=sgd)
    first = trainer.params[0]
    if resume:
        trainer.resume("step_2")
        note = trainer.optimizer.state[first].get("note")
    else:
        trainer.optimizer.state[first]["note"] = ("a non-tensor state", 1)
        note = None
    history = trainer.train()
    return {"losses": {int(h["step"]): h["loss"] for h in history}, "note": note,
            "momentum": trainer.optimizer.state[first]["momentum_buffer"].clone()}
