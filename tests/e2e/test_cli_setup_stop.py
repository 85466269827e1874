"""``merak train`` stopped before training starts: while it checks the job, and while its ranks set up.

Either way: exit ``exitcodes.PREEMPTED``, a few lines and no traceback, the command to start again
(without ``--resume``: nothing was saved), and no process of the job left behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from merak_core.run.exitcodes import PREEMPTED
from tests.e2e import _fault_support as faults


def _job(tmp: Path, dp: int = 2) -> Path:
    training = {
        "output_dir": str(tmp / "out"),
        "dp": dp,
        "per_device_train_batch_size": 2,
        "max_steps": 2,
        "save_steps": 1,
    }
    job = {
        "model": {"factory": "tests.e2e._fault_support:job_model_signalling"},
        "data": {"factory": "tests.e2e._fault_support:job_data", "kwargs": {"size": 8}},
        "loss": "tests.e2e._fault_support:job_loss",
        "training": training,
    }
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def test_sigterm_while_merak_train_checks_the_job_launches_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from merak_core.cli import main

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setenv(
        "MERAK_TEST_CHECK_SIGNAL", "SIGTERM"
    )  # the model factory, built by the checks, signals
    assert main(["--log-level", "WARNING", "train", str(_job(tmp_path))]) == PREEMPTED
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "merak train: stopped by SIGTERM before the job started (nothing was launched)"
    ]
    assert signal.getsignal(signal.SIGTERM) is before
    assert (
        not (tmp_path / "out" / "merak.lock").exists() or (tmp_path / "out" / "merak.lock").read_text() == ""
    )


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.slow
def test_sigterm_while_the_ranks_set_up_stops_them_at_once_and_says_start_again(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    job = _job(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "merak_core.cli", "train", str(job)],
        cwd=tmp_path,
        env=faults.job_env(MERAK_TEST_PID_DIR=str(pids)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300
    while not all((pids / f"rank{r}.pid").exists() for r in (0, 1)):  # both ranks are building the model
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"the ranks did not reach set-up (status {proc.returncode}):\n{err[-4000:]}")
        time.sleep(0.2)
    ranks = [int((pids / f"rank{r}.pid").read_text()) for r in (0, 1)]
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == PREEMPTED, err[-4000:]
    assert "Traceback" not in err, err[-4000:]
    after = err.split("merak train: SIGTERM received, stopping the job\n", 1)[1].splitlines()
    assert (
        f"[rank 0] merak: stopped by SIGTERM during set-up, before the first step (nothing new to save); "
        f"start again with: merak train {job}" in after
    ), after
    assert "[rank 1] merak: stopped by SIGTERM during set-up, before the first step" in after, after
    assert after[-2:] == [after[-2], f"  merak train {job}"] and after[-2].endswith(
        "Nothing was saved (no checkpoint yet); start it again with:"
    ), after
    assert len(after) <= 5, after
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [p for p in ranks if _alive(p)] == [], "ranks outlived merak train"
    assert (
        not os.listdir(tmp_path / "out" / "checkpoints")
        if (tmp_path / "out" / "checkpoints").exists()
        else True
    )
