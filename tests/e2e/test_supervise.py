"""``merak_core.cli.supervise.run_torchrun`` with a stand-in for torchrun (a small Python child, no torch).

The child plays torchrun's part: it runs in its own session, gets the forwarded signal, prints
what a stopping job prints (a rank's log line, tracebacks, torchrun's failure report) and exits.
The real job is in ``test_cli_signals.py``; these cases are cheap and check the exit status, the
forwarding and what is shown.
"""

from __future__ import annotations

import io
import os
import signal
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from merak_core.cli.supervise import run_torchrun
from merak_core.run.exitcodes import PREEMPTED

CHILD = textwrap.dedent("""
    import os, signal, sys, time
    ready = sys.argv[1]

    def stop(signum, frame):
        sys.stderr.write("[rank 0] 12:00:00 merak_core.run.signals WARNING received %s: saving\\n"
                         % signal.Signals(signum).name)
        sys.stderr.write("Traceback (most recent call last):\\n  File \\"x.py\\", line 1, in <module>\\n"
                         "    step()\\nKeyboardInterrupt\\n")
        sys.stderr.write("torch.distributed.elastic.multiprocessing.api: Sending process 1 closing signal\\n")
        sys.stderr.write("  exitcode  : %d (pid: 1)\\n" % int(sys.argv[2]))
        sys.stderr.flush()
        sys.exit(1)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    sys.stderr.write("[rank 0] step 1 loss 2.0\\n")
    sys.stderr.write("a line before the signal\\n")
    sys.stderr.flush()
    open(ready, "w").write(str(os.getpgid(0)))
    time.sleep(60)
    sys.exit(3)
""")


def _run_and_signal(
    tmp: Path, signum: int | None, exitcode: int = PREEMPTED, to_child: bool = False
) -> tuple[object, str, int]:
    ready = tmp / "ready"
    err = io.StringIO()

    def fire() -> None:
        deadline = time.monotonic() + 30
        while not ready.exists() or not ready.read_text() or "a line before" not in err.getvalue():
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
        if to_child:
            os.killpg(int(ready.read_text()), signal.SIGTERM)  # someone signals torchrun directly
        elif signum is not None:
            os.kill(os.getpid(), signum)  # the user signals merak train (this process)

    thread = threading.Thread(target=fire, daemon=True)
    thread.start()
    outcome = run_torchrun([sys.executable, "-c", CHILD, str(ready), str(exitcode)], err=err)
    thread.join()
    return outcome, err.getvalue(), int(ready.read_text())


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_signal_is_forwarded_to_the_child_session_and_its_noise_hidden(tmp_path: Path, signum: int) -> None:
    before = signal.getsignal(signum)
    outcome, err, child_pgid = _run_and_signal(tmp_path, signum)
    assert child_pgid != os.getpgid(0), "torchrun runs in a session of its own"
    assert outcome.signal == signum and outcome.returncode == 1  # type: ignore[attr-defined]
    assert outcome.exit_status == PREEMPTED  # type: ignore[attr-defined]
    name = signal.Signals(signum).name
    assert err.splitlines() == [
        "[rank 0] step 1 loss 2.0",
        "a line before the signal",  # before the signal everything is shown
        f"merak train: {name} received, stopping the job",
        f"[rank 0] 12:00:00 merak_core.run.signals WARNING received {name}: saving",
    ]
    assert outcome.hidden_lines == 6  # type: ignore[attr-defined]
    assert signal.getsignal(signum) is before, "the handlers are restored"


def test_a_signal_sent_to_torchrun_directly_is_a_preemption_too(tmp_path: Path) -> None:
    outcome, err, _ = _run_and_signal(tmp_path, None, to_child=True)
    assert outcome.signal is None and outcome.worker_exitcodes == [PREEMPTED]  # type: ignore[attr-defined]
    assert outcome.exit_status == PREEMPTED  # type: ignore[attr-defined]
    assert "Traceback" in err, "without a signal to merak train nothing is hidden"


