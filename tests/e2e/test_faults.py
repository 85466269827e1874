"""Faults: a rank that dies mid-step makes every other rank fail fast with a naming error, and a
``merak train --max-restarts 1`` job whose rank kills itself once restarts, resumes from its last
complete checkpoint and ends with the uninterrupted run's loss."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.e2e import _fault_support as faults
from tests.e2e._checkpoint_support import layout_kwargs
from tests.e2e._trainer_support import make_args, reference_training
from tests.support.dist import WorkerError, run_on_ranks

REPO = Path(__file__).resolve().parents[2]


def _sections(text: str) -> dict[int, str]:
    """The pool's error text split into each rank's traceback."""
    parts = re.split(r"\n--- rank (\d+) ---\n", text)
    return {int(parts[i]): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def test_rank_dying_mid_step_fails_the_others_with_naming_errors() -> None:
    # 2x1x2 on 4 ranks: stage 0 = ranks 0, 1; stage 1 = ranks 2, 3; pipelines (0, 2) and (1, 3).
    # Rank 3 dies in its first loss call of step 2 (2 microbatches per step).
    timeout_s = 1.5
    with pytest.raises(WorkerError) as info:
        run_on_ranks(4, faults.die_mid_step_body, (2, 1, 2), 3, 3, timeout_s)
    text = str(info.value)
    sections = _sections(text)
    assert "rank 3 died (exit code 19)" in sections[3]
    # Every survivor answered (the pool gives them 3 s after the death): nobody hung.
    for rank in (0, 1, 2):
        assert f"SURVIVOR rank {rank} failed" in sections[rank], sections.get(rank, text)
        assert f"rank {rank} (pp_rank" in sections[rank] and "step 2:" in sections[rank]
        # The heartbeat check names the dead rank, though its last beat was fresh when the peers failed.
        assert "rank 3 (pp_rank 1, dp_rank 1, tp_rank 0): dead (the process is gone)" in sections[rank]
        assert "every other rank still beats" not in sections[rank]
    # Rank 3's pipeline peer names the pipeline transfer it waited on and the pipeline's global ranks.
    assert re.search(r"PipelineCommError|PipelineTimeoutError", sections[1]), sections[1]
    assert "pipeline step over global ranks [1, 3]" in sections[1]
    assert re.search(r"stage 0, action 0\w+ \(microbatch \d\), peer pipeline rank 1", sections[1]), sections[
        1
    ]
    # Its DP peer names the DP all-reduce over the dead rank's group; rank 0 the one over its own DP group.
    assert "DP gradient all-reduce over global ranks [2, 3] failed" in sections[2], sections[2]
    assert "TrainingStepError" in sections[2]
    assert re.search(
        r"over global ranks \[0, 1\] failed|pipeline step over global ranks \[0, 2\]", sections[0]
    )


@pytest.mark.slow
def test_merak_train_restarts_and_resumes_after_a_rank_kills_itself(tmp_path: Path) -> None:
    # dp=2 (no pipeline: no tracing, the cheapest torchrun job); both ranks compute the loss.
    kwargs = layout_kwargs(2, 1, 1, output_dir=str(tmp_path / "out"), max_steps=4, save_steps=2)
    training = make_args(**kwargs).to_dict()
    job = {
        "model": {"factory": "tests.e2e._fault_support:job_model"},
        "data": {"factory": "tests.e2e._fault_support:job_data"},
        "loss": "tests.e2e._fault_support:job_loss",
        "training": training,
    }
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job))
    marker = tmp_path / "killed"
    paths = [str(REPO)] + [
        str(REPO / "packages" / p / "src") for p in ("merak-pipe", "merak-graph", "merak-tp", "merak-core")
    ]
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(paths),
        OMP_NUM_THREADS="1",
        MERAK_TEST_KILL_MARKER=str(marker),
        MERAK_TEST_KILL_RANK="1",
        MERAK_TEST_KILL_AT_CALL="5",
    )  # 2 microbatches per step: the first one of step 3
    proc = subprocess.run(
        [sys.executable, "-m", "merak_core.cli", "train", str(job_file), "--max-restarts", "1"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, log
    assert marker.read_text().startswith("rank 1 killed itself"), log
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"] == 4
    # The uninterrupted run, in one process (the same global batch; equal to rounding, see
    # tests/e2e/test_trainer_layouts.py). Bit-identity of a resume is test_checkpoint's business.
    reference, _ = reference_training("gpt", kwargs, dp=2)
    assert summary["final_loss"] == pytest.approx(reference[-1], rel=1e-10), (summary, reference)
    # The summary and metrics.jsonl cover the whole run: the restarted attempt kept steps 1-2 of the first one.
    assert summary["first_loss"] == pytest.approx(reference[0], rel=1e-10), summary
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4], records
    assert sorted(os.listdir(tmp_path / "out" / "checkpoints")) == ["latest", "step_2", "step_4"]
