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
    return dict(
        dp=dp, tp=tp, pp=pp, per_device_train_batch_size=MICRO, gradient_accumulation_steps=num_micro, **extra
    )


def make_trainer(name: str, kwargs: dict[str, Any], dataset_size: int = 64) -> Any:
    """A Trainer of reference model ``name``; also ``hf_gpt2`` (a tiny transformers GPT-2, fused c_attn),
    ``gpt_dropout`` (the reference GPT with dropout 0.1) and ``gpt_vocab128`` (a larger vocabulary)."""
    from merak_core import Trainer

    args = make_args(**kwargs)
    if name == "hf_gpt2":
        from tests.tp._hf_bodies import build

        torch.manual_seed(0)
        model = build("gpt2")
        model.config.use_cache = False  # outputs without a KV-cache object
        loss = None  # default_loss reads output.logits
    elif name in ("gpt_dropout", "gpt_vocab128"):
        from tests.support.models import GPT, DecoderConfig

        torch.manual_seed(0)
        cfg = DecoderConfig(dropout=0.1) if name == "gpt_dropout" else DecoderConfig(vocab_size=128)
        model = GPT(cfg).double()
        loss = REFERENCE_MODELS["gpt"].loss
    else:
        model = build_model(name)
        loss = REFERENCE_MODELS[name].loss
    data = TokenDataset(dataset_size, model.config.vocab_size)
    return Trainer(model, args, data, loss_fn=loss)


def train_body(
    name: str, kwargs: dict[str, Any], resume: str | None = None, full_state_at: int | None = None
) -> dict[str, Any]:
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
    from merak_core.checkpoint.weights import read_checkpoint_model

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


def import_export_body(
    name: str, save_kwargs: dict[str, Any], load_kwargs: dict[str, Any], out_dir: str
) -> dict[str, Any]:
    """Export a trained model (.pt and .safetensors), import both into a fresh trainer of another layout."""
    from merak_core.checkpoint.weights import export_full_state_dict, load_full_state_dict

    trainer = make_trainer(name, save_kwargs)
    trainer.train()
    exported = export_full_state_dict(trainer.checkpoint_parts, os.path.join(out_dir, "model.pt"))
    export_full_state_dict(trainer.checkpoint_parts, os.path.join(out_dir, "model.safetensors"))
    trained = trainer.full_state_dict()
    dist.barrier()
    results: dict[str, Any] = {"exported": exported, "trained": trained}
    for suffix in ("pt", "safetensors"):
        fresh = make_trainer(name, load_kwargs)
        before = fresh.full_state_dict()
        load_full_state_dict(fresh.checkpoint_parts, os.path.join(out_dir, f"model.{suffix}"))
        results[f"before_{suffix}"] = before
        results[f"imported_{suffix}"] = fresh.full_state_dict()
    in_memory = make_trainer(name, load_kwargs)
    full = torch.load(os.path.join(out_dir, "model.pt"), weights_only=True)
    load_full_state_dict(in_memory.checkpoint_parts, full)
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

    trainer = Trainer(
        model,
        args,
        TokenDataset(64, model.config.vocab_size),
        loss_fn=REFERENCE_MODELS["gpt"].loss,
        optimizer_factory=sgd,
    )
    first = trainer.params[0]
    if resume:
        trainer.resume("step_2")
        note = trainer.optimizer.state[first].get("note")
    else:
        trainer.optimizer.state[first]["note"] = ("a non-tensor state", 1)
        note = None
    history = trainer.train()
    return {
        "losses": {int(h["step"]): h["loss"] for h in history},
        "note": note,
        "momentum": trainer.optimizer.state[first]["momentum_buffer"].clone(),
    }


