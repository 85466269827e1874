"""Per-rank entry point of ``merak train`` (run by torchrun: ``python -m merak_core.launch JOB.yaml ...``).

Reads the job file, lets the planner choose the layout when the job says ``layout: auto``
(:mod:`merak_core.autoplan`), initialises the layout from torchrun's environment, builds
the model and data on every rank (the same seed everywhere), resumes from a
checkpoint when asked (``--resume PATH|latest|auto``) or when torchrun restarted
the job (see :func:`resume_target`), trains, evaluates and writes ``summary.json``
next to the metrics. Logging is configured here,
INFO on global rank 0 and WARNING elsewhere.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def resume_target(requested: str | None) -> str | None:
    """What to resume from: ``--resume`` as given; after a torchrun restart, ``auto`` when nothing was given.

    torchrun (``--max-restarts N``) sets ``TORCHELASTIC_RESTART_COUNT`` in the restarted
    workers: a restarted job continues from its last complete checkpoint by itself
    (``auto``: ``latest`` when one exists, else from scratch).
    """
    if requested is not None:
        return requested
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        return "auto"
    return None


SETUP_TIMEOUT = timedelta(minutes=15)
"""How long a rank waits for the others to arrive at process-group creation (see [Note: arrival])."""


def wait_for_every_rank(timeout: timedelta = SETUP_TIMEOUT) -> bool:
    """Under torchrun, wait until every rank of this attempt is here; whether there was anything to wait for.

    [Note: arrival] The ranks start together but reach process-group creation at different times
    (importing torch, the data factory, building the model: seconds apart on a loaded machine or a
    slow file system). Process-group creation waits for the others only ``comm_timeout_s``, the
    timeout meant for a step's collectives, so a rank that arrives later than that failed the whole
    job with ``DistStoreError: wait timeout``, and a restart could fail the same way. The ranks first
    meet at a counter in torchrun's store under this attempt's prefix, for up to ``timeout`` (a rank
    that dies meanwhile is torchrun's to notice), and then create the groups together. Only where the
    agent hosts the store (torchrun's default); elsewhere nothing happens.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if (
        world_size < 2
        or dist.is_initialized()
        or "MASTER_ADDR" not in os.environ
        or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    ):
        return False
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=False,
        timeout=timeout,
    )
    prefix = f"merak/arrival/attempt_{attempt}"
    if store.add(f"{prefix}/count", 1) == world_size:
        store.set(f"{prefix}/all", "1")
    store.wait([f"{prefix}/all"], timeout)
    return True


