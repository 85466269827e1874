"""Resume with a changed job file: new optimizer and schedule settings apply, each change is logged once;
changes that cannot apply (model shapes, the vocabulary) are refused before any step.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e import _checkpoint_support as support
from tests.support.dist import run_on_ranks

BASE = dict(
    max_steps=5,
    save_steps=2,
    lr_scheduler_type="cosine",
    learning_rate=1e-2,
    weight_decay=0.1,
    max_grad_norm=0.5,
    warmup_steps=1,
)
CHANGES = dict(
    learning_rate=3e-3,
    weight_decay=0.05,
    adam_beta2=0.99,
    max_grad_norm=0.3,
    warmup_steps=0,
    lr_scheduler_type="linear",
)


def test_new_settings_apply_after_resume_and_are_logged_once(tmp_path: Path) -> None:
    kwargs = support.layout_kwargs(2, 1, 1, output_dir=str(tmp_path), **BASE)
    results = run_on_ranks(2, support.resume_pair_body, "gpt", kwargs, 2, CHANGES)
    reference = support.changed_settings_reference("gpt", kwargs, CHANGES, dp=2, switch_at=2)
    unchanged = support.changed_settings_reference("gpt", kwargs, {}, dp=2, switch_at=2)
    head = results[0]
    assert [head["full_losses"][s] for s in (1, 2)] == pytest.approx(unchanged[:2], rel=1e-9)
    assert sorted(head["losses"]) == [3, 4, 5]
    for step in (3, 4, 5):  # step 3's loss is taken before its update: the same as the old run's
        assert head["losses"][step] == pytest.approx(reference[step - 1], rel=1e-9, abs=1e-12), step
    for step in (4, 5):
        assert head["losses"][step] != pytest.approx(head["full_losses"][step], rel=1e-6), (
            "new values ignored"
        )
    resume_lines = [m for m in head["logs"] if m.startswith("resume: ")]
    assert resume_lines == [
        "resume: learning_rate 0.01 -> 0.003 (job file)",
        "resume: weight_decay 0.1 -> 0.05 (job file)",
        "resume: adam_beta2 0.999 -> 0.99 (job file)",
        "resume: lr_scheduler_type 'cosine' -> 'linear' (job file)",
        "resume: warmup_steps 1 -> 0 (job file)",
        "resume: max_grad_norm 0.5 -> 0.3 (job file)",
    ]
    assert not [m for m in results[1]["logs"] if m.startswith("resume: ")]  # rank 0 only


def test_more_steps_after_a_finished_run_continue_it_exactly(tmp_path: Path) -> None:
    common = dict(save_steps=2, lr_scheduler_type="constant", warmup_steps=0)
    kwargs = support.layout_kwargs(1, 1, 2, output_dir=str(tmp_path), max_steps=4, **common)
    res = run_on_ranks(2, support.resume_pair_body, "gpt", kwargs, 4, {"max_steps": 6})[0]
    longer = support.layout_kwargs(1, 1, 2, output_dir=str(tmp_path / "ref"), max_steps=6, **common)
    reference = run_on_ranks(2, support.train_body, "gpt", longer)[0]
    assert res["resumed_step"] == 4 and res["losses"] == {s: reference["losses"][s] for s in (5, 6)}
    assert "resume: max_steps 4 -> 6 (job file)" in res["logs"]


def test_changed_vocabulary_is_refused_before_any_step(tmp_path: Path) -> None:
    run_on_ranks(
        1,
        support.train_body,
        "gpt",
        support.layout_kwargs(1, 1, 1, output_dir=str(tmp_path), max_steps=2, save_steps=2),
    )
    message = run_on_ranks(1, support.load_error_body, str(tmp_path), "latest", "gpt_vocab128")[0]
    assert "(step 2) was written for another model" in message
    assert "parameter wte.weight: checkpoint [96, 32] vs model [128, 32]" in message
    assert "Model shapes (layer sizes, layer counts, the vocabulary) cannot change on resume" in message
    assert "start a new run in another output_dir" in message