class LogCapture:
    """Collect the messages of the ``merak_core`` loggers at INFO and above (in a worker rank)."""

    def __init__(self) -> None:
        import logging

        self.records: list[tuple[str, str]] = []
        outer = self

        class _Handler(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                outer.records.append((record.levelname, record.getMessage()))

        self._handler = _Handler(level=logging.INFO)
        self._logger = logging.getLogger("merak_core")

    def __enter__(self) -> LogCapture:
        import logging

        self._old_level = self._logger.level
        self._logger.setLevel(logging.INFO)
        self._logger.addHandler(self._handler)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._logger.removeHandler(self._handler)
        self._logger.setLevel(self._old_level)

    def messages(self, level: str | None = None) -> list[str]:
        return [m for lv, m in self.records if level is None or lv == level]


def _state_shape_errors(trainer: Any) -> list[str]:
    """Optimizer states shaped unlike their parameter (what the sharded-state bug produced)."""
    inner = getattr(trainer.optimizer, "inner", trainer.optimizer)
    return [
        f"{key}: {list(v.shape)} vs param {list(p.shape)}"
        for p, st in inner.state.items()
        for key, v in st.items()
        if isinstance(v, torch.Tensor) and v.ndim > 0 and v.shape != p.shape
    ]


def resume_pair_body(
    name: str, kwargs: dict[str, Any], save_at: int, resume_kwargs: dict[str, Any] | None = None
) -> dict[str, Any]:
    """An uninterrupted run (saving every ``save_at`` steps), then a fresh Trainer resumes ``step_<save_at>``.

    ``resume_kwargs`` change TrainingArguments of the resumed run (a changed job file). Returns
    both runs' losses by step, the final parameters of both (rank 0), optimizer states of the
    wrong shape after loading, and the resumed run's log messages.
    """
    full = make_trainer(name, kwargs)
    full_losses = {int(h["step"]): h["loss"] for h in full.train()}
    full_state = full.full_state_dict()
    dist.barrier()
    resumed = make_trainer(name, {**kwargs, **(resume_kwargs or {})})
    with LogCapture() as logs:
        step = resumed.resume(f"step_{save_at}")
        bad_shapes = _state_shape_errors(resumed)
        losses = {int(h["step"]): h["loss"] for h in resumed.train()}
    out = {
        "resumed_step": step,
        "full_losses": full_losses,
        "losses": losses,
        "bad_shapes": bad_shapes,
        "logs": logs.messages(),
    }
    final_state = resumed.full_state_dict()
    if dist.get_rank() == 0:
        out.update(full_state=full_state, final_state=final_state)
    return out


def rng_streams_body(out_dir: str) -> dict[str, Any]:
    """Every random stream of each rank after a save equals the stream after a resume in a fresh Trainer."""
    import random

    import numpy as np

    from merak_tp import RNGTracker

    def draws(trainer: Any) -> dict[str, Any]:
        with trainer.rng_tracker.fork("tp"):
            tracked = torch.rand(3)
        return {
            "torch": torch.rand(3),
            "python": random.random(),
            "numpy": float(np.random.rand()),
            "tracker": tracked,
        }

    rank = dist.get_rank()
    kwargs = layout_kwargs(2, 1, 2, output_dir=out_dir, max_steps=2, save_steps=2)
    first = make_trainer("gpt_dropout", kwargs)
    first.rng_tracker = RNGTracker()
    first.rng_tracker.add("tp", 1000 + rank)
    with first.rng_tracker.fork("tp"):
        torch.rand(5)  # move the tracked state away from its seed
    random.seed(10 + rank)  # streams that differ per rank: each rank must get its own back
    np.random.seed(20 + rank)
    first.train()  # saves step_2 at the end
    after_save = draws(first)
    dist.barrier()
    second = make_trainer("gpt_dropout", kwargs)
    second.rng_tracker = RNGTracker()
    second.rng_tracker.add("tp", 0)
    random.seed(0)
    np.random.seed(0)
    second.resume("latest")
    return {"saved": after_save, "resumed": draws(second)}


def flip_bytes(path: str, count: int = 16) -> None:
    """Invert ``count`` bytes in the middle of a file (a silent disk or copy error)."""
    data = bytearray(open(path, "rb").read())
    mid = len(data) // 2
    for i in range(mid, mid + count):
        data[i] ^= 0xFF
    open(path, "wb").write(bytes(data))


def resume_latest_body(name: str, kwargs: dict[str, Any], path: str = "latest") -> dict[str, Any]:
    """Resume ``path`` with the warnings captured; the step, the warnings, the later losses (or the error)."""
    from merak_core.checkpoint import CheckpointError

    trainer = make_trainer(name, kwargs)
    with LogCapture() as logs:
        try:
            step = trainer.resume(path)
        except CheckpointError as exc:
            return {"error": f"{type(exc).__name__}: {exc}", "warnings": logs.messages("WARNING")}
    losses = {int(h["step"]): h["loss"] for h in trainer.train()}
    return {"resumed_step": step, "warnings": logs.messages("WARNING"), "losses": losses}


def nonfinite_save_body(out_dir: str, where: str) -> dict[str, Any]:
    """After a good save at step 2, poison one tensor on one rank and save step 3: every rank must refuse."""
    from merak_core.checkpoint import NonFiniteCheckpointError

    trainer = make_trainer("gpt", layout_kwargs(1, 1, 2, output_dir=out_dir, max_steps=2, save_steps=2))
    trainer.train()
    trainer.global_step = 3
    rank = dist.get_rank()
    with torch.no_grad():
        if where == "parameter" and rank == 1:
            name, p = trainer.model.named_parameters()[0]
            p.view(-1)[0] = float("nan")
        if where == "optimizer" and rank == 0:
            p = trainer.params[-1]
            trainer.optimizer.state[p]["exp_avg_sq"].view(-1)[-1] = float("inf")
    try:
        trainer.checkpoints.save()
    except NonFiniteCheckpointError as exc:
        return {"error": str(exc)}
    return {"error": None}


def changed_settings_reference(
    name: str, kwargs: dict[str, Any], changes: dict[str, Any], dp: int, switch_at: int
) -> list[float]:
    """One process: ``kwargs``' optimizer and schedule for ``switch_at`` steps, then ``changes``' values.

    After the switch the rate of each step is computed from the new arguments' formula
    (``lr_lambda``) and set on the optimizer directly, with the new weight decay and betas;
    the Adam moments and the data order carry on.
    """
    from merak_core.config import lr_lambda
    from tests.e2e._trainer_support import TokenDataset, reference_microbatches, reference_optimizer

    args, new = make_args(**kwargs), make_args(**{**kwargs, **changes})
    model = build_model(name)
    loss_fn = REFERENCE_MODELS[name].loss
    data = TokenDataset(64, model.config.vocab_size)
    opt, sched = reference_optimizer(model, args)
    rate = lr_lambda(new, new.max_steps)
    losses = []
    for step, chunks in enumerate(reference_microbatches(len(data), new, dp)):
        if step >= switch_at:
            for group in opt.param_groups:
                group["lr"] = new.learning_rate * rate(step)
                group["betas"] = (new.adam_beta1, new.adam_beta2)
                if group["weight_decay"]:
                    group["weight_decay"] = new.weight_decay
        model.zero_grad(set_to_none=True)
        total = 0.0
        for chunk in chunks:
            batch = torch.utils.data.default_collate([data[i] for i in chunk])
            loss = loss_fn(model(batch["input_ids"]), batch["labels"]) / len(chunks)
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), (new if step >= switch_at else args).max_grad_norm)
        opt.step()
        if step < switch_at:
            sched.step()
        losses.append(total)
    return losses


def load_weights_from_checkpoint_body(
    name: str, kwargs: dict[str, Any], source: str
) -> dict[str, Any] | None:
    """A fresh trainer (another layout) takes only the model weights of ``source`` (a checkpoint or 'latest')."""
    from merak_core.checkpoint.weights import load_full_state_dict

    trainer = make_trainer(name, kwargs)
    load_full_state_dict(trainer.checkpoint_parts, source)
    return trainer.full_state_dict()
