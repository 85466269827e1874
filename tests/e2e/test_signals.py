"""SIGTERM / SIGINT on one rank: every rank stops after the same step with a preemption checkpoint and one
resume line, and resuming gives the uninterrupted run bit for bit; SIGSTOP on one rank: the others name it
(global rank and coordinates) within the communication timeout.

The same through real ``merak train`` jobs (``slow``), one chain: SIGTERM to one rank while the job
trains, then, in the job resumed from that checkpoint (``--resume latest``), SIGTERM to torchrun.
Each time the ranks finish the step they are in together, write a preemption checkpoint at that step,
print one line on rank 0 that says how to resume and exit with ``exitcodes.PREEMPTED``; the steps of
both jobs have the uninterrupted run's losses (the single-process reference). The last leg resumes
from the second checkpoint on the worker pool's ranks, set up as ``merak train``'s ranks are
(``_fault_support.job_ranks_body``), and ends with the reference's losses; metrics.jsonl covers the
whole run. (A third ``merak train`` only launched again; a resumed job's summary.json is checked by
``test_faults.py``'s restart chain.)
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.e2e import _fault_support as faults
from tests.e2e._checkpoint_support import layout_kwargs
from tests.e2e._trainer_support import make_args, reference_training
from tests.support.dist import WorkerError, run_on_ranks

LAYOUT = (2, 1, 2)  # 4 ranks: stage 0 = ranks 0, 1; stage 1 = ranks 2, 3
STEPS = 5


def _sections(text: str) -> dict[int, str]:
    parts = re.split(r"\n--- rank (\d+) ---\n", text)
    return {int(parts[i]): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


@pytest.mark.parametrize(
    "victim,signum", [(3, signal.SIGTERM), (0, signal.SIGINT)], ids=["sigterm_rank3", "sigint_rank0"]
)
def test_a_signal_on_one_rank_stops_every_rank_after_the_same_step(
    tmp_path: Path, victim: int, signum: int
) -> None:
    out = str(tmp_path / "out")
    stopped = run_on_ranks(4, faults.preempt_body, LAYOUT, victim, signum, 3, out, STEPS)
    name = signal.Signals(signum).name
    assert [r["step"] for r in stopped] == [
        3
    ] * 4  # the signal came during step 3: step 3 completes everywhere
    assert stopped[victim]["signal"] == name
    assert all(r["signal"] == "a stop signal to another rank" for i, r in enumerate(stopped) if i != victim)
    checkpoint = str(Path(out) / "checkpoints" / "step_3")
    assert all(r["checkpoint"] == checkpoint for r in stopped), [r["checkpoint"] for r in stopped]
    assert stopped[victim]["line"] == (
        f"merak: stopped by {name} after step 3, checkpoint {checkpoint}; resume "
        "with: merak train job.yaml --resume latest"
    )
    assert all(r["handler_restored"] for r in stopped), "train() left its signal handlers installed"
    # Resuming from the preemption checkpoint gives the uninterrupted run bit for bit.
    resumed = run_on_ranks(4, faults.resume_body, LAYOUT, out, STEPS, "latest")[0]
    whole = run_on_ranks(4, faults.resume_body, LAYOUT, str(tmp_path / "whole"), STEPS, None)[0]
    assert stopped[0]["losses"] == [whole["losses"][s] for s in (1, 2, 3)]
    assert resumed["losses"] == {s: whole["losses"][s] for s in (4, 5)}
    for key, value in whole["state"].items():
        assert torch.equal(resumed["state"][key], value), key


def test_a_stalled_rank_is_named_by_the_others_within_the_timeout() -> None:
    timeout_s = 2.0
    with pytest.raises(WorkerError) as info:
        run_on_ranks(4, faults.stall_body, LAYOUT, 3, 2, timeout_s)
    text = str(info.value)
    assert "ranks [3] of 4 did not answer" in text, text[-3000:]
    sections = _sections(text)
    for rank in (0, 1, 2):
        section = sections.get(rank, "")
        assert f"SURVIVOR rank {rank} failed after" in section, text[-3000:]
        assert (
            "no heartbeat from rank 3 (pp_rank 1, dp_rank 1, tp_rank 0): stalled (stopped, hung) or dead"
            in section
        ), section
        elapsed = float(re.search(r"failed after ([0-9.]+) s", section).group(1))  # type: ignore[union-attr]
        assert elapsed < timeout_s + 5, section


JOB_STEPS = 16
DATA_SIZE = 128  # one epoch: 16 global batches of 8
TIMEOUT_S = 240


def _launch(job: Path, cwd: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "merak_core.cli", "train", str(job), *extra],
        cwd=cwd,
        env=faults.job_env(MERAK_TEST_STEP_SLEEP="0.15"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _signal_mid_run(proc: subprocess.Popen[str], out: str, target: str, at_step: int) -> None:
    """Wait for ``at_step`` in metrics.jsonl, then SIGTERM torchrun (``target='torchrun'``) or rank 1."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        if len(faults.logged_steps(out)) >= at_step:
            torchrun, ranks = faults.job_processes(proc.pid)
            pid = torchrun if target == "torchrun" else ranks.get(1)
            assert pid is not None, (torchrun, ranks)
            os.kill(pid, signal.SIGTERM)
            return
        time.sleep(0.05)
    raise AssertionError(f"the job never reached step {at_step}: {proc.communicate()[0][-3000:]}")


