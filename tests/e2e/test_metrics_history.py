"""The metrics history survives resumes: metrics.jsonl keeps the records up to the resumed step (later ones,
from the interrupted segment, are dropped) and appends; the loss plot and the summary cover the whole run;
every line is strict JSON (null for NaN)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from tests.e2e import _fault_support as faults
from tests.support.dist import run_on_ranks


def _strict(path: Path) -> list[dict[str, Any]]:
    def refuse(name: str) -> None:
        raise ValueError(f"bare {name} in {path}")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def test_resumed_writer_keeps_the_history_up_to_the_resumed_step(tmp_path: Path) -> None:
    from merak_core.run.metrics import MetricsWriter

    first = MetricsWriter(str(tmp_path), enabled=True)
    first.start(6)
    for step in range(1, 6):  # the first segment ran to step 5 (checkpoint at 3)
        first.log({"step": step, "loss": 10.0 - step if step != 2 else float("nan"), "lr": 1e-3})
    first.log({"step": 3, "eval_loss": 4.5})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "loss"')  # torn by the crash
    second = MetricsWriter(str(tmp_path), enabled=True)
    second.start(6, resumed_step=3)
    for step in (4, 5, 6):
        second.log({"step": step, "loss": 1.0 * step, "lr": 1e-3})
    records = _strict(tmp_path / "metrics.jsonl")
    assert [(r["step"], r.get("loss", "eval")) for r in records] == [
        (1, 9.0),
        (2, None),
        (3, 7.0),
        (3, "eval"),
        (4, 4.0),
        (5, 5.0),
        (6, 6.0),
    ]
    assert second.summary() == {
        "first_loss": 9.0,
        "first_loss_step": 1,
        "final_loss": 6.0,
        "skipped_steps": 0,
    }
    # A skipped first step (NaN loss, null in the file) does not make the first loss NaN: the first finite one.
    skipped = MetricsWriter(str(tmp_path / "skipped"), enabled=True)
    skipped.start(3)
    skipped.log({"step": 1, "loss": float("nan"), "skipped": True, "skipped_steps": 1})
    skipped.log({"step": 2, "loss": 5.0})
    skipped.log({"step": 3, "loss": 4.0})
    assert skipped.summary() == {
        "first_loss": 5.0,
        "first_loss_step": 2,
        "final_loss": 4.0,
        "skipped_steps": 1,
    }
    resumed = MetricsWriter(str(tmp_path / "skipped"), enabled=True)
    resumed.start(3, resumed_step=2)  # the records read back from metrics.jsonl: the skipped loss is null
    assert resumed.summary()["first_loss"] == 5.0 and resumed.summary()["first_loss_step"] == 2
    # The plot of the whole run, when the optional matplotlib (the ``plot`` extra) is installed.
    drawn = importlib.util.find_spec("matplotlib") is not None
    assert second.finish() == (str(tmp_path / "loss.png") if drawn else None)
    assert (tmp_path / "loss.png").exists() == drawn
    # A fresh (not resumed) run starts a new history.
    third = MetricsWriter(str(tmp_path), enabled=True)
    third.start(2)
    third.log({"step": 1, "loss": 3.0})
    assert [r["step"] for r in _strict(tmp_path / "metrics.jsonl")] == [1]


def test_a_disabled_writer_touches_nothing(tmp_path: Path) -> None:
    from merak_core.run.metrics import MetricsWriter

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    quiet = MetricsWriter(str(tmp_path), enabled=False)
    quiet.start(3)
    quiet.log({"step": 1, "loss": 5.0})
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 2.0}\n'


def history_body(out: str, max_steps: int, resume: str | None) -> dict[str, Any]:
    trainer = faults.signal_trainer((2, 1, 1), out, max_steps, save_steps=2)
    if resume is not None:
        trainer.resume(resume)
    history = trainer.train()
    return {"losses": [h["loss"] for h in history], "summary": trainer.metrics.summary()}


def test_resume_appends_to_the_run_history(tmp_path: Path) -> None:
    out = str(tmp_path / "out")
    whole = run_on_ranks(2, history_body, str(tmp_path / "whole"), 6, None)[0]
    run_on_ranks(2, history_body, out, 5, None)  # stopped after step 5; checkpoints at 2 and 4
    resumed = run_on_ranks(2, history_body, out, 6, str(Path(out) / "checkpoints" / "step_4"))[0]
    records = [r for r in _strict(Path(out) / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]  # step 5 of the first segment was dropped
    assert [r["loss"] for r in records] == pytest.approx(whole["losses"], rel=1e-12)
    assert resumed["summary"]["first_loss"] == pytest.approx(whole["losses"][0], rel=1e-12)
    assert resumed["losses"] == pytest.approx(whole["losses"][4:], rel=1e-12)
