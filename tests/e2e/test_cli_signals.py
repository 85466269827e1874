"""``merak train`` under signals, and its ``output_dir`` lock.

Two real jobs (2 ranks, a slow loss): SIGTERM to ``merak train`` while it trains, and SIGINT (a
Ctrl-C). Each time ``merak train`` forwards the signal to torchrun, waits, exits with
``exitcodes.PREEMPTED`` and prints the command to resume; afterwards no process of the job is
left (checked by the pids the ranks wrote and torchrun's pid from the lock file). A Ctrl-C
prints a few lines, no traceback. While the first job runs, a second ``merak train`` on the
same ``output_dir`` is refused with the first one's host and pid. A SIGKILL of ``merak train``
alone (nothing forwarded) stops torchrun and both ranks all the same, and frees the lock. The lock's other cases (a
stale lock of a dead job, a lock held in this process) need no job.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from merak_core.cli.outdir_lock import LOCK_NAME, OutputDirLock, OutputDirLocked
from merak_core.run.exitcodes import BAD_INPUT, PREEMPTED

REPO = Path(__file__).resolve().parents[2]
JOBS = "tests.e2e._bad_input_jobs"
START_TIMEOUT_S = 300.0  # torchrun and two ranks importing torch on a shared 2-core machine


def _job(tmp: Path) -> Path:
    job = {
        "model": {"factory": f"{JOBS}:slow_lm"},
        "data": {"factory": f"{JOBS}:data", "kwargs": {"size": 64}},
        "loss": f"{JOBS}:slow_loss",
        "training": {
            "output_dir": str(tmp / "out"),
            "dp": 2,
            "per_device_train_batch_size": 2,
            "max_steps": 10000,
            "logging_steps": 1,
            "save_steps": 10000,
        },
    }
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _start(tmp: Path) -> tuple[subprocess.Popen[str], Path]:
    pids = tmp / "pids"
    pids.mkdir()
    paths = [str(REPO)] + [
        str(REPO / "packages" / p / "src") for p in ("merak-pipe", "merak-graph", "merak-tp", "merak-core")
    ]
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(paths),
        OMP_NUM_THREADS="1",
        MERAK_TEST_PID_DIR=str(pids),
        MERAK_TEST_STEP_SLEEP="0.2",
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "merak_core.cli", "train", str(_job(tmp))],
        cwd=tmp,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + START_TIMEOUT_S
    while not all((pids / f"step.rank{r}").exists() for r in (0, 1)):  # both ranks are in a training step
        if proc.poll() is not None or time.monotonic() > deadline:
            out, err = _kill_job(proc, pids)
            pytest.fail(
                f"the job did not reach a training step (status {proc.returncode}):\n{out[-2000:]}\n"
                f"{err[-4000:]}"
            )
        time.sleep(0.5)
    return proc, pids


def _kill_job(proc: subprocess.Popen[str], pids: Path) -> tuple[str, str]:
    """Kill the CLI and what it started (torchrun's process group, the ranks), then read its output.

    ``communicate()`` alone would wait for ever: torchrun and the ranks hold the CLI's stdout and
    stderr pipes open after the CLI itself is gone.
    """
    proc.kill()
    for path in pids.glob("*.pid"):
        try:
            os.kill(int(path.read_text()), signal.SIGKILL)
        except (ValueError, OSError):
            pass
    try:
        holder = json.loads((pids.parent / "out" / LOCK_NAME).read_text())
        os.killpg(int(holder["torchrun_pid"]), signal.SIGKILL)
    except (OSError, ValueError, KeyError):
        pass
    try:
        return proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        return "", "(the job's output could not be read: a process still holds its pipes)"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def _job_pids(tmp: Path, pids: Path) -> list[int]:
    holder = json.loads((tmp / "out" / LOCK_NAME).read_text())
    assert holder["host"] == socket.gethostname()
    return [int((pids / f"rank{r}.pid").read_text()) for r in (0, 1)] + [int(holder["torchrun_pid"])]


def _stop(proc: subprocess.Popen[str], pids: Path, signum: int) -> tuple[str, str]:
    proc.send_signal(signum)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        out, err = _kill_job(proc, pids)
        pytest.fail(f"merak train did not stop within 120 s of the signal:\n{err[-4000:]}")
    return out, err


@pytest.mark.slow
def test_sigterm_to_merak_train_stops_every_rank_and_a_second_job_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    proc, pids = _start(tmp_path)
    job_pids = _job_pids(tmp_path, pids)
    assert all(_alive(p) for p in job_pids)

    # A second job on the same output_dir, while the first one trains: refused before anything starts.
    from merak_core.cli import main

    status = main(["--log-level", "WARNING", "train", str(tmp_path / "job.yaml"), "--no-check"])
    assert status == BAD_INPUT
    assert (
        f"is in use by another running job (host {socket.gethostname()}, pid {proc.pid} (torchrun pid "
        f"{job_pids[2]})" in capsys.readouterr().err
    )

    out, err = _stop(proc, pids, signal.SIGTERM)
    assert proc.returncode == PREEMPTED, err[-4000:]
    assert "merak train: SIGTERM received, stopping the job" in err
    assert f"merak train {tmp_path / 'job.yaml'} --resume latest" in err
    deadline = time.monotonic() + 10  # zombies of orphans are reaped by init a moment later
    while any(_alive(p) for p in job_pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [p for p in job_pids if _alive(p)] == [], "processes of the job outlived merak train"
    assert (tmp_path / "out" / LOCK_NAME).read_text() == "", "the lock is released (its description cleared)"


STOP_BOUND_S = 60.0  # torchrun's SIGTERM stops the ranks after their step (and save); loaded machine


@pytest.mark.slow
def test_sigkill_of_merak_train_stops_torchrun_and_every_rank_and_frees_the_lock(tmp_path: Path) -> None:
    """``merak train`` killed by SIGKILL (it can forward nothing): no process of its job trains on."""
    proc, pids = _start(tmp_path)
    try:
        job_pids = _job_pids(tmp_path, pids)
        proc.kill()  # the CLI's pid only, not its children
        proc.wait()
        deadline = time.monotonic() + STOP_BOUND_S
        while any(_alive(p) for p in job_pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [p for p in job_pids if _alive(p)] == [], (
            "torchrun or ranks outlived the SIGKILLed merak train"
        )
        lock = _acquire_within(tmp_path / "out", deadline)  # a new job may start
        with lock:
            assert lock.stale is not None and lock.stale["pid"] == proc.pid  # the dead job's description
    finally:
        _kill_job(proc, pids)


def _acquire_within(output_dir: Path, deadline: float) -> OutputDirLock:
    """The output_dir lock, taken once the dead job's last process lets it go (by ``deadline``).

    A failure names every process that still has the lock file open (read from /proc), so an orphan
    holding it says who it is.
    """
    while True:
        try:
            return OutputDirLock.acquire(output_dir, command="merak train again.yaml")
        except OutputDirLocked:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"the lock is still held; processes with it open: {_holders(output_dir / LOCK_NAME)}"
                ) from None
            time.sleep(0.2)


def _holders(path: Path) -> list[str]:
    found, target = [], os.path.realpath(path)
    for proc_dir in Path("/proc").glob("[0-9]*"):
        try:
            if any(os.path.realpath(fd) == target for fd in (proc_dir / "fd").iterdir()):
                found.append(f"{proc_dir.name}: {(proc_dir / 'cmdline').read_bytes()[:200]!r}")
        except OSError:
            continue
    return found


def test_second_job_error_names_the_holder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The refusal's text (the CLI in this process, the lock held by this test)."""
    from merak_core.cli import main

    job = _job(tmp_path)
    with OutputDirLock.acquire(tmp_path / "out", command="merak train other.yaml"):
        assert main(["--log-level", "WARNING", "train", str(job), "--no-check"]) == BAD_INPUT
    err = capsys.readouterr().err
    assert (
        f"output_dir '{tmp_path / 'out'}' is in use by another running job (host {socket.gethostname()}, "
        f"pid {os.getpid()}, started " in err
    )
    assert "command: merak train other.yaml" in err
    assert f"kill {os.getpid()} on {socket.gethostname()}" in err and "training.output_dir=..." in err


@pytest.mark.slow
def test_ctrl_c_prints_a_few_lines_and_how_to_resume(tmp_path: Path) -> None:
    proc, pids = _start(tmp_path)
    job_pids = _job_pids(tmp_path, pids)
    out, err = _stop(proc, pids, signal.SIGINT)
    assert proc.returncode == PREEMPTED, err[-4000:]
    after = err.split("merak train: SIGINT received, stopping the job", 1)[1].splitlines()[1:]
    assert len(after) <= 8, "\n".join(after)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-4000:]
    assert after[-1].strip() == f"merak train {tmp_path / 'job.yaml'} --resume latest"
    assert "lines of shutdown output hidden" in after[-2]
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in job_pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [p for p in job_pids if _alive(p)] == []