def test_a_crash_keeps_its_status_and_output(tmp_path: Path) -> None:
    outcome, err, _ = _run_and_signal(tmp_path, None, exitcode=1, to_child=True)
    assert outcome.worker_exitcodes == [1] and not outcome.preempted  # type: ignore[attr-defined]
    assert outcome.exit_status == 1 and "KeyboardInterrupt" in err  # type: ignore[attr-defined]


STUBBORN = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    signal.signal(signal.SIGTERM, lambda *a: None)  # a slow shutdown: the save takes long
    open(sys.argv[1], "w").write(str(rank.pid))
    time.sleep(120)
""")


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_the_third_signal_kills_torchrun_and_its_ranks(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    err = io.StringIO()

    def fire() -> None:
        deadline = time.monotonic() + 30
        while (not ready.exists() or not ready.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        for _ in range(3):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.3)

    thread = threading.Thread(target=fire, daemon=True)
    thread.start()
    outcome = run_torchrun([sys.executable, "-c", STUBBORN, str(ready)], err=err)
    thread.join()
    rank = int(ready.read_text())
    assert outcome.returncode == -signal.SIGKILL and outcome.exit_status == PREEMPTED, err.getvalue()
    assert err.getvalue().splitlines() == [
        "merak train: SIGTERM received, stopping the job",
        "merak train: still stopping (the ranks finish their step and save); signal once more to kill them now",
        "merak train: killing torchrun and its ranks",
    ]
    deadline = time.monotonic() + 10
    while _alive(rank) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(rank), "the rank in its own session was killed too"


REPORT = textwrap.dedent("""
    import sys
    sys.stderr.write('''[rank1]: RuntimeError: the same fault in every attempt
    torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
    ============================================================
    merak_core.launch FAILED
    ------------------------------------------------------------
    Failures:
    [1]:
      time      : 2026-12-01_12:45:16
      host      : localhost
      rank      : 1 (local_rank: 1)
      exitcode  : %s (pid: 2285)
      error_file: <N/A>
      traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
    ------------------------------------------------------------
    Root Cause (first observed failure):
    [0]:
      time      : 2026-12-01_12:45:16
      host      : localhost
      rank      : 3 (local_rank: 3)
      exitcode  : %s (pid: 2284)
      error_file: <N/A>
      traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
    ============================================================
    ''' % (sys.argv[1], sys.argv[2]))
    sys.exit(1)
""")


@pytest.mark.parametrize(
    ("root_code", "max_restarts", "expected"),
    [
        (
            "1",
            3,
            "merak train: the job failed: rank 3 failed first (exit code 1); its error is above; torchrun "
            "restarted the job 3 times (--max-restarts 3) and every attempt failed, so it gave up",
        ),
        ("-9", 0, "merak train: the job failed: rank 3 failed first (killed by SIGKILL); its error is above"),
    ],
    ids=["repeated-fault", "killed-no-restarts"],
)
def test_a_failed_job_is_summed_up_in_one_line_naming_the_root_cause(
    root_code: str, max_restarts: int, expected: str
) -> None:
    from merak_core.cli.supervise import failure_line

    err = io.StringIO()
    outcome = run_torchrun([sys.executable, "-c", REPORT, "75", root_code], err=err)
    assert outcome.returncode == 1 and outcome.root_cause == (3, int(root_code))  # type: ignore[attr-defined]
    assert "the same fault in every attempt" in err.getvalue(), "torchrun's output is shown unchanged"
    assert failure_line(outcome, max_restarts) == expected  # type: ignore[arg-type]


def test_no_failure_line_for_a_finished_or_preempted_job() -> None:
    from merak_core.cli.supervise import JobOutcome, failure_line

    done, stopped = JobOutcome(), JobOutcome()
    done.returncode, stopped.returncode, stopped.worker_exitcodes = 0, 1, [PREEMPTED, PREEMPTED]
    assert failure_line(done, 3) is None and failure_line(stopped, 3) is None
