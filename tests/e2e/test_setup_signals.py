"""Stop signals before training starts (see [Note: signals during set-up] in ``merak_core.run.signals``).

A rank that is still setting up (importing, building the model, creating process groups, loading a
checkpoint) has nothing to save: SIGTERM or SIGINT ends it at once with ``exitcodes.PREEMPTED`` and
one line, even while it waits inside a C++ call that runs no Python handler (a store wait). A signal
that arrives after set-up but before the training loop is kept and stops the job after its first
step like any other. The subprocess cases are marked ``slow``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from merak_core.run.exitcodes import PREEMPTED
from merak_core.run.signals import SetupSignals, StopRequest, restart_command
from tests.e2e import _fault_support as faults

BLOCKED = textwrap.dedent("""
    import sys
    from datetime import timedelta
    import torch.distributed as dist
    from merak_core.run.signals import SetupSignals

    with SetupSignals(lambda name: f"[rank 0] stopped by {name} during set-up"):
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        open(sys.argv[1], "w").write("ready")
        store.wait(["a key nobody sets"], timedelta(seconds=300))  # C++: no Python handler runs until it returns
    print("the wait returned", flush=True)
""")


def _wait_for(path: Path, proc: subprocess.Popen[str], timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"the child did not get ready (status {proc.returncode}):\n{out}\n{err[-3000:]}")
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.one_process
def test_sigterm_inside_a_blocking_store_wait_exits_at_once_with_one_line(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    proc = subprocess.Popen(
        [sys.executable, "-c", BLOCKED, str(ready)],
        env=faults.job_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for(ready, proc)
    proc.send_signal(signal.SIGTERM)
    try:  # far less than the wait's 300 s: the watcher thread acted, not a handler after the wait
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"still waiting 60 s after SIGTERM:\n{err[-3000:]}")
    assert proc.returncode == PREEMPTED, err[-3000:]
    assert out == ""
    assert err.splitlines()[-1] == "[rank 0] stopped by SIGTERM during set-up", err[-3000:]
    assert "Traceback" not in err


def _job(tmp: Path) -> Path:
    training = {
        "output_dir": str(tmp / "out"),
        "dp": 1,
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


@pytest.mark.slow
@pytest.mark.one_process  # one rank, started without torchrun
def test_a_rank_interrupted_while_building_the_model_exits_preempted_with_the_restart_line(
    tmp_path: Path,
) -> None:
    # A rank of a job that has a checkpoint already (a resumed or restarted job): the line says --resume latest.
    job = _job(tmp_path)
    checkpoints = tmp_path / "out" / "checkpoints"
    (checkpoints / "step_3").mkdir(parents=True)
    (checkpoints / "latest").write_text("step_3\n")
    env = faults.job_env(RANK="0", MERAK_TEST_SETUP_SIGNAL="SIGINT")
    proc = subprocess.run(
        [sys.executable, "-m", "merak_core.launch", str(job), "training.seed=3"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == PREEMPTED, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1] == (
        "[rank 0] merak: stopped by SIGINT during set-up, before the first step (nothing new to save); "
        f"start again with: merak train {job} training.seed=3 --resume latest"
    )


def test_restart_command_offers_resume_only_when_a_checkpoint_exists(tmp_path: Path) -> None:
    assert (
        restart_command("job.yaml", ["training.lr=1"], tmp_path / "none")
        == "merak train job.yaml training.lr=1"
    )
    assert restart_command("job.yaml", [], None) == "merak train job.yaml"
    (tmp_path / "step_2").mkdir()
    assert restart_command("my job.yaml", [], tmp_path) == "merak train 'my job.yaml' --resume latest"


def test_a_signal_after_set_up_is_kept_for_the_stop_request(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    lines: list[str] = []
    with SetupSignals(lambda name: lines.append(name) or None) as setup:
        pass
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # set-up is over: recorded, this process goes on
        assert setup.late == signal.SIGTERM and lines == []
        with StopRequest(announce=False) as outer:
            assert outer.signal_name == "SIGTERM", "inherited from set-up"
            with StopRequest(announce=False) as inner:  # the Trainer's own, inside the entry point's
                assert inner.requested and inner.signal_name == "SIGTERM"
    finally:
        setup.restore()
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_stop_request_without_an_earlier_signal_starts_clear() -> None:
    with StopRequest(announce=False) as outer:
        with StopRequest(announce=False) as inner:
            assert not inner.requested
        os.kill(os.getpid(), signal.SIGINT)
        assert outer.signal_name == "SIGINT"
