"""One way from a job to a running Trainer (merak_core.autoplan.prepare): planned once, assembled, same numbers.

``prepare_job`` resolves the layout (the planner runs there, once), builds the model, the loaders
and the engine; ``Trainer.from_prepared`` assembles them and never plans. The Python API
``Trainer(model, args, dataset)`` goes through the same ``prepare_run`` and trains bit-identically.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Any

import torch

from tests.support.dist import run_on_ranks

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples/addition/config.yaml"
TRAINER = ROOT / "packages/merak-core/src/merak_core/trainer.py"


def _job_and_api(out_dir: str) -> dict[str, Any]:
    from merak_core.autoplan import auto
    from merak_core.autoplan.prepare import prepare_job
    from merak_core.job import JobConfig
    from merak_core.trainer import Trainer

    job = JobConfig.from_yaml(
        DEMO,
        [
            f"training.output_dir={out_dir}/job",
            "training.dp=1",
            "training.tp=1",
            "training.pp=2",
            "training.max_steps=2",
            "training.logging_steps=1",
            "training.eval_steps=null",
            "data.kwargs.train_size=256",
            "data.kwargs.eval_size=16",
        ],
    )
    calls: list[str] = []
    original = auto.plan_for_job

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append("plan_for_job")
        return original(*args, **kwargs)

    auto.plan_for_job = counting  # type: ignore[assignment]
    try:
        datasets = job.build_datasets()
        via_job = Trainer.from_prepared(prepare_job(job, datasets))
        job_calls = len(calls)
        job_losses = [float(r["loss"]) for r in via_job.train()]
        torch.manual_seed(job.training.seed)
        api = Trainer(
            job.build_model(),
            dataclasses.replace(job.training, output_dir=f"{out_dir}/api"),
            datasets[0],
            datasets[1],
            loss_fn=job.optional("loss"),
            data_collator=job.optional("collate"),
            compute_metrics=job.optional("metrics"),
        )
        api_losses = [float(r["loss"]) for r in api.train()]
    finally:
        auto.plan_for_job = original  # type: ignore[assignment]
    return {
        "job_calls": job_calls,
        "after_train_calls": len(calls),
        "job": job_losses,
        "api": api_losses,
        "pp": via_job.layout.pp,
    }


def test_a_job_is_planned_once_and_trains_like_the_python_api(tmp_path: Path) -> None:
    results = run_on_ranks(2, _job_and_api, str(tmp_path))
    for r in results:
        assert r["pp"] == 2
        assert r["job_calls"] == 1  # prepare_job asks the planner once (a manual layout: nothing to do)
        assert r["after_train_calls"] == 1  # neither the Trainer nor the loop plans again
        assert len(r["job"]) == 2 and r["job"] == r["api"]  # bit-identical


def test_the_trainer_never_imports_the_planner() -> None:
    tree = ast.parse(TRAINER.read_text(encoding="utf-8"))
    names = {
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    assert not {
        n for n in names if n and (n.startswith("merak_core.planner.") or n == "merak_core.autoplan.auto")
    }
