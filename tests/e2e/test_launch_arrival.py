"""A rank that reaches process-group creation late, and a rank killed before the first checkpoint.

The job (``merak train --max-restarts 1``, dp=2, ``comm_timeout_s=5``): rank 1's data factory takes
12 s in every attempt, more than twice the timeout, and rank 1 kills itself in step 1 of the first attempt,
before the first checkpoint (step 2). The ranks meet before creating their process groups (see
[Note: arrival] in ``merak_core.launch``), so neither attempt fails at the rendezvous (before, the
first one ended with ``DistStoreError: wait timeout after ...ms``); the restarted attempt finds no
checkpoint, starts from scratch and ends with the uninterrupted run's losses.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e import _fault_support as faults
from tests.e2e._checkpoint_support import layout_kwargs
from tests.e2e._trainer_support import make_args, reference_training


@pytest.mark.slow
def test_a_late_rank_and_a_kill_before_the_first_checkpoint_restart_from_scratch(tmp_path: Path) -> None:
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
    job = Path(faults.write_job(str(tmp_path / "job.yaml"), make_args(**kwargs).to_dict()))
    text = job.read_text().replace(
        "tests.e2e._fault_support:job_data", "tests.e2e._fault_support:job_data_late"
    )
    job.write_text(text)
    marker = tmp_path / "killed"
    env = faults.job_env(
        MERAK_TEST_LATE_RANK="1",
        MERAK_TEST_LATE_S="12",
        MERAK_TEST_KILL_MARKER=str(marker),
        MERAK_TEST_KILL_RANK="1",
        MERAK_TEST_KILL_AT_CALL="2",
    )
    proc = subprocess.run(
        [sys.executable, "-m", "merak_core.cli", "train", str(job), "--max-restarts", "1"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.returncode == 0, log
    assert "DistStoreError" not in proc.stderr, log
    assert marker.read_text().startswith("rank 1 killed itself at loss call 2"), log
    assert "resume=auto: no checkpoint under" in proc.stderr and "starting from scratch" in proc.stderr, log
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4], records
    reference, _ = reference_training("gpt", kwargs, dp=2)
    assert losses == pytest.approx(reference, rel=1e-10), (losses, reference)
