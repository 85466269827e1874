"""Fault trials of real ``merak train --max-restarts`` jobs: does every job finish, exactly?

Each trial launches a short training job (the tests' reference GPT, float64, on the
layout of ``--ranks``: 4 -> dp2 x pp2, 8 -> dp2 x tp2 x pp2; a checkpoint every
``--save-steps``) and hits it at a random step with one random fault:

- ``sigkill_rank``: SIGKILL to one rank (torchrun restarts the job, which resumes from
  its last committed checkpoint);
- ``sigstop_rank``: SIGSTOP to one rank (the others time out after ``--timeout`` seconds,
  name it, and torchrun restarts the job);
- ``sigterm_rank``: SIGTERM to one rank (every rank stops after the same step with a
  preemption checkpoint; torchrun restarts the job from it);
- ``sigterm_torchrun``: SIGTERM to torchrun (the same preemption; torchrun itself exits,
  so the benchmark resumes the job with ``merak train --resume latest``, as a scheduler would).

Reported per trial and in a summary table: whether the job finished, committed steps lost
(the newest committed checkpoint at the fault minus the step the job resumed from; a
preemption checkpoint taken after the fault does not count as committed before it),
seconds from the fault to its detection (the first line of the job that reacts to it:
a rank's signal notice, a timeout naming the stalled rank, torchrun's report of a dead
worker), and whether the final parameters equal those of an uninterrupted run bit for bit
(read from the final checkpoints). Targets: every trial finishes, no committed step lost,
detection within ``--timeout`` + 5 s, final parameters identical.

Usage::

    python benchmarks/bench_faults.py                 # 20 trials at 4 ranks, 10 at 8
    python benchmarks/bench_faults.py --ranks 4 --trials 3 --seed 1
    python benchmarks/bench_faults.py --quick         # 2 trials of 6 steps at 4 ranks

Not done here: multi-node faults and faults inside checkpoint writes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)] + [
    str(REPO / "packages" / p / "src") for p in ("merak-pipe", "merak-graph", "merak-tp", "merak-core")
]

from tests.e2e import _fault_support as faults  # noqa: E402
from tests.e2e._trainer_support import make_args  # noqa: E402

FAULTS = ("sigkill_rank", "sigstop_rank", "sigterm_rank", "sigterm_torchrun")
LAYOUTS = {4: (2, 1, 2), 8: (2, 2, 2)}
DETECTION = re.compile(
    r"received SIG|no heartbeat from|failed \(timeout|exitcode|stopped by|Closing process|"
    r"closing signal|SignalException|died|Timed out"
)
RESUMED = re.compile(r"loaded checkpoint \S*step_(\d+)")


@dataclass
class Trial:
    ranks: int
    fault: str
    victim: int
    at_step: int
    finished: bool = False
    exit_codes: str = ""
    committed_at_fault: int = 0
    resumed_from: int | None = None
    steps_lost: int | None = None
    detection_s: float | None = None
    identical: bool | None = None
    wall_s: float = 0.0
    restarts: int = 0
    """Restarts of the worker group by torchrun (attempts that rank 0 began, less one per ``merak train``)."""
    last_output_s: float | None = None
    """Seconds between the job's last output line and its end (a large value on an unfinished trial: stuck)."""
    load: str = ""
    """The machine's 1-minute load average at the trial's start and end."""
    note: str = ""


