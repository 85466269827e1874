"""The life of a job past its faults: a full disk during a save, a deleted checkpoint that ``latest``
still names, and a finished job resumed. In the pool (pp=2, 2 ranks), each against the
uninterrupted run."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from tests.e2e import _job_life_support as life
from tests.e2e._checkpoint_support import layout_kwargs, train_body
from tests.support.dist import run_on_ranks


def _kwargs(tmp: Path) -> dict:
    return layout_kwargs(1, 1, 2, output_dir=str(tmp), max_steps=4, save_steps=2)


def test_a_full_disk_during_a_save_keeps_latest_and_names_the_error(tmp_path: Path) -> None:
    reference = run_on_ranks(2, train_body, "gpt", _kwargs(tmp_path / "ref"))[0]
    kwargs = _kwargs(tmp_path / "run")
    results = run_on_ranks(2, life.disk_full_body, kwargs, 1, 4)  # rank 1's shard of step 4: ENOSPC
    tmp = tmp_path / "run" / "checkpoints" / "step_4.tmp"
    for rank, res in enumerate(results):
        assert res["error"] == (
            f"RuntimeError: rank {rank}: writing checkpoint {str(tmp)!r} failed (the previous "
            "checkpoint is untouched, the partial directory removed): rank 1: OSError: [Errno 28] No space left "
            "on device"
        )
    root = tmp_path / "run" / "checkpoints"
    assert (root / "latest").read_text() == "step_2\n" and not (root / "step_4").exists()
    assert not tmp.exists(), "a full disk keeps no partial step_4.tmp filling it"
    resumed = run_on_ranks(2, life.resume_body, kwargs)[0]
    assert resumed["resumed_step"] == 2 and resumed["warnings"] == []
    assert resumed["losses"] == {s: reference["losses"][s] for s in (3, 4)}  # bit for bit
    assert (root / "latest").read_text() == "step_4\n" and not tmp.exists(), "the next save cleans up"


def test_latest_naming_a_deleted_checkpoint_falls_back_with_a_warning(tmp_path: Path) -> None:
    kwargs = _kwargs(tmp_path)
    full = run_on_ranks(2, train_body, "gpt", kwargs)[0]
    root = tmp_path / "checkpoints"
    shutil.rmtree(root / "step_4")
    resumed = run_on_ranks(2, life.resume_body, kwargs)
    assert [r["resumed_step"] for r in resumed] == [2, 2]
    assert resumed[0]["warnings"] == [
        f"the 'latest' pointer {root / 'latest'} names step_4, which does not exist "
        "(deleted?): using the newest committed checkpoint, step_2"
    ]
    assert resumed[1]["warnings"] == []
    assert resumed[0]["losses"] == {s: full["losses"][s] for s in (3, 4)}


def test_resuming_a_finished_job_says_so_and_changes_nothing(tmp_path: Path) -> None:
    kwargs = _kwargs(tmp_path)
    full = run_on_ranks(2, train_body, "gpt", kwargs)[0]
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    again = run_on_ranks(2, life.resume_body, kwargs)
    assert [(r["resumed_step"], r["final_step"], r["losses"]) for r in again] == [(4, 4, {}), (4, 4, {})]
    assert again[0]["warnings"] == [
        "nothing to train: the run is already at step 4 of 4, the job is finished "
        "(raise training.max_steps to train longer)"
    ]
    assert again[1]["warnings"] == []
    state = again[0]["state"]
    assert state.keys() == full["final_state"].keys()
    assert all(torch.equal(state[k], full["final_state"][k]) for k in state)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before