def init_restarted_process_group(timeout: timedelta | None = None) -> None:
    """After a torchrun restart, join the default process group under a key prefix of this attempt.

    [Note: restart rendezvous] torchrun restarts the workers against the same store
    (``MASTER_ADDR:MASTER_PORT``), where the previous attempt's gloo addresses are still
    published under the default group's keys: a restarted rank that reads a dead peer's
    old address first waits in ``connectFullMesh`` until the timeout. Prefixing every
    key with the attempt number (``TORCHELASTIC_RESTART_COUNT``) keeps attempts apart.
    The first attempt uses torch's usual ``env://`` initialisation.
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if attempt == 0 or dist.is_initialized() or "MASTER_ADDR" not in os.environ:
        return
    from merak_core.parallel.layout import DEFAULT_TIMEOUT

    timeout = DEFAULT_TIMEOUT if timeout is None else timeout
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=not agent_hosts_store and rank == 0,
        timeout=timeout,
        multi_tenant=not agent_hosts_store,
    )
    from merak_core.parallel.devices import default_backend, select_device

    dev = select_device()  # [Note: one device] in layout.py
    eager: dict[str, Any] = {}
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        eager["device_id"] = dev
    dist.init_process_group(
        default_backend(dev),
        store=dist.PrefixStore(f"merak/attempt_{attempt}", store),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        **eager,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="merak_core.launch")
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument(
        "--resume",
        default=None,
        metavar="PATH|latest|auto",
        help="resume from a checkpoint directory, 'latest', or 'auto' (latest if one exists)",
    )
    args = parser.parse_args(argv)

    from merak_core.run.bootstrap import configure_rank_process

    rank = configure_rank_process()

    from merak_core.run.signals import SetupSignals

    # [Note: signals during set-up]: until training starts, a stop signal ends this rank at once.
    where: dict[str, str] = {}  # the job's output_dir, once the job file is read
    with SetupSignals(lambda name: _setup_stop_line(rank, name, args, where.get("output_dir"))) as setup:
        trainer, layout, targs = _set_up(args, where)
    try:
        status = _train(trainer, layout, targs, args)
    except BaseException:
        setup.restore()  # a failing rank: torchrun's SIGTERM ends it as usual
        raise
    from merak_core.run.exitcodes import PREEMPTED

    if status != PREEMPTED:  # a preempted rank keeps ignoring signals while it exits
        setup.restore()
    return status


def say(line: str) -> None:
    """Print ``line`` to stdout in one write, its newline included, and flush.

    ``print(line)`` writes the text and the newline separately; on an unbuffered stdout (torchrun's
    ranks) a log line from another thread (the checkpoint writer's "saved checkpoint ...") can land
    between them, on the same line as the text when stdout and stderr share a terminal or pipe. Seen
    in CI: "... resume with: merak train job.yaml --resume latest[rank 0] ... saved checkpoint".
    """
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _setup_stop_line(rank: int, signal_name: str, args: argparse.Namespace, output_dir: str | None) -> str:
    """What a rank stopped during set-up prints: rank 0 how to continue, the others the fact."""
    if rank != 0:
        return f"[rank {rank}] merak: stopped by {signal_name} during set-up, before the first step"
    from merak_core.run.signals import restart_command

    command = restart_command(
        args.config, args.overrides, os.path.join(output_dir, "checkpoints") if output_dir else None
    )
    return (
        f"[rank 0] merak: stopped by {signal_name} during set-up, before the first step (nothing new to save); "
        f"start again with: {command}"
    )


def _set_up(args: argparse.Namespace, where: dict[str, str]) -> tuple[Any, Any, Any]:
    """Everything before the first step: the job file, the process groups, the model, the resume."""
    from merak_core.autoplan.prepare import prepare_job
    from merak_core.job import JobConfig
    from merak_core.trainer import Trainer

    job = JobConfig.from_yaml(args.config, args.overrides)
    targs = job.training
    if targs.output_dir:
        where["output_dir"] = targs.output_dir
    datasets = job.build_datasets()
    wait_for_every_rank(max(SETUP_TIMEOUT, targs.comm_timeout))  # [Note: arrival]
    init_restarted_process_group(targs.comm_timeout)
    # layout: auto / the plan check's profile (collective), the layout, the model, the engine: once
    trainer = Trainer.from_prepared(
        prepare_job(job, datasets, job_file=args.config, job_overrides=args.overrides)
    )
    layout, targs = trainer.layout, trainer.args
    resume = resume_target(args.resume)
    if resume is not None:
        trainer.resume(resume)
    return trainer, layout, targs


def _train(trainer: Any, layout: Any, targs: Any, args: argparse.Namespace) -> int:
    """Train, then write the summary (rank 0); PREEMPTED when a signal stopped the job."""
    from merak_core.run.exitcodes import PREEMPTED
    from merak_core.run.nonfinite import json_safe
    from merak_core.run.signals import STOP_SIGNALS, StopRequest, TrainingPreempted

    # A signal between two steps' checks is only recorded; once stopped, the rank ignores further ones
    # (torchrun sends SIGTERM to the ranks still running when the first exits) and exits with PREEMPTED.
    stopped: TrainingPreempted | None = None
    with StopRequest(
        announce=False
    ):  # inherits a signal recorded after set-up ([Note: signals during set-up])
        try:
            history = trainer.train()
        except TrainingPreempted as exc:  # every rank, after the same step ([Note: preemption])
            stopped = exc
    if stopped is not None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        if dist.get_rank() == 0:
            command = shlex.join(["merak", "train", args.config, *args.overrides]) + " --resume latest"
            say(stopped.resume_line(command))
        dist.destroy_process_group()
        return PREEMPTED
    final = trainer.last_eval
    if dist.get_rank() == 0:
        whole = trainer.metrics.summary()  # every segment of a resumed run
        summary = {
            "layout": layout.describe(),
            "steps": trainer.global_step,
            "first_loss": whole["first_loss"],
            "first_loss_step": whole["first_loss_step"],
            "final_loss": history[-1]["loss"] if history else whole["final_loss"],
            "skipped_steps": whole["skipped_steps"],
            **final,
        }
        with open(os.path.join(targs.output_dir, "summary.json"), "w") as f:
            json.dump(json_safe(summary), f, indent=2, allow_nan=False)
        say(
            "final: "
            + "  ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items())
        )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
