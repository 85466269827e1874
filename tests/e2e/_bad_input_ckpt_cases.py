"""The checkpoint rows of the bad-input table: resumes from broken, partial or foreign checkpoints.

Each leaves every file under ``checkpoints/`` and the trainer's parameters unchanged (see
``_nothing_changes``). The other rows are in ``_bad_input_cases.py``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tests.e2e._bad_input_cases import _merak, _Pairs, _write_job
from tests.e2e._bad_input_support import CaseContext

#
# [Note: checkpoint rows] Each row first trains a tiny classifier for one step with dp=2 and
# save_steps=1 (``ctx.tmp`` is the same directory on every rank), so ``checkpoints/step_1`` is a real committed
# checkpoint; then it makes the mistake and checks, whatever happens, that no byte and no
# modification time under ``checkpoints/`` changed (nothing overwritten) and, for resumes, that
# the trainer's parameters are untouched.


def _ckpt_trainer(
    output_dir: str, *, hidden: int = 8, batch: int = 2, layout: Any = None, data: Any = None
) -> Any:
    from merak_core import Trainer, TrainingArguments, init

    layout = layout if layout is not None else init(dp=2, device="cpu")
    args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=batch,
        max_steps=1,
        save_steps=1,
        dtype="float64",
        logging_steps=1,
        learning_rate=0.1,
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 3))
    return Trainer(model, args, _Pairs() if data is None else data, layout=layout)


def _snapshot(root: Path) -> dict[str, tuple[int, bytes]]:
    import hashlib

    return {
        str(p.relative_to(root)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).digest())
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _saved_run(ctx: CaseContext) -> tuple[Path, Any]:
    """(output_dir shared by the ranks, the trainer) after one step and one committed checkpoint."""
    import torch.distributed as dist

    out = ctx.tmp
    trainer = _ckpt_trainer(str(out))
    trainer.train()
    assert (out / "checkpoints" / "step_1").is_dir()
    dist.barrier()
    return out, trainer


@contextlib.contextmanager
def _nothing_changes(root: Path, trainer: Any = None) -> Any:
    """Whatever the body raises: no file under ``root`` and no parameter of ``trainer`` may change."""
    files = _snapshot(root)
    params = {n: p.detach().clone() for n, p in trainer.model.module.named_parameters()} if trainer else {}
    try:
        yield
    finally:
        after = _snapshot(root)
        changed = sorted(k for k in set(files) | set(after) if files.get(k) != after.get(k))
        assert not changed, f"checkpoint files changed by a failed call: {changed}"
        if trainer is not None:
            moved = [n for n, p in trainer.model.module.named_parameters() if not torch.equal(p, params[n])]
            assert not moved, f"parameters changed by a failed resume: {moved}"


def _copy_checkpoint(out: Path, name: str) -> Path:
    import shutil

    import torch.distributed as dist

    src, dst = out / "checkpoints" / "step_1", out / "checkpoints" / name
    if dist.get_rank() == 0:
        shutil.copytree(src, dst)
    dist.barrier()
    return dst


def ckpt_resume_partial_tmp_dir(ctx: CaseContext) -> None:
    import torch.distributed as dist

    out, trainer = _saved_run(ctx)
    partial = _copy_checkpoint(out, "step_2.tmp")
    if dist.get_rank() == 0:
        (partial / "merak_checkpoint.json").unlink()
    dist.barrier()
    with _nothing_changes(out / "checkpoints", trainer), ctx.guard():
        trainer.resume(str(partial))


def ckpt_resume_missing_dcp_metadata(ctx: CaseContext) -> None:
    import torch.distributed as dist

    out, trainer = _saved_run(ctx)
    broken = _copy_checkpoint(out, "step_7")
    if dist.get_rank() == 0:
        (broken / ".metadata").unlink()
    dist.barrier()
    with _nothing_changes(out / "checkpoints", trainer), ctx.guard():
        trainer.resume(str(broken))


def ckpt_resume_corrupt_meta_file(ctx: CaseContext) -> None:
    import torch.distributed as dist

    out, trainer = _saved_run(ctx)
    broken = _copy_checkpoint(out, "step_8")
    if dist.get_rank() == 0:
        (broken / "merak_checkpoint.json").write_text('{"format": "merak-dcp-1", "step": ')
    dist.barrier()
    with _nothing_changes(out / "checkpoints", trainer), ctx.guard():
        trainer.resume(str(broken))


def ckpt_resume_latest_without_checkpoint(ctx: CaseContext) -> None:
    trainer = _ckpt_trainer(str(ctx.tmp))
    with ctx.guard():
        trainer.resume("latest")


def ckpt_resume_other_model(ctx: CaseContext) -> None:
    out, trainer = _saved_run(ctx)
    other = _ckpt_trainer(str(out), hidden=6, layout=trainer.layout)
    # The model fingerprint is gathered over the pipeline stages once (all_gather_object): every rank
    # then rejects the checkpoint at the same point, before any tensor is read.
    with _nothing_changes(out / "checkpoints", other), ctx.guard(allow=("all_gather_object",)):
        other.resume("latest")


def ckpt_resume_other_batch_size(ctx: CaseContext) -> None:
    out, trainer = _saved_run(ctx)
    other = _ckpt_trainer(str(out), batch=4, layout=trainer.layout)
    # Runs through DCP's own collectives (metadata, then the read); the error must leave the trainer as it was.
    with _nothing_changes(out / "checkpoints", other):
        other.resume("latest")


def ckpt_resume_other_dataset(ctx: CaseContext) -> None:
    """A factory's training set of another size (24 samples, not 16): the saved position means nothing there."""
    out, trainer = _saved_run(ctx)
    other = _ckpt_trainer(str(out), layout=trainer.layout, data=_Pairs(24))
    with _nothing_changes(out / "checkpoints", other):
        other.resume("latest")