class _Job:
    """One ``merak train`` process; its output lines with arrival times."""

    def __init__(self, job: Path, cwd: Path, env: dict[str, str], *extra: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "merak_core.cli", "train", str(job), *extra],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line))

    def wait(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(self.proc.pid)
            code = self.proc.wait()
        self._reader.join(timeout=5)
        return code

    def text(self) -> str:
        return "".join(line for _, line in self.lines)


def _kill_tree(pid: int) -> None:
    for child in faults.children(pid):
        _kill_tree(child)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _committed(out: Path) -> int:
    """The newest committed checkpoint step (``latest`` pointer), 0 when none."""
    latest = out / "checkpoints" / "latest"
    try:
        text = latest.read_text().strip() if latest.is_file() else os.readlink(latest)
    except OSError:
        return 0
    found = re.search(r"step_(\d+)", text)
    return int(found.group(1)) if found else 0


def _final_model(out: Path, steps: int) -> dict[str, Any]:
    from merak_core.checkpoint.weights import read_checkpoint_model

    return read_checkpoint_model(out / "checkpoints" / f"step_{steps}")


def _job_file(root: Path, ranks: int, steps: int, save_steps: int, timeout: float) -> tuple[Path, Path]:
    from tests.e2e._checkpoint_support import layout_kwargs

    dp, tp, pp = LAYOUTS[ranks]
    root.mkdir(parents=True, exist_ok=True)
    out = root / "out"
    kwargs = layout_kwargs(
        dp,
        tp,
        pp,
        output_dir=str(out),
        max_steps=steps,
        save_steps=save_steps,
        logging_steps=1,
        comm_timeout_s=timeout,
        lr_scheduler_type="constant",
        warmup_steps=0,
    )
    job = Path(faults.write_job(str(root / "job.yaml"), make_args(**kwargs).to_dict(), data_size=8 * steps))
    return job, out


def _inject(job: _Job, out: Path, trial: Trial, deadline: float) -> float | None:
    """Wait until ``trial.at_step`` is logged, then deliver the fault; its time (None: the job ended first)."""
    while time.monotonic() < deadline and job.proc.poll() is None:
        if faults.logged_steps(str(out))[-1:] and faults.logged_steps(str(out))[-1] >= trial.at_step:
            torchrun, ranks = faults.job_processes(job.proc.pid)
            trial.committed_at_fault = _committed(out)
            if trial.fault == "sigterm_torchrun":
                pid, sig = torchrun, signal.SIGTERM
            else:
                pid = ranks.get(trial.victim)
                sig = {
                    "sigkill_rank": signal.SIGKILL,
                    "sigstop_rank": signal.SIGSTOP,
                    "sigterm_rank": signal.SIGTERM,
                }[trial.fault]
            if pid is None:
                time.sleep(0.05)
                continue
            at = time.monotonic()
            os.kill(pid, sig)
            return at
        time.sleep(0.02)
    return None


def _load() -> str:
    try:
        return f"{os.getloadavg()[0]:.0f}"
    except OSError:
        return "?"


def run_trial(trial: Trial, root: Path, args: argparse.Namespace, reference: dict[str, Any]) -> Trial:
    start = time.monotonic()
    load_at_start = _load()
    job_path, out = _job_file(root, trial.ranks, args.steps, args.save_steps, args.timeout)
    env = faults.job_env(MERAK_TEST_STEP_SLEEP=str(args.step_sleep))
    job = _Job(job_path, root, env, "--max-restarts", str(args.max_restarts))
    fault_at = _inject(job, out, trial, start + args.trial_timeout)
    codes = [job.wait(max(1.0, start + args.trial_timeout - time.monotonic()))]
    ended = time.monotonic()
    if job.lines:
        trial.last_output_s = ended - job.lines[-1][0]
    text = job.text()
    if fault_at is None:
        trial.note = "the job ended before the fault"
    else:
        trial.detection_s = next(
            (t - fault_at for t, line in job.lines if t >= fault_at and DETECTION.search(line)), None
        )
    if trial.fault == "sigterm_torchrun" and codes[0] != 0:  # preempted: resume as a scheduler would
        again = _Job(
            job_path, root, faults.job_env(), "--resume", "latest", "--max-restarts", str(args.max_restarts)
        )
        codes.append(again.wait(max(1.0, start + args.trial_timeout - time.monotonic())))
        text += again.text()
    trial.exit_codes = "/".join(str(c) for c in codes)
    resumed = [int(m.group(1)) for m in RESUMED.finditer(text)]
    if resumed:
        trial.resumed_from = resumed[0]
    steps = faults.logged_steps(str(out))
    trial.finished = codes[-1] == 0 and steps[-1:] == [args.steps]
    if trial.resumed_from is not None:
        trial.steps_lost = max(0, trial.committed_at_fault - trial.resumed_from)
    elif trial.finished and fault_at is not None:
        trial.steps_lost = 0 if trial.committed_at_fault == 0 else None
    if trial.finished:
        final = _final_model(out, args.steps)
        trial.identical = final.keys() == reference.keys() and all(
            bool((final[k] == reference[k]).all()) and final[k].dtype == reference[k].dtype for k in reference
        )
    else:
        trial.note = (trial.note + " " + text[-600:].replace("\n", " | ")).strip()
    trial.restarts = max(0, text.count("parallel layout: rank 0/") - len(codes))
    trial.wall_s = time.monotonic() - start
    trial.load = f"{load_at_start}-{_load()}"
    return trial


def _reference(root: Path, ranks: int, args: argparse.Namespace) -> dict[str, Any]:
    job_path, out = _job_file(root, ranks, args.steps, args.save_steps, args.timeout)
    job = _Job(job_path, root, faults.job_env())
    code = job.wait(args.trial_timeout)
    if code != 0:
        raise SystemExit(f"the uninterrupted {ranks}-rank run failed (exit {code}):\n{job.text()[-3000:]}")
    return _final_model(out, args.steps)


def _table(trials: list[Trial], timeout: float) -> str:
    rows = [
        "| ranks | trials | finished | committed steps lost | detection s (median / max) | within timeout+5 s | "
        "final params identical |",
        "|---|---|---|---|---|---|---|",
    ]
    for ranks in sorted({t.ranks for t in trials}):
        mine = [t for t in trials if t.ranks == ranks]
        det = sorted(t.detection_s for t in mine if t.detection_s is not None)
        lost = sum(t.steps_lost or 0 for t in mine)
        unknown = sum(1 for t in mine if t.steps_lost is None)
        median = f"{det[len(det) // 2]:.1f} / {det[-1]:.1f}" if det else "n/a"
        within = sum(1 for d in det if d <= timeout + 5)
        rows.append(
            f"| {ranks} | {len(mine)} | {sum(t.finished for t in mine)} | {lost}"
            f"{f' ({unknown} unknown)' if unknown else ''} | {median} | {within}/{len(det)} | "
            f"{sum(bool(t.identical) for t in mine)}/{len(mine)} |"
        )
    rows += [
        "",
        "| ranks | fault | victim | at step | exit codes | committed at fault | resumed from | lost | "
        "detection s | identical | restarts | wall s | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t in trials:
        det = "n/a" if t.detection_s is None else f"{t.detection_s:.1f}"
        rows.append(
            f"| {t.ranks} | {t.fault} | {t.victim} | {t.at_step} | {t.exit_codes} | {t.committed_at_fault} | "
            f"{t.resumed_from} | {t.steps_lost} | {det} | {t.identical} | {t.restarts} | {t.wall_s:.0f} | "
            f"{t.load} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[4, 8], choices=sorted(LAYOUTS))
    p.add_argument(
        "--trials", type=int, default=None, help="trials per rank count (default: 20 at 4, 10 at 8)"
    )
    p.add_argument("--steps", type=int, default=12, help="steps of each job (default 12)")
    p.add_argument("--save-steps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=5.0, help="the job's comm_timeout_s (default 5)")
    p.add_argument("--max-restarts", type=int, default=3)
    p.add_argument(
        "--step-sleep", type=float, default=0.1, help="seconds added to every loss call (default 0.1)"
    )
    p.add_argument("--trial-timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write every trial as JSON here (rewritten after each trial)")
    p.add_argument("--quick", action="store_true", help="2 trials of 6 steps at 4 ranks")
    args = p.parse_args(argv)
    if args.quick:
        args.ranks, args.trials, args.steps = [4], 2 if args.trials is None else args.trials, 6
    rng = random.Random(args.seed)
    trials: list[Trial] = []
    for ranks in args.ranks:
        count = args.trials if args.trials is not None else (20 if ranks == 4 else 10)
        root = Path(tempfile.mkdtemp(prefix=f"merak-faults-{ranks}-"))
        try:
            reference = _reference(root / "reference", ranks, args)
            for i in range(count):
                trial = Trial(
                    ranks=ranks,
                    fault=rng.choice(FAULTS),
                    victim=rng.randrange(ranks),
                    at_step=rng.randint(2, args.steps - 1),
                )
                run_trial(trial, root / f"trial_{i}", args, reference)
                trials.append(trial)
                if args.json:
                    Path(args.json).write_text(json.dumps([asdict(t) for t in trials], indent=2))
                print(
                    f"[{ranks} ranks] trial {i + 1}/{count}: {trial.fault} of rank {trial.victim} at step "
                    f"{trial.at_step}: finished={trial.finished} lost={trial.steps_lost} "
                    f"detection={trial.detection_s} identical={trial.identical} restarts={trial.restarts} "
                    f"({trial.wall_s:.0f} s, load {trial.load}, last output {trial.last_output_s} s before the end)"
                    + (f" note: {trial.note[:300]}" if trial.note else ""),
                    flush=True,
                )
        finally:
            shutil.rmtree(root, ignore_errors=True)
    print(_table(trials, args.timeout))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(t) for t in trials], indent=2))
    return 0 if all(t.finished and t.identical and not t.steps_lost for t in trials) else 1


if __name__ == "__main__":
    sys.exit(main())