def test_stale_lock_of_a_dead_job_is_taken_over_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_NAME).write_text(
        json.dumps({"host": "node7", "pid": 4194303, "started": 0.0, "command": "merak train old.yaml"})
    )
    with caplog.at_level(logging.WARNING, logger="merak_core.cli.outdir_lock"):
        lock = OutputDirLock.acquire(out, command="merak train new.yaml")
    assert lock.stale is not None and lock.stale["pid"] == 4194303
    assert "taking over the lock of a job that is gone (host node7, pid 4194303, started " in caplog.text
    assert "command: merak train old.yaml" in caplog.text
    holder = json.loads((out / LOCK_NAME).read_text())
    assert (holder["host"], holder["pid"], holder["command"]) == (
        socket.gethostname(),
        os.getpid(),
        "merak train new.yaml",
    )
    lock.release()
    assert (out / LOCK_NAME).read_text() == ""
    with OutputDirLock.acquire(out) as again:  # a released lock is no stale lock
        assert again.stale is None


def test_lock_is_exclusive_until_released(tmp_path: Path) -> None:
    first = OutputDirLock.acquire(tmp_path / "new" / "dir")  # creates the directory
    with pytest.raises(OutputDirLocked, match=f"pid {os.getpid()}"):
        OutputDirLock.acquire(tmp_path / "new" / "dir")
    first.note(torchrun_pid=12345)
    with pytest.raises(OutputDirLocked, match=r"\(torchrun pid 12345\)"):
        OutputDirLock.acquire(tmp_path / "new" / "dir")
    first.release()
    OutputDirLock.acquire(tmp_path / "new" / "dir").release()
