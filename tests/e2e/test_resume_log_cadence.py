"""A resumed run logs on the same cadence as one run: no extra record at the step it resumed from.

``logging_steps=2`` over 6 steps logs steps 1, 2, 4 and 6 (the first, every second, the last).
The same run stopped after step 3 and resumed from its step-2 checkpoint must leave the same
steps in ``metrics.jsonl`` (the first segment's step 3 is dropped on resume; the resumed
segment's first step, 3, is off the cadence and is not logged again).
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.e2e._checkpoint_support import layout_kwargs, make_trainer
from tests.support.dist import run_on_ranks


def train_body(out: str, max_steps: int, resume: str | None) -> None:
    trainer = make_trainer(
        "gpt", layout_kwargs(2, 1, 1, max_steps=max_steps, output_dir=out, logging_steps=2, save_steps=2)
    )
    if resume is not None:
        trainer.resume(resume)
    trainer.train()


def _logged_steps(out: Path) -> list[int]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, lines) if "loss" in r]


def test_a_resumed_run_logs_the_steps_of_one_run(tmp_path: Path) -> None:
    whole, split = tmp_path / "whole", tmp_path / "split"
    run_on_ranks(2, train_body, str(whole), 6, None)
    run_on_ranks(2, train_body, str(split), 3, None)
    run_on_ranks(2, train_body, str(split), 6, str(split / "checkpoints" / "step_2"))
    assert _logged_steps(whole) == [1, 2, 4, 6]
    assert _logged_steps(split) == [1, 2, 4, 6]
