"""``merak train CONFIG.yaml [section.key=value ...]``: check the job, then start it through torchrun.

One process per rank (``python -m torch.distributed.run``), single node by default, the usual
multi-node flags passed through. Merak has no launcher of its own; each rank then runs
:mod:`merak_core.launch`. The job is checked here once, before any process starts
(:mod:`merak_core.checks`); the output folder is locked for the run; signals reach torchrun
and a stopped or failed job says how to resume it.

Not done here: what each rank does (``launch.py``), supervising torchrun (``supervise.py``).
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from collections.abc import Mapping
from typing import Any

from merak_core.cli.job_args import add_job_command
from merak_core.cli.plan import add_cluster_flags, cluster_command

__all__ = ["add_parser", "nccl_flight_recorder_env", "run", "torchrun_command"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = add_job_command(
        sub,
        "train",
        help="train a model described by a YAML job file",
        description="Launch a training job with torchrun. Overrides are 'section.key=value' "
        "(e.g. training.max_steps=50 training.dp=2).",
        config_help="YAML job file (see examples/addition/config.yaml)",
    )
    p.add_argument(
        "--nproc-per-node", type=int, default=None, help="processes on this node (default: dp*tp*pp / nnodes)"
    )
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--node-rank", type=int, default=None, help="this node's rank (static rendezvous)")
    p.add_argument("--rdzv-endpoint", default=None, help="host:port of the c10d rendezvous (multi-node)")
    p.add_argument(
        "--rdzv-id",
        default=None,
        help="rendezvous job id (default 'merak'; with --slurm, slurm-$SLURM_JOB_ID)",
    )
    p.add_argument(
        "--slurm",
        action="store_true",
        help="one node of a Slurm job (srun --ntasks-per-node=1): --nnodes, --node-rank, --rdzv-endpoint "
        "and --rdzv-id from the SLURM_* variables (see examples/slurm)",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="torchrun restarts after a failure; the job resumes from its last checkpoint",
    )
    p.add_argument(
        "--resume",
        default=None,
        metavar="PATH|latest|auto",
        help="resume from a checkpoint directory, the latest one in output_dir, or 'auto' (latest if "
        "there is one, else start fresh); torchrun restarts resume with 'auto' by themselves",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="seconds a collective or pipeline transfer waits for a peer before the step fails "
        "(sets training.comm_timeout_s; default: the job's, 600)",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="check the job, print the torchrun command and exit"
    )
    p.add_argument(
        "--no-check",
        action="store_true",
        help="skip the checks before launch (building the model on the meta device, a first batch)",
    )
    add_cluster_flags(p, plan=False)


def torchrun_command(args: argparse.Namespace, world_size: int | None) -> list[str]:
    """The ``python -m torch.distributed.run ...`` command line for ``merak train``.

    ``world_size`` is dp*tp*pp from the job, or None when dp is inferred (then
    ``--nproc-per-node`` decides).
    """
    if args.nnodes < 1:
        raise SystemExit(f"merak train: --nnodes must be >= 1, got {args.nnodes}")
    nproc = args.nproc_per_node
    if world_size is None:
        if nproc is None:
            raise SystemExit("merak train: training.dp is not set (inferred), so pass --nproc-per-node")
        world_size = nproc * args.nnodes
    if nproc is None:
        if world_size % args.nnodes:
            raise SystemExit(
                f"merak train: dp*tp*pp={world_size} ranks do not split evenly over --nnodes={args.nnodes}; "
                f"pass --nproc-per-node or change the degrees"
            )
        nproc = world_size // args.nnodes
    if nproc * args.nnodes != world_size:
        raise SystemExit(
            f"merak train: --nproc-per-node={nproc} x --nnodes={args.nnodes} = {nproc * args.nnodes} "
            f"processes, but the job's dp*tp*pp = {world_size}: make them equal"
        )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={args.max_restarts}",
    ]
    if args.nnodes == 1 and args.rdzv_endpoint is None:
        cmd.append("--standalone")
    else:
        if args.rdzv_endpoint is None:
            raise SystemExit("merak train: --nnodes > 1 needs --rdzv-endpoint HOST:PORT")
        cmd += [
            f"--nnodes={args.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={args.rdzv_endpoint}",
            f"--rdzv-id={args.rdzv_id or 'merak'}",
        ]
        if args.node_rank is not None:
            cmd.append(f"--node-rank={args.node_rank}")
        hosts = getattr(
            args, "rdzv_is_host", None
        )  # set by --slurm ([Note: rendezvous host] in cli/slurm.py)
        if hosts is not None:
            cmd.append(f"--rdzv-conf=is_host={'true' if hosts else 'false'}")
    cmd += ["-m", "merak_core.launch", args.config, *args.overrides]
    if args.resume:
        cmd += ["--resume", args.resume]
    return cmd


def run(args: argparse.Namespace) -> int:
    from merak_core.job import JobConfig

    if args.timeout is not None:  # one more override, so the ranks read the same value from the job
        args.overrides = [*args.overrides, f"training.comm_timeout_s={args.timeout!r}"]
    if getattr(args, "slurm", False):
        _from_slurm(args, os.environ)
    job = JobConfig.from_yaml(args.config, args.overrides)  # validates before any process starts
    if args.dry_run_ranks is not None:
        return cluster_command(args, job)
    t = job.training
    auto = t.layout == "auto"
    if auto and args.nproc_per_node is None and t.dp is None:
        raise ValueError(
            "training.layout is 'auto' and training.dp is null, so the job does not say how many ranks to "
            "start: pass --nproc-per-node (and --nnodes for several nodes)"
        )
    written = t.dp * t.cp * t.tp * t.pp if t.dp is not None else None
    cmd = torchrun_command(args, None if auto and args.nproc_per_node is not None else written)
    auto_world = (args.nproc_per_node or 0) * args.nnodes or written or 0
    if auto:  # the global batch the plan keeps, and what becomes of the written degrees: before torchrun
        from merak_core.autoplan.givens import auto_degrees_note, auto_global_batch

        auto_global_batch(t, auto_world)
        note = auto_degrees_note(t, auto_world)
        if note is not None:
            logging.getLogger("merak").warning("%s", note)
    if (
        t.dp is None and t.layout != "auto"
    ):  # inferred: tp*pp must divide the process count now, not on every rank
        from merak_core.parallel.rank_grid import resolve_degrees

        resolve_degrees(args.nproc_per_node * args.nnodes, None, t.tp, t.pp, cp=t.cp)
    if not args.no_check:
        from merak_core.checks import preflight

        report = preflight(
            job, resume=args.resume
        )  # once, here: a mistake is reported once, not by every rank after launch
        logging.getLogger("merak").info("job checked: %s", report)
    if args.dry_run:
        if auto:
            print(_auto_dry_run(args, t, auto_world))
        print(shlex.join(cmd))
        return 0
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(nccl_flight_recorder_env(t.output_dir, env))
    with _output_dir_lock(args, t.output_dir) as lock:
        logging.getLogger("merak").info("launching: %s", shlex.join(cmd))
        return _supervise(args, cmd, env, lock, t.output_dir)


def nccl_flight_recorder_env(output_dir: str, env: Mapping[str, str]) -> dict[str, str]:
    """NCCL's flight recorder for the ranks when they will run NCCL (CUDA on this node; the user's values win).

    The dumps go to ``<output_dir>/nccl_flight_recorder/`` (created here), see
    :func:`merak_core.run.watchdog.flight_recorder_env`.
    """
    import torch

    if not torch.cuda.is_available():
        return {}
    from merak_core.run.watchdog import flight_recorder_env

    os.makedirs(os.path.join(output_dir, "nccl_flight_recorder"), exist_ok=True)
    return flight_recorder_env(output_dir, env)


def _from_slurm(args: argparse.Namespace, env: Mapping[str, str]) -> None:
    """Set the multi-node flags of ``args`` from Slurm's variables (``--slurm``; :mod:`merak_core.cli.slurm`)."""
    from merak_core.cli.slurm import slurm_node

    node = slurm_node(env, rdzv_endpoint=args.rdzv_endpoint)
    given = {"--nnodes": (args.nnodes, 1, node.nnodes), "--node-rank": (args.node_rank, None, node.node_rank)}
    for flag, (value, default, derived) in given.items():
        if value not in (default, derived):
            raise ValueError(
                f"{flag} {value} contradicts Slurm's {derived}: drop {flag} (--slurm derives it)"
            )
    args.nnodes, args.node_rank, args.rdzv_endpoint = node.nnodes, node.node_rank, node.rdzv_endpoint
    args.rdzv_id = args.rdzv_id or node.rdzv_id
    args.rdzv_is_host = node.hosts_rendezvous
    logging.getLogger("merak").info(
        "Slurm node %d of %d: %s", node.node_rank, node.nnodes, " ".join(node.flags())
    )


