"""Faults: a rank that dies mid-step makes every other rank fail fast with a naming error; a ``merak
train`` job restarts by itself after a rank's death, from scratch or from its last complete checkpoint.

The job (one chain, ``merak train --max-restarts 2``, dp=2, ``comm_timeout_s=5``): rank 1's data
factory takes 12 s in every attempt, more than twice the timeout. Rank 1 kills itself in step 1 of
the first attempt, before the first checkpoint (step 2), and in step 3 of the second, after it. The
ranks meet before creating their process groups (see [Note: arrival] in ``merak_core.launch``), so no
attempt fails at the rendezvous (before, the first one ended with ``DistStoreError: wait timeout after
...ms``); the second attempt finds no checkpoint and starts from scratch, the third resumes from step 2,
and the job ends with the uninterrupted run's losses.
"""

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
def test_merak_train_restarts_from_scratch_then_resumes_after_a_late_rank_kills_itself(
    tmp_path: Path,
) -> None:
    # dp=2 (no pipeline: no tracing, the cheapest torchrun job); both ranks compute the loss.
    kwargs = layout_kwargs(
        2,
        1,
        1,
        output_dir=str(tmp_path / "out"),
        max_steps=4,
        save_steps=2,
        logging_steps=1,
        comm_timeout_s=5.0,  # not less: at a load average of 100, a step's all-reduce waited more than 2 s
    )
    job = {
        "model": {"factory": "tests.e2e._fault_support:job_model"},
        "data": {"factory": "tests.e2e._fault_support:job_data_late"},
        "loss": "tests.e2e._fault_support:job_loss",
        "training": make_args(**kwargs).to_dict(),
    }
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job))
    marker = tmp_path / "killed"
    env = faults.job_env(
        MERAK_TEST_LATE_RANK="1",
        MERAK_TEST_LATE_S="12",
        MERAK_TEST_KILL_MARKER=str(marker),
        MERAK_TEST_KILL_RANK="1",
        MERAK_TEST_KILL_AT_CALL="2,5",  # 2 microbatches per step: in step 1, then the first one of step 3
    )
    proc = subprocess.run(
        [sys.executable, "-m", "merak_core.cli", "train", str(job_file), "--max-restarts", "2"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.returncode == 0, log
    assert "DistStoreError" not in proc.stderr, log
    assert marker.read_text().splitlines() == [
        "rank 1 killed itself at loss call 2 of attempt 0",
        "rank 1 killed itself at loss call 5 of attempt 1",
    ], log
    assert "resume=auto: no checkpoint under" in proc.stderr and "starting from scratch" in proc.stderr, log
    step_2 = tmp_path / "out" / "checkpoints" / "step_2"
    assert f"loaded checkpoint {step_2} (step 2," in proc.stderr, log
    assert sorted(os.listdir(tmp_path / "out" / "checkpoints")) == ["latest", "step_2", "step_4"]
    # The uninterrupted run, in one process (the same global batch; equal to rounding, see
    # tests/e2e/test_trainer_layouts.py). Bit-identity of a resume is test_checkpoint's business.
    reference, _ = reference_training("gpt", kwargs, dp=2)
    # metrics.jsonl and the summary cover the whole run: the third attempt kept steps 1-2 of the second one.
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4], records
    assert [r["loss"] for r in records if "loss" in r] == pytest.approx(reference, rel=1e-10)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"] == 4
    assert summary["first_loss"] == pytest.approx(reference[0], rel=1e-10), summary
    assert summary["final_loss"] == pytest.approx(reference[-1], rel=1e-10), (summary, reference)
