"""Bodies and job files of the fault tests: a rank that dies mid-step, a torchrun job that restarts."""

from __future__ import annotations

import os
import signal
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tests.e2e._checkpoint_support import layout_kwargs
from tests.e2e._trainer_support import TokenDataset, build_model, make_args
from tests.support.models import lm_loss


def die_mid_step_body(layout: tuple[int, int, int], victim: int, die_at_call: int, timeout_s: float) -> None:
    """Train; rank ``victim`` exits inside its ``die_at_call``-th loss call. Survivors raise, naming the failure."""
    from merak_core import ParallelLayout, Trainer

    dp, tp, pp = layout
    group_layout = ParallelLayout.build(dp, tp, pp, timeout=timedelta(seconds=timeout_s))
    calls = [0]

    def loss_fn(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if output.is_meta:  # the Trainer's up-front check of the loss on meta tensors: not a step
            return lm_loss(output, labels)
        calls[0] += 1
        if dist.get_rank() == victim and calls[0] == die_at_call:
            os._exit(19)
        return lm_loss(output, labels)

    args = make_args(
        **layout_kwargs(
            dp,
            tp,
            pp,
            max_steps=3,
            output_dir=os.path.join(tempfile.gettempdir(), f"merak-fault-{os.getpid()}"),
        )
    )
    model = build_model("gpt")
    trainer = Trainer(
        model, args, TokenDataset(64, model.config.vocab_size), loss_fn=loss_fn, layout=group_layout
    )
    start = time.monotonic()
    try:
        trainer.train()
    except RuntimeError as exc:
        raise RuntimeError(
            f"SURVIVOR rank {dist.get_rank()} failed after {time.monotonic() - start:.1f} s with "
            f"{type(exc).__name__}: {exc}"
        ) from None
    raise AssertionError(f"rank {dist.get_rank()} finished although rank {victim} died")


# ---------------------------------------------------------------------------- job-file factories (merak train)


def job_model(name: str = "gpt") -> torch.nn.Module:
    return build_model(name)


def job_data(size: int = 64) -> TokenDataset:
    return TokenDataset(size, build_model("gpt").config.vocab_size)


def job_data_late(size: int = 64) -> TokenDataset:
    """``job_data``; rank ``MERAK_TEST_LATE_RANK`` first sleeps ``MERAK_TEST_LATE_S`` seconds (a slow start)."""
    if os.environ.get("RANK") is not None and os.environ.get("RANK") == os.environ.get(
        "MERAK_TEST_LATE_RANK"
    ):
        time.sleep(float(os.environ.get("MERAK_TEST_LATE_S", "0")))
    return job_data(size)


def job_loss(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The LM loss; rank ``MERAK_TEST_KILL_RANK`` kills itself at the configured loss call.

    ``MERAK_TEST_KILL_AT_CALL``: one loss call per torchrun attempt, comma-separated (``"2,5"``: at
    call 2 of the first attempt and call 5 of the first restart; later attempts run through). Each
    kill appends a line to ``MERAK_TEST_KILL_MARKER``. ``MERAK_TEST_STEP_SLEEP`` (seconds per loss
    call) slows the job down so that a test can signal it in the middle of training.
    """
    delay = float(os.environ.get("MERAK_TEST_STEP_SLEEP", "0") or 0)
    if delay and not output.is_meta:
        time.sleep(delay)
    marker = os.environ.get("MERAK_TEST_KILL_MARKER")
    if marker:
        job_loss.calls = getattr(job_loss, "calls", 0) + 1  # type: ignore[attr-defined]
        rank = int(os.environ.get("RANK", "0"))
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        at_calls = [int(c) for c in os.environ["MERAK_TEST_KILL_AT_CALL"].split(",")]
        calls = job_loss.calls  # type: ignore[attr-defined]
        if (
            rank == int(os.environ["MERAK_TEST_KILL_RANK"])
            and attempt < len(at_calls)
            and calls == at_calls[attempt]
        ):
            with open(marker, "a") as f:
                f.write(f"rank {rank} killed itself at loss call {calls} of attempt {attempt}\n")
            os._exit(13)
    return lm_loss(output, labels)


def job_model_signalling(name: str = "gpt") -> torch.nn.Module:
    """The model factory of a job stopped while its ranks set up (the CLI's checks, without ``RANK``, just build).

    On a rank: with ``MERAK_TEST_SETUP_SIGNAL`` (a signal name) the rank sends it to itself; with
    ``MERAK_TEST_PID_DIR`` it writes ``rank<N>.pid`` there. Then it blocks, so that a signal ends set-up.
    """
    rank = os.environ.get("RANK")
    if rank is None:
        if os.environ.get("MERAK_TEST_CHECK_SIGNAL"):  # merak train's checks before launch
            os.kill(os.getpid(), getattr(signal, os.environ["MERAK_TEST_CHECK_SIGNAL"]))
        return build_model(name)
    pid_dir = os.environ.get("MERAK_TEST_PID_DIR")
    if pid_dir:
        with open(os.path.join(pid_dir, f"rank{rank}.pid"), "w") as f:
            f.write(str(os.getpid()))
    name_of_signal = os.environ.get("MERAK_TEST_SETUP_SIGNAL")
    if name_of_signal:
        os.kill(os.getpid(), getattr(signal, name_of_signal))
    time.sleep(600)  # only a signal ends this set-up
    return build_model(name)


# ---------------------------------------------------------------------------- signals and stalls (in the pool)


class SignalAtCollate:
    """A collate function that, once armed, sends ``signum`` to this process at its ``at_call``-th call on ``victim``.

    The collate of step ``k``'s batch runs right before step ``k`` (no loader workers), so the
    signal arrives during step ``at_call``.
    """

    def __init__(self, victim: int, signum: int, at_call: int) -> None:
        self.victim, self.signum, self.at_call = victim, signum, at_call
        self.armed, self.calls = False, 0

    def __call__(self, samples: list) -> object:
        if self.armed and dist.get_rank() == self.victim:
            self.calls += 1
            if self.calls == self.at_call:
                os.kill(os.getpid(), self.signum)
        return torch.utils.data.default_collate(samples)


def signal_trainer(
    layout: tuple[int, int, int],
    out: str,
    max_steps: int,
    collate: object = None,
    timeout_s: float | None = None,
    **extra: object,
) -> Any:
    """The GPT reference Trainer at ``layout`` (constant learning rate, logging every step)."""
    from merak_core import ParallelLayout, Trainer

    dp, tp, pp = layout
    kwargs = layout_kwargs(
        dp,
        tp,
        pp,
        max_steps=max_steps,
        output_dir=out,
        logging_steps=1,
        lr_scheduler_type="constant",
        warmup_steps=0,
        **extra,
    )
    group_layout = (
        None if timeout_s is None else ParallelLayout.build(dp, tp, pp, timeout=timedelta(seconds=timeout_s))
    )
    model = build_model("gpt")
    return Trainer(
        model,
        make_args(**kwargs),
        TokenDataset(64, model.config.vocab_size),
        loss_fn=lm_loss,
        data_collator=collate,
        layout=group_layout,
    )


def preempt_body(
    layout: tuple[int, int, int], victim: int, signum: int, at_call: int, out: str, max_steps: int
) -> dict:
    """Train until rank ``victim`` signals itself during step ``at_call``; what every rank saw."""
    from merak_core.run.signals import TrainingPreempted

    collate = SignalAtCollate(victim, signum, at_call)
    trainer = signal_trainer(layout, out, max_steps, collate)
    collate.armed = True
    before = signal.getsignal(signum)  # whatever this process had (the pool may have inherited any handler)
    try:
        trainer.train()
    except TrainingPreempted as exc:
        return {
            "step": exc.step,
            "checkpoint": exc.checkpoint,
            "signal": exc.signal_name,
            "line": exc.resume_line("merak train job.yaml --resume latest"),
            "losses": [h["loss"] for h in trainer.history],
            "handler_restored": signal.getsignal(signum) is before,
        }
    raise AssertionError(f"rank {dist.get_rank()} finished although rank {victim} was signalled")


def resume_body(layout: tuple[int, int, int], out: str, max_steps: int, resume: str | None) -> dict:
    """Train to ``max_steps`` (after resuming from ``resume``); the losses by step and the final parameters."""
    trainer = signal_trainer(layout, out, max_steps, None)
    if resume is not None:
        trainer.resume(resume)
    history = trainer.train()
    return {"losses": {int(h["step"]): h["loss"] for h in history}, "state": trainer.full_state_dict()}


def stall_body(layout: tuple[int, int, int], victim: int, at_call: int, timeout_s: float) -> None:
    """Rank ``victim`` stops itself (SIGSTOP) during step ``at_call``; the others raise within the timeout."""
    collate = SignalAtCollate(victim, signal.SIGSTOP, at_call)
    trainer = signal_trainer(
        layout,
        os.path.join(tempfile.gettempdir(), f"merak-stall-{os.getpid()}"),
        6,
        collate,
        timeout_s=timeout_s,
    )
    collate.armed = True
    start = time.monotonic()
    try:
        trainer.train()
    except RuntimeError as exc:
        raise RuntimeError(
            f"SURVIVOR rank {dist.get_rank()} failed after {time.monotonic() - start:.1f} s with "
            f"{type(exc).__name__}: {exc}"
        ) from None
    raise AssertionError(f"rank {dist.get_rank()} finished although rank {victim} stopped")


# ---------------------------------------------------------------------------- merak train jobs in subprocesses


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def job_env(**extra: str) -> dict[str, str]:
    """The environment of a ``merak train`` subprocess: this checkout's packages first, one thread per rank."""
    paths = [REPO] + [
        os.path.join(REPO, "packages", p, "src")
        for p in ("merak-pipe", "merak-graph", "merak-tp", "merak-core")
    ]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths), OMP_NUM_THREADS="1", **extra)


def write_job(path: str, training: dict, data_size: int = 64) -> str:
    """A job file of the reference GPT on TokenDataset with ``training`` (TrainingArguments fields)."""
    import yaml

    job = {
        "model": {"factory": "tests.e2e._fault_support:job_model"},
        "data": {"factory": "tests.e2e._fault_support:job_data", "kwargs": {"size": data_size}},
        "loss": "tests.e2e._fault_support:job_loss",
        "training": training,
    }
    with open(path, "w") as f:
        yaml.safe_dump(job, f)
    return path


def children(pid: int) -> list[int]:
    """The direct child processes of ``pid`` (Linux ``/proc``)."""
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def process_env(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            items = f.read().split(b"\0")
    except OSError:
        return {}
    return dict(item.decode(errors="replace").split("=", 1) for item in items if b"=" in item)


def job_processes(cli_pid: int) -> tuple[int | None, dict[int, int]]:
    """torchrun's pid under a ``merak train`` process and its ranks' pids by global rank (whatever started yet)."""
    for child in children(cli_pid):
        ranks = {}
        for worker in children(child):
            rank = process_env(worker).get("RANK")
            if rank is not None:
                ranks[int(rank)] = worker
        if ranks or "torch.distributed.run" in _cmdline(child):
            return child, ranks
    return None, {}


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def logged_steps(output_dir: str) -> list[int]:
    """Steps of the training records in ``output_dir/metrics.jsonl`` so far (a torn last line ignored)."""
    import json

    path = os.path.join(output_dir, "metrics.jsonl")
    steps = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if "loss" in record:
                    steps.append(int(record["step"]))
    except OSError:
        pass
    return steps


def job_ranks_body(job: str, overrides: list[str], resume: str | None = None) -> dict[int, float]:
    """A job file's ranks on the pool's ranks, set up as ``merak_core.launch`` sets up torchrun's.

    The job file and its overrides, ``prepare_job``, the Trainer, ``--resume``, then ``train()``: what a
    rank of ``merak train`` runs between the process groups and the summary. Where the launch is not
    what a test checks (a reference run of a job, the last leg of a resume chain), this saves a
    ``merak train`` job (torchrun and every rank started from nothing). The losses by step.
    """
    from merak_core.autoplan.prepare import prepare_job
    from merak_core.job import JobConfig
    from merak_core.launch import resume_target
    from merak_core.trainer import Trainer

    config = JobConfig.from_yaml(job, overrides)
    datasets = config.build_datasets()
    trainer = Trainer.from_prepared(prepare_job(config, datasets, job_file=job, job_overrides=overrides))
    target = resume_target(resume)
    if target is not None:
        trainer.resume(target)
    return {int(h["step"]): h["loss"] for h in trainer.train()}
