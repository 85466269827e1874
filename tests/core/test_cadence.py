"""The loop's cadence (merak_core.run.cadence): when the Trainer logs, saves and evaluates. Pure, no processes."""

from __future__ import annotations

import torch

from merak_core.config import TrainingArguments
from merak_core.run.cadence import Cadence, count_tokens, step_record


def _due(cadence: Cadence, total: int) -> dict[str, list[int]]:
    steps = range(1, total + 1)
    return {
        "log": [s for s in steps if cadence.log_due(s, first=1, total=total, skipped=s == 4)],
        "save": [s for s in steps if cadence.save_due(s)],
        "eval": [s for s in steps if cadence.eval_due(s)],
    }


def test_periodic_and_final_steps() -> None:
    args = TrainingArguments(logging_steps=3, save_steps=4, eval_steps=5, max_steps=10)
    cadence = Cadence.of(args, evaluates=True)
    # The first, every third, the skipped step 4 and the last are logged.
    assert _due(cadence, 10) == {"log": [1, 3, 4, 6, 9, 10], "save": [4, 8], "eval": [5, 10]}
    assert cadence.final_save_due(10) and not cadence.final_save_due(8)
    assert not cadence.final_eval_due(10) and cadence.final_eval_due(9)


def test_nothing_periodic_and_no_eval_dataset() -> None:
    cadence = Cadence.of(TrainingArguments(logging_steps=100, max_steps=6), evaluates=False)
    assert _due(cadence, 6) == {"log": [1, 4, 6], "save": [], "eval": []}
    assert not cadence.final_save_due(6) and not cadence.final_eval_due(6)
    # With an eval dataset but no eval_steps, evaluation happens once, at the end.
    assert Cadence.of(TrainingArguments(max_steps=6), evaluates=True).final_eval_due(6)


def test_step_record_and_token_count() -> None:
    plain = step_record(step=2, loss=1.5, lr=1e-3, step_time_s=0.1, grad_norm=None, skipped_steps=None)
    assert list(plain) == ["step", "loss", "lr", "step_time_s"]
    skipped = step_record(step=3, loss=float("nan"), lr=1e-3, step_time_s=0.1, grad_norm=2.0, skipped_steps=1)
    assert list(skipped) == ["step", "loss", "lr", "step_time_s", "grad_norm", "skipped", "skipped_steps"]
    assert count_tokens(torch.zeros(4, 8, dtype=torch.long)) == 32  # token ids: tokens
    assert count_tokens({"x": torch.zeros(4, 8)}) == 4  # features: samples
    assert count_tokens(None) == 0