def _stopped_step(proc: subprocess.Popen[str], job: Path, out: str, target: str, at_step: int) -> int:
    """The step a signalled job stopped after, once its exit, line, checkpoint and records are checked."""
    from merak_core.run.exitcodes import PREEMPTED

    log, _ = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == PREEMPTED, log[-4000:]
    lines = re.findall(
        r"^merak: stopped by (\S+(?: [^,]+)?) after step (\d+), checkpoint (\S+); resume with: "
        r"(.*)$",
        log,
        flags=re.M,
    )
    assert len(lines) == 1, log[-4000:]  # one line, from rank 0
    _, step, checkpoint, command = lines[0]
    step = int(step)
    assert at_step <= step < JOB_STEPS, (target, lines)
    assert checkpoint == os.path.join(out, "checkpoints", f"step_{step}"), lines
    assert command == f"merak train {job} --resume latest"
    assert os.path.isdir(checkpoint) and faults.logged_steps(out) == list(range(1, step + 1))
    if target == "torchrun":  # merak train hides the shutdown tracebacks of a job stopped by a signal
        assert "Traceback" not in log, log[-4000:]
    return step


@pytest.mark.slow
def test_sigterm_to_a_rank_then_to_torchrun_stops_each_job_and_the_resume_gives_the_uninterrupted_run(
    tmp_path: Path,
) -> None:
    out = str(tmp_path / "out")
    kwargs = layout_kwargs(2, 1, 1, output_dir=out, max_steps=JOB_STEPS, logging_steps=1)
    job = Path(
        faults.write_job(str(tmp_path / "job.yaml"), make_args(**kwargs).to_dict(), data_size=DATA_SIZE)
    )
    stopped = 0
    for target in ("rank1", "torchrun"):  # the second job resumes from the first one's checkpoint
        proc = _launch(job, tmp_path, *(("--resume", "latest") if stopped else ()))
        _signal_mid_run(proc, out, target, at_step=stopped + 3)
        stopped = _stopped_step(proc, job, out, target, at_step=stopped + 3)

    reference, _ = reference_training("gpt", kwargs, dp=2, dataset_size=DATA_SIZE)
    # Both jobs' steps: the second one resumed from the first one's preemption checkpoint (--resume latest).
    records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in records if "loss" in r] == pytest.approx(reference[:stopped], rel=1e-10)
    # The last leg, from the checkpoint of the job stopped through torchrun, on the pool's 2 ranks set up
    # as merak train's ranks are (a third job would only launch again; the summary.json of a resumed
    # job is test_faults' restart chain's): the uninterrupted run, with metrics.jsonl over all of it.
    resumed = run_on_ranks(2, faults.job_ranks_body, str(job), [], "latest")[0]
    assert sorted(resumed) == list(range(stopped + 1, JOB_STEPS + 1))
    records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, JOB_STEPS + 1))
    assert [r["loss"] for r in records if "loss" in r] == pytest.approx(reference, rel=1e-10)