def _output_dir_lock(args: argparse.Namespace, output_dir: str) -> Any:
    """The lock of ``output_dir`` (see [Note: output_dir lock]).

    On several nodes only ``--node-rank 0`` takes it: the nodes of one job may share the directory,
    and without a node rank (an elastic rendezvous) no node knows that it is the first.
    """
    import contextlib

    from merak_core.cli.outdir_lock import OutputDirLock, OutputDirLocked

    if args.nnodes > 1 and args.node_rank != 0:
        return contextlib.nullcontext(None)
    try:
        return OutputDirLock.acquire(
            output_dir, command=shlex.join(["merak", "train", args.config, *args.overrides])
        )
    except OutputDirLocked as exc:
        raise ValueError(str(exc)) from None


def _supervise(
    args: argparse.Namespace, cmd: list[str], env: dict[str, str], lock: Any, output_dir: str
) -> int:
    """Run torchrun with signals forwarded (see [Note: signal forwarding]); how to continue when stopped or failed."""
    from merak_core.cli.supervise import failure_line, run_torchrun
    from merak_core.run.signals import restart_command

    outcome = run_torchrun(
        cmd,
        env=env,
        pass_fds=(lock.fd,) if lock is not None else (),
        on_start=(lambda pid: lock.note(torchrun_pid=pid)) if lock is not None else None,
    )
    command = restart_command(
        args.config, _resume_overrides(args.overrides), os.path.join(output_dir, "checkpoints")
    )
    resumable = command.endswith("--resume latest")
    if outcome.preempted:
        hidden = f" ({outcome.hidden_lines} lines of shutdown output hidden)" if outcome.hidden_lines else ""
        again = (
            "Resume it from its last checkpoint with"
            if resumable
            else "Nothing was saved (no checkpoint yet); start it again with"
        )
        print(
            f"merak train: the job was stopped by a signal{hidden}. {again}:\n  {command}",
            file=sys.stderr,
            flush=True,
        )
    failed = failure_line(outcome, args.max_restarts)
    if failed is not None:
        after = f"; once fixed, resume from the last checkpoint with: {command}" if resumable else ""
        print(failed + after, file=sys.stderr, flush=True)
    return outcome.exit_status


