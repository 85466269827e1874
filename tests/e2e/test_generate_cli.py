"""``merak generate``: a checkpoint of a fine-tuning job (a GPT-2 folder, text data) continues prompts
on the job's layout exactly as transformers' ``generate`` does with the same weights, and the command
refuses, before torchrun and in one line (exit 2), what it cannot run.

In-pool (2 ranks, pp=2): one training step saves a checkpoint; the ranks' body of ``merak generate``
(:func:`merak_core.cli.generate_job.generate_job`) then runs at pp=2 and, from the same checkpoint, at
tp=2; the reference is a transformers GPT-2 holding the checkpoint's weights (float64), fed the
same left-padded prompts. The refusals go through ``merak generate --dry-run`` in this process.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tests.e2e._pretrained_support import make_folder
from tests.support.dist import run_on_ranks

pytestmark = pytest.mark.transformers

PROMPTS = ["the model reads", "a tensor", "every rank reads its own stage of the"]
NEW = 5


def _job(tmp: Path, **training: Any) -> Path:
    raw = {
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
            "tp": 1,
            "pp": 2,
            "per_device_train_batch_size": 2,
            "per_device_eval_batch_size": 2,
            "gradient_accumulation_steps": 2,
            "max_steps": 1,
            "save_steps": 1,
            "learning_rate": 1e-2,
            "dtype": "float64",
            "logging_steps": 1,
            **training,
        },
    }
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _train_then_generate(job_path: str, tokenizer: str) -> dict[str, Any]:
    from merak_core import Trainer, init
    from merak_core.cli.generate_job import generate_job
    from merak_core.job import JobConfig

    job = JobConfig.from_yaml(job_path)
    t = job.training
    train, evaluation = job.build_datasets()
    layout = init(dp=t.dp, tp=t.tp, pp=t.pp)
    torch.manual_seed(t.seed)
    trainer = Trainer(job.build_model(), t, train, evaluation, layout=layout, pretrained=job.model.pretrained)
    trainer.train()  # saves step 1
    state = trainer.full_state_dict()
    greedy = {"max_new_tokens": NEW, "do_sample": False}
    same = generate_job(job, "latest", PROMPTS, greedy, tokenizer=tokenizer, batch_size=2)
    tp2 = JobConfig.from_yaml(job_path, ["training.tp=2", "training.pp=1"])
    other = generate_job(tp2, "latest", PROMPTS, greedy, tokenizer=tokenizer, batch_size=3)
    return {"state": state, "same": same, "other": other}


def _reference(folder: Path, state: dict[str, torch.Tensor]) -> list[list[int]]:
    """transformers' greedy generate with the checkpoint's weights on the left-padded prompts."""
    import transformers as tf
    from tokenizers import Tokenizer

    model = tf.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float64).eval()
    model.load_state_dict(state, strict=False)  # lm_head.weight is wte.weight
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = [tok.encode(p).ids for p in PROMPTS]
    width = max(map(len, ids))
    input_ids = torch.zeros((len(ids), width), dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for row, tokens in enumerate(ids):
        input_ids[row, width - len(tokens) :] = torch.tensor(tokens)
        mask[row, width - len(tokens) :] = 1
    eos = model.config.eos_token_id
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            max_new_tokens=NEW,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=0,
        )
    rows = []
    for row in out[:, width:].tolist():
        rows.append(row[: row.index(eos)] if eos in row else row)
    return rows


def _generate(*argv: str) -> tuple[int, str, str]:
    from merak_core.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            status = main(["--log-level", "WARNING", "generate", *argv])
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else 2
    return status, out.getvalue(), err.getvalue()


def test_generate_from_a_checkpoint_equals_transformers_and_refuses_before_launch(tmp_path: Path) -> None:
    folder, _ = make_folder("gpt2", tmp_path)
    job = _job(tmp_path)
    status, _, err = _generate(str(job), "--prompt", "the model", "--dry-run")
    assert status == 2 and "holds no checkpoint" in err and err.count("\n") == 1, err

    results = run_on_ranks(2, _train_then_generate, str(job), str(folder))
    expected = _reference(folder, results[0]["state"])
    for rank, result in enumerate(results):
        for key in ("same", "other"):
            assert [r["prompt"] for r in result[key]] == PROMPTS
            assert [r["tokens"] for r in result[key]] == expected, f"rank {rank} {key}"
    assert any(len(row) == NEW for row in expected)

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    status, out, err = _generate(
        str(job), "--prompts", str(prompts), "--seed", "3", "--top-p", "0.9", "--dry-run"
    )
    assert status == 0, err
    assert "merak_core.cli.generate_job" in out and "--top-p 0.9" in out and "--nproc-per-node=2" in out
    refusals = {
        ("training.tp=3", "training.pp=1"): "3",  # 4 heads do not divide over 3 TP ranks
        ("training.virtual_stages=2", "training.schedule=interleaved_1f1b"): "training.virtual_stages=2",
        ("--checkpoint", "step_9"): "no such checkpoint",
        ("training.overlap_chunks=2", "training.tp=2", "training.pp=1"): "training.overlap_chunks=2",
        ("--tokenizer", str(tmp_path / "none.json")): "does not exist",
        ("--temperature", "-1"): "temperature",
    }
    for extra, needle in refusals.items():
        status, _, err = _generate(str(job), "--prompt", "the", "--dry-run", *extra)
        assert status == 2 and needle in err and err.count("\n") == 1, (extra, err)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt key"}\n')
    status, _, err = _generate(str(job), "--prompts", str(bad), "--dry-run")
    assert status == 2 and "line 1" in err, err


def test_the_tokenizer_comes_from_the_job(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from merak_core.cli.generate_job import tokenizer_path

    folder = tmp_path / "model"
    folder.mkdir()
    job = SimpleNamespace(
        data=SimpleNamespace(spec="tests:data", kwargs={}), model=SimpleNamespace(pretrained=str(folder))
    )
    with pytest.raises(ValueError, match="names no tokenizer.*--tokenizer PATH"):
        tokenizer_path(job, None)
    (folder / "tokenizer.json").write_text("{}")
    assert tokenizer_path(job, None) == str(folder)
    assert tokenizer_path(job, "x.json") == "x.json"


def _train_only(job_path: str) -> dict[str, torch.Tensor] | None:
    from merak_core import Trainer, init
    from merak_core.job import JobConfig

    job = JobConfig.from_yaml(job_path)
    t = job.training
    train, evaluation = job.build_datasets()
    layout = init(dp=t.dp, tp=t.tp, pp=t.pp)
    torch.manual_seed(t.seed)
    trainer = Trainer(job.build_model(), t, train, evaluation, layout=layout, pretrained=job.model.pretrained)
    trainer.train()  # saves step 1
    return trainer.full_state_dict()


@pytest.mark.slow
def test_merak_generate_through_torchrun(tmp_path: Path) -> None:
    """The real command: torchrun with the job's 2 ranks (pp=2) writes JSONL records equal to transformers'
    generate with the checkpoint's weights; one ``--prompt`` prints its continuation."""
    import os
    import subprocess
    import sys

    folder, _ = make_folder("gpt2", tmp_path)
    job = _job(tmp_path)
    state = run_on_ranks(2, _train_only, str(job))[0]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    base = [sys.executable, "-m", "merak_core.cli", "--log-level", "WARNING", "generate", str(job)]
    out = tmp_path / "samples.jsonl"
    run = subprocess.run(
        [*base, "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", str(NEW)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in records] == PROMPTS
    assert [r["tokens"] for r in records] == _reference(folder, state)
    # ``--prompt TEXT`` prints the prompt and its continuation (rank 0's writer; a second torchrun job
    # would only repeat the launch above).
    from merak_core.cli.generate_job import _write, read_prompts

    assert read_prompts(PROMPTS[0], None) == [PROMPTS[0]]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        _write(records[:1], None, single=True)
    assert printed.getvalue() == PROMPTS[0] + records[0]["text"] + "\n"


def _lm_eval_weights(job_path: str) -> dict[str, torch.Tensor] | None:
    from merak_core.cli.lm_eval_model import trainer_for_job

    trainer, _ = trainer_for_job(job_path, "latest", [])
    return trainer.full_state_dict()


def test_the_lm_eval_model_builds_the_job_with_the_checkpoint_weights(tmp_path: Path) -> None:
    """``lm_eval --model merak --model_args job=...,checkpoint=latest`` (and ``merak eval --tasks``) build the run
    as ``merak generate`` does: the job's layout (pp=2), the checkpoint's weights, bit for bit."""
    pytest.importorskip("lm_eval")
    make_folder("gpt2", tmp_path)
    job = str(_job(tmp_path))
    trained = run_on_ranks(2, _train_only, job)[0]
    loaded = run_on_ranks(2, _lm_eval_weights, job)[0]
    assert trained is not None and loaded is not None and trained.keys() == loaded.keys()
    for name, value in trained.items():
        assert torch.equal(loaded[name], value), name
