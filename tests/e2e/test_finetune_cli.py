"""``model.pretrained`` and ``export_hf_dir`` in a job file, through the real CLI.

Fast: ``merak train --dry-run`` (in this process, no torchrun) refuses a bad ``model.pretrained``
folder, or one whose tensors do not fit the model, with the path and the fix, before anything
starts. Slow (one subprocess run): ``merak train`` fine-tunes a GPT-2 folder on text data
(``data: {format: text}``) at pp=2, exports it at the end (``export_hf_dir``), and ``merak export
latest --job`` (its command in this process: one process, no torchrun) writes the same tensors from
the final checkpoint; transformers loads both.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tests.e2e._pretrained_support import make_folder, read_folder

pytestmark = pytest.mark.transformers


def _job(tmp: Path, **training: Any) -> dict[str, Any]:
    return {
        "model": {"pretrained": "gpt2"},
        "data": {
            "format": "text",
            "path": "train.txt",
            "tokenizer": "gpt2",
            "seq_len": 8,
            "eval_fraction": 0.1,
            "cache_dir": str(tmp / "cache"),
            "add_eos": False,
        },
        "training": {
            "output_dir": str(tmp / "out"),
            "dp": 1,
            "tp": 1,  # the CLI path; the export of TP shards at 2x2x2 is test_pretrained_finetune's (in-pool)
            "pp": 2,
            "per_device_train_batch_size": 2,
            "per_device_eval_batch_size": 2,
            "gradient_accumulation_steps": 2,
            "max_steps": 2,
            "learning_rate": 1e-3,
            "logging_steps": 1,
            **training,
        },
    }


def _write(tmp: Path, raw: dict[str, Any]) -> Path:
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _dry_run(job: Path) -> tuple[int, str]:
    from merak_core.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            status = main(["--log-level", "WARNING", "train", str(job), "--dry-run"])
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else 2
    return status, err.getvalue()


def test_a_bad_pretrained_folder_is_refused_before_launch(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from merak_core.run.exitcodes import BAD_INPUT

    make_folder("gpt2", tmp_path)
    raw = _job(tmp_path)
    raw["model"]["pretrained"] = "missing"
    status, err = _dry_run(_write(tmp_path, raw))
    assert status == BAD_INPUT, err
    assert f"{tmp_path / 'missing'}" in err and "is not a directory" in err and "save_pretrained" in err
    # A folder whose config.json and weights disagree: found from the file headers, before launch.
    config = json.loads((tmp_path / "gpt2" / "config.json").read_text())
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({**config, "n_embd": 64}))
    status, err = _dry_run(_write(tmp_path, _job(tmp_path)))
    assert status == BAD_INPUT, err
    assert "has shape [96, 32], the model built from its config.json has [96, 64]" in err


def test_a_good_pretrained_job_passes_the_launch_checks(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    make_folder("gpt2", tmp_path)
    status, err = _dry_run(_write(tmp_path, _job(tmp_path)))
    assert status == 0, err


def _merak(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "merak_core.cli", *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_merak_train_exports_and_merak_export_latest_agrees(tmp_path: Path) -> None:
    tf = pytest.importorskip("transformers")
    make_folder("gpt2", tmp_path)
    job = _write(tmp_path, _job(tmp_path, save_steps=2, export_hf_dir=str(tmp_path / "hf")))
    run = _merak("train", str(job), cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    # ``merak export`` is one process without torchrun: its command runs in this one (as in test_lora).
    from merak_core.cli import main

    export = ["export", "latest", "--job", str(job), "--to-hf", str(tmp_path / "from_ckpt")]
    assert main(["--log-level", "WARNING", *export]) == 0
    at_end, from_checkpoint = read_folder(tmp_path / "hf"), read_folder(tmp_path / "from_ckpt")
    # One format: the run at pp=2 and merak export write the same files (one model.safetensors here).
    shards = [sorted(p.name for p in (tmp_path / d).glob("model*")) for d in ("hf", "from_ckpt")]
    assert shards[0] == shards[1] == ["model.safetensors"], shards
    original = read_folder(tmp_path / "gpt2")
    assert sorted(at_end) == sorted(from_checkpoint) == sorted(original)
    assert all(torch.equal(at_end[k], from_checkpoint[k]) for k in at_end)
    assert any(not torch.equal(at_end[k], original[k]) for k in at_end)  # it trained
    for folder in ("hf", "from_ckpt"):
        assert (tmp_path / folder / "tokenizer.json").read_bytes() == (
            tmp_path / "gpt2" / "tokenizer.json"
        ).read_bytes()
        model = tf.AutoModelForCausalLM.from_pretrained(str(tmp_path / folder))
        assert torch.equal(model.transformer.wte.weight.detach(), at_end["transformer.wte.weight"])