def _resume_overrides(overrides: list[str]) -> list[str]:
    return [o for o in overrides if not o.startswith("training.comm_timeout_s=")] if overrides else []


def _auto_dry_run(args: argparse.Namespace, t: Any, world: int) -> str:
    """What ``layout: auto`` will do when the job starts on ``world`` ranks (``merak train --dry-run``)."""
    from merak_core.autoplan.givens import auto_degrees_note, auto_global_batch

    gbs, how = auto_global_batch(t, world)
    note = auto_degrees_note(t, world)
    memory = (
        f"{t.memory_per_device} bytes"
        if t.memory_per_device is not None
        else "the device's memory (CUDA: free memory less a margin; CPU: RAM / ranks on the node)"
    )
    checks = t.plan_check_steps if t.plan_check_steps is not None else 5
    memory_flag = f" --memory-per-device {t.memory_per_device}" if t.memory_per_device is not None else ""
    return "\n".join(
        [
            f"layout: auto -- when the job starts, on {world} ranks:",
            "  1. rank 0 profiles the model on one microbatch of the training set; every rank measures p2p and "
            "all-reduce costs;",
            f"  2. rank 0 plans dp*cp*tp*pp={world} (cp and ep where the model allows them), schedule, microbatches "
            f"and recompute for a global batch of {gbs} "
            f"({how}), {memory}, CPU ranks sharing cores counted;",
            *([f"  {note}"] if note is not None else []),
            "  3. every rank trains with the first choice (the ranked table is logged);",
            f"  4. after {checks} steps (plan_check_steps; 0: off) predicted and measured step time, per-stage F/B and "
            f"peak memory are compared; above {100 * t.plan_error_threshold:g}% error it re-plans from the measured "
            "costs and, when another configuration is predicted faster, writes output_dir/replanned.yaml.",
            f"  To see the ranking now: merak plan {shlex.join([args.config, *args.overrides])} --world-size {world}"
            f"{memory_flag}",
        ]
    )