def ckpt_new_run_into_old_output_dir(ctx: CaseContext) -> None:
    out, trainer = _saved_run(ctx)
    again = _ckpt_trainer(str(out), layout=trainer.layout)  # a fresh run, no resume: step_1 exists already
    with _nothing_changes(out / "checkpoints"), ctx.guard():
        again.train()


# ----------------------------------------------------------------------------- exports


def ckpt_export_with_another_models_config(ctx: CaseContext) -> None:
    """``merak export CKPT --pretrained OTHER``: the classifier's checkpoint beside a GPT-2's config.json."""
    import torch.distributed as dist

    from tests.e2e._pretrained_support import save_tiny_model

    out, _ = _saved_run(ctx)
    if dist.get_rank() == 0:
        save_tiny_model("gpt2", ctx.tmp / "gpt2")
    dist.barrier()
    target = ctx.tmp / f"hf_rank{dist.get_rank()}"
    argv = [
        "export",
        str(out / "checkpoints" / "latest"),
        "--to-hf",
        str(target),
        "--pretrained",
        str(ctx.tmp / "gpt2"),
    ]
    try:
        with _nothing_changes(out / "checkpoints"):
            _merak(ctx, argv)
    finally:
        assert not target.exists(), f"the refused export wrote {sorted(p.name for p in target.iterdir())}"


def ckpt_export_onto_a_file(ctx: CaseContext) -> None:
    """``merak export CKPT --to-hf FILE``: a real checkpoint, an existing file where the folder should go."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    from merak_core.checkpoint.weights import read_checkpoint_model

    out, _ = _saved_run(ctx)
    latest = str(out / "checkpoints" / "latest")
    folder = ctx.tmp / f"folder_rank{dist.get_rank()}"  # a folder of this model (not a transformers one)
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "merak_test_classifier"}')
    save_file(read_checkpoint_model(latest), str(folder / "model.safetensors"))
    target = ctx.tmp / f"model_rank{dist.get_rank()}.safetensors"
    target.write_bytes(b"not a folder")
    try:
        _merak(ctx, ["export", latest, "--to-hf", str(target), "--pretrained", str(folder)])
    finally:
        assert target.read_bytes() == b"not a folder"


def cli_dry_run_export_hf_dir_is_a_file(ctx: CaseContext) -> None:
    (ctx.tmp / "hf").write_text("a file")
    job = _write_job(ctx, f"dp: 1\n  tp: 1\n  pp: 1\n  export_hf_dir: {ctx.tmp / 'hf'}")
    _merak(ctx, ["train", str(job), "--dry-run"])
