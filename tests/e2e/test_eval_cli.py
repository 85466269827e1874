"""``merak eval``: a checkpoint's loss, perplexity and the job's metrics on the job's eval text, equal to a
single-process evaluation of the same weights over every eval sample (the last batch padded and masked),
in the training layout and in another one."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tests.e2e._fault_support import job_env
from tests.support.dist import run_on_ranks
from tests.support.text import make_tokenizer, sentences

EVAL_LAYOUT = ["training.dp=1", "training.pp=2"]


def _job(tmp: Path) -> Path:
    tok = make_tokenizer(tmp / "tok", vocab_size=300)
    (tmp / "corpus.txt").write_text("\n".join(sentences(90, seed=31)))
    job = {
        "model": {"factory": "tests.support.text:text_model"},
        "data": {
            "format": "text",
            "path": "corpus.txt",
            "tokenizer": str(tok.relative_to(tmp)),
            "seq_len": 8,
            "eval_fraction": 0.05,
            "cache_dir": "cache",
        },
        "metrics": "tests.support.text:token_metrics",
        "training": {
            "dp": 2,
            "tp": 1,
            "pp": 1,
            "per_device_train_batch_size": 2,
            "gradient_accumulation_steps": 2,
            "per_device_eval_batch_size": 2,
            "max_steps": 2,
            "save_steps": 2,
            "dtype": "float64",
            "learning_rate": 1e-3,
            "output_dir": str(tmp / "out"),
            "logging_steps": 100,
            "seed": 5,
        },
    }
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _reference(state: dict[str, torch.Tensor], evaluation: Any) -> dict[str, float]:
    """One process, one batch of every eval sample: the token-mean cross-entropy and the accuracy."""
    from merak_core.run.engine import default_loss
    from tests.support.text import text_model, token_metrics

    model = text_model()
    model.load_state_dict(state, strict=False)  # lm_head.weight is wte.weight (tied)
    batch = torch.utils.data.default_collate([evaluation[i] for i in range(len(evaluation))])
    with torch.no_grad():
        logits = model(batch["input_ids"])
    metrics = token_metrics(logits, batch["labels"])
    return {
        "eval_loss": float(default_loss(logits, batch["labels"])),
        **{f"eval_{k}": float(v.mean()) for k, v in metrics.items()},
    }


def _train_then_eval(job_path: str) -> dict[str, Any]:
    import torch.distributed as dist

    from merak_core import Trainer, init
    from merak_core.cli.eval_job import evaluate_job
    from merak_core.job import JobConfig

    job = JobConfig.from_yaml(job_path)
    t = job.training
    train, evaluation = job.build_datasets()
    layout = init(dp=t.dp, tp=t.tp, pp=t.pp)
    torch.manual_seed(t.seed)
    trainer = Trainer(
        job.build_model(), t, train, evaluation, compute_metrics=job.optional("metrics"), layout=layout
    )
    trainer.train()  # saves step 2
    state = trainer.full_state_dict()
    same = evaluate_job(job, "latest")
    other = evaluate_job(JobConfig.from_yaml(job_path, EVAL_LAYOUT), "latest")
    reference = _reference(state, evaluation) if dist.get_rank() == 0 else None
    return {"same": same, "other": other, "reference": reference, "eval_samples": len(evaluation)}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    job = _job(tmp_path_factory.mktemp("eval"))
    return job, run_on_ranks(2, _train_then_eval, str(job))[0]


def test_eval_equals_a_single_process_evaluation_in_any_layout(trained: tuple[Path, dict[str, Any]]) -> None:
    _, result = trained
    samples = result["eval_samples"]
    assert samples % (2 * 2) != 0  # the last eval batch is padded (dp 2 x batch 2)
    reference = result["reference"]
    for got in (result["same"], result["other"]):
        assert got["step"] == 2 and got["samples"] == samples and got["split"] == "eval"
        assert got["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-12)
        assert got["eval_token_accuracy"] == pytest.approx(
            reference["eval_token_accuracy"], rel=1e-12, abs=1e-15
        )
        assert got["eval_label_logit"] == pytest.approx(reference["eval_label_logit"], rel=1e-12)
        assert got["eval_perplexity"] == pytest.approx(math.exp(reference["eval_loss"]), rel=1e-12)


def test_format_and_refusals(tmp_path: Path) -> None:
    import argparse

    from merak_core.cli.eval_job import eval_command, format_result, perplexity, pick_split

    line = format_result(
        {
            "step": 7,
            "checkpoint": "latest",
            "split": "eval",
            "samples": 11,
            "eval_loss": 2.0,
            "eval_perplexity": math.exp(2.0),
            "eval_accuracy": 0.25,
        }
    )
    assert line == (
        "eval: step 7 (checkpoint latest), 11 eval samples  eval_loss 2.0000  eval_perplexity 7.3891  "
        "eval_accuracy 0.2500"
    )
    assert perplexity(1e6) == math.inf
    with pytest.raises(ValueError, match="no eval data: set data.eval_fraction"):
        pick_split(([1], None), "eval", "merak eval")
    job = _job(tmp_path)
    args = argparse.Namespace(
        config=str(job),
        overrides=[],
        checkpoint="latest",
        split="eval",
        json=None,
        nproc_per_node=None,
        dry_run=True,
    )
    with pytest.raises(ValueError, match="--checkpoint latest: .* holds no checkpoint"):
        eval_command(args)
    args.checkpoint = str(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="no such checkpoint"):
        eval_command(args)


@pytest.mark.slow
def test_merak_eval_prints_loss_perplexity_and_metrics(
    trained: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    job, result = trained
    out = tmp_path / "eval.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "merak_core.cli",
            "eval",
            str(job),
            *EVAL_LAYOUT,
            "--checkpoint",
            "latest",
            "--json",
            str(out),
        ],
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("eval: ")]
    expected = result["other"]
    assert lines == [
        f"eval: step 2 (checkpoint latest), {expected['samples']} eval samples  "
        f"eval_loss {expected['eval_loss']:.4f}  eval_perplexity {expected['eval_perplexity']:.4f}  "
        f"eval_label_logit {expected['eval_label_logit']:.4f}  "
        f"eval_token_accuracy {expected['eval_token_accuracy']:.4f}"
    ]
    written = json.loads(out.read_text())
    assert written["eval_loss"] == pytest.approx(expected["eval_loss"], rel=1e-12)


def _sft_eval(job_path: str, overrides: list[str]) -> dict[str, Any]:
    import torch.distributed as dist

    from merak_core import Trainer, init
    from merak_core.job import JobConfig

    job = JobConfig.from_yaml(job_path, overrides)
    t = job.training
    _, evaluation = job.build_datasets()
    torch.manual_seed(t.seed)
    trainer = Trainer(job.build_model(), t, None, evaluation, layout=init(dp=t.dp, tp=t.tp, pp=t.pp))
    got = trainer.evaluate()
    state = trainer.full_state_dict()
    return {"got": got, "reference": _reference(state, evaluation) if dist.get_rank() == 0 else None}


def test_eval_loss_is_the_token_mean_when_prompts_are_masked(tmp_path: Path) -> None:
    """Prompt/response data: samples count different numbers of labels; the eval loss is the mean over every
    counted token of the eval set, whatever the layout and the microbatches."""
    from tests.support.text import write_jsonl

    write_jsonl(
        tmp_path / "sft.jsonl",
        [
            {"q": q, "a": a}
            for q, a in zip(sentences(40, seed=51, words=12), sentences(40, seed=52), strict=True)
        ],
    )
    raw = yaml.safe_load(_job(tmp_path).read_text())
    raw["data"] = {
        "format": "jsonl",
        "path": "sft.jsonl",
        "prompt_field": "q",
        "response_field": "a",
        "tokenizer": "tok",
        "seq_len": 16,
        "packing": False,
        "eval_fraction": 0.3,
        "cache_dir": "cache",
    }
    job = tmp_path / "sft.yaml"
    job.write_text(yaml.safe_dump(raw))
    for layout in (["training.dp=2", "training.per_device_eval_batch_size=3"], EVAL_LAYOUT):
        result = run_on_ranks(2, _sft_eval, str(job), layout)[0]
        assert result["got"]["eval_loss"] == pytest.approx(result["reference"]["eval_loss"], rel=1e-12)
