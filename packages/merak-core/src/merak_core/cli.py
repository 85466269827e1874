"""The ``merak`` command line.

``merak plan CONFIG.yaml --world-size N --memory-per-device 8GiB`` profiles the
job's model on this machine and prints the planner's ranked configurations
(:mod:`merak_core.planner`); ``--write-config`` writes the job with the best one.

``merak train CONFIG.yaml [section.key=value ...]`` starts the job through
torchrun (``torch.distributed.run``): one process per rank, single node by
default, the usual multi-node flags passed through. Merak has no launcher of
its own; each rank then runs :mod:`merak_core.launch`.

``merak plans`` lists the registered TP plans; ``merak check CONFIG.yaml`` compares
every module the job's TP plan shards with the unsharded module (:mod:`merak_core.tp_check`).
``merak export CHECKPOINT --to-hf OUT`` writes a checkpoint as a Hugging Face folder (:mod:`merak_core.hf.cli`).
``merak eval CONFIG.yaml --checkpoint latest`` evaluates a checkpoint (:mod:`merak_core.eval_job`).

Only this module (and the per-rank entry point) configures logging; the
libraries never touch the root logger.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shlex
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

from merak_core import __version__
from merak_core.exitcodes import BAD_INPUT, PREEMPTED


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a model described by a YAML job file",
        description="Launch a training job with torchrun. Overrides are 'section.key=value' "
        "(e.g. training.max_steps=50 training.dp=2).",
    )
    p.add_argument("config", help="YAML job file (see examples/addition/config.yaml)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides of the job file")
    p.add_argument(
        "--nproc-per-node", type=int, default=None, help="processes on this node (default: dp*tp*pp / nnodes)"
    )
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--node-rank", type=int, default=None, help="this node's rank (static rendezvous)")
    p.add_argument("--rdzv-endpoint", default=None, help="host:port of the c10d rendezvous (multi-node)")
    p.add_argument("--rdzv-id", default="merak", help="rendezvous job id (default 'merak')")
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
    _add_cluster_flags(p, plan=False)


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
            f"--rdzv-id={args.rdzv_id}",
        ]
        if args.node_rank is not None:
            cmd.append(f"--node-rank={args.node_rank}")
    cmd += ["-m", "merak_core.launch", args.config, *args.overrides]
    if args.resume:
        cmd += ["--resume", args.resume]
    return cmd


def _train(args: argparse.Namespace) -> int:
    from merak_core.job import JobConfig

    if args.timeout is not None:  # one more override, so the ranks read the same value from the job
        args.overrides = [*args.overrides, f"training.comm_timeout_s={args.timeout!r}"]
    job = JobConfig.from_yaml(args.config, args.overrides)  # validates before any process starts
    if args.dry_run_ranks is not None:
        return _cluster_command(args, job)
    t = job.training
    if t.layout == "auto" and args.nproc_per_node is None:
        raise ValueError(
            "training.layout is 'auto', so the job does not say how many ranks to start: pass "
            "--nproc-per-node (and --nnodes for several nodes)"
        )
    cmd = torchrun_command(args, None if t.dp is None else t.dp * t.tp * t.pp)
    if (
        t.dp is None and t.layout != "auto"
    ):  # inferred: tp*pp must divide the process count now, not on every rank
        from merak_core.layout import resolve_degrees

        resolve_degrees(args.nproc_per_node * args.nnodes, None, t.tp, t.pp)
    if not args.no_check:
        from merak_core.preflight import preflight

        report = preflight(
            job, resume=args.resume
        )  # once, here: a mistake is reported once, not by every rank after launch
        logging.getLogger("merak").info("job checked: %s", report)
    if args.dry_run:
        if t.layout == "auto":
            print(_auto_dry_run(args, t))
        print(shlex.join(cmd))
        return 0
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    with _output_dir_lock(args, t.output_dir) as lock:
        logging.getLogger("merak").info("launching: %s", shlex.join(cmd))
        return _supervise(args, cmd, env, lock, t.output_dir)


def _output_dir_lock(args: argparse.Namespace, output_dir: str) -> Any:
    """The lock of ``output_dir`` (see [Note: output_dir lock]).

    On several nodes only ``--node-rank 0`` takes it: the nodes of one job may share the directory,
    and without a node rank (an elastic rendezvous) no node knows that it is the first.
    """
    import contextlib

    from merak_core.outdir_lock import OutputDirLock, OutputDirLocked

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
    from merak_core.signals import restart_command
    from merak_core.supervise import failure_line, run_torchrun

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


def _auto_dry_run(args: argparse.Namespace, t: Any) -> str:
    """What ``layout: auto`` will do when the job starts (``merak train --dry-run``)."""
    world = args.nproc_per_node * args.nnodes
    gbs = t.per_device_train_batch_size * t.gradient_accumulation_steps * world
    memory = (
        f"{t.memory_per_device} bytes"
        if t.memory_per_device is not None
        else "the device's memory (CUDA: total memory; CPU: RAM / ranks on the node)"
    )
    checks = t.plan_check_steps if t.plan_check_steps is not None else 5
    memory_flag = (
        f" --memory-per-device {t.memory_per_device}"
        if t.memory_per_device is not None
        else " --memory-per-device <bytes>"
    )
    return "\n".join(
        [
            f"layout: auto -- when the job starts, on {world} ranks:",
            "  1. rank 0 profiles the model on one microbatch of the training set; every rank measures p2p and "
            "all-reduce costs;",
            f"  2. rank 0 plans dp*tp*pp={world}, schedule, microbatches and recompute for a global batch of {gbs} "
            f"(per_device_train_batch_size {t.per_device_train_batch_size} x gradient_accumulation_steps "
            f"{t.gradient_accumulation_steps} x {world} ranks), {memory}, CPU ranks sharing cores counted;",
            "  3. every rank trains with the first choice (the ranked table is logged);",
            f"  4. after {checks} steps (plan_check_steps; 0: off) predicted and measured step time, per-stage F/B and "
            f"peak memory are compared; above {100 * t.plan_error_threshold:g}% error it re-plans from the measured "
            "costs and, when another configuration is predicted faster, writes output_dir/replanned.yaml.",
            f"  To see the ranking now: merak plan {shlex.join([args.config, *args.overrides])} --world-size {world}"
            f"{memory_flag}",
        ]
    )


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="rank (dp, tp, pp) layouts, schedules, microbatches and recomputation for a job",
        description="Profile the job's model on this machine (one forward and backward on a batch of the training "
        "set), then print the planner's ranked configurations and why the first wins.",
    )
    p.add_argument("config", help="YAML job file")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides of the job file")
    p.add_argument(
        "--world-size", type=int, default=None, help="number of ranks (devices); required unless --cluster"
    )
    p.add_argument(
        "--memory-per-device",
        default=None,
        help="memory of one device, bytes or e.g. 8GiB (default: the job's training.memory_per_device)",
    )
    p.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="samples per optimizer step (default: the job's micro batch x accumulation x dp, "
        "dp = world size / (tp*pp) when not set)",
    )
    p.add_argument("--top", type=int, default=10, help="rows to print (default 10)")
    p.add_argument(
        "--profile-batch",
        type=int,
        default=None,
        help="samples in the profiling batch (default: micro batch)",
    )
    p.add_argument(
        "--profile-cache", default=None, help="directory of cached profiles (JSON by model and device)"
    )
    p.add_argument(
        "--compute-slots",
        type=float,
        default=None,
        help="ranks that can compute at once when the ranks share a host's cores (CPU processes: the "
        "cores, or fewer for small models; `layout: auto` measures it); default: a device per rank",
    )
    p.add_argument(
        "--write-config", default=None, metavar="OUT.yaml", help="write the job with the best configuration"
    )
    _add_cluster_flags(p, plan=True)


def _plan(args: argparse.Namespace) -> int:
    import torch

    from merak_core.config import parse_bytes
    from merak_core.job import JobConfig, write_job
    from merak_core.planner import format_plan, plan
    from merak_core.planner.auto import profile_for_plan, profile_inputs

    job = JobConfig.from_yaml(args.config, args.overrides)
    if args.cluster is not None or args.dry_run_ranks is not None:
        return _cluster_command(args, job)
    t = job.training
    if args.memory_per_device is None and t.memory_per_device is None:
        raise ValueError(
            "--memory-per-device is not given and the job sets no training.memory_per_device: "
            "pass e.g. --memory-per-device 8GiB"
        )
    memory = parse_bytes(
        args.memory_per_device if args.memory_per_device is not None else int(t.memory_per_device or 0)
    )
    if args.world_size is None or args.world_size < 1:
        raise ValueError(
            f"--world-size={args.world_size}: expected a number of ranks >= 1 (or plan for a cluster "
            "with --cluster FILE --nodes N)"
        )
    gbs = args.global_batch_size
    if gbs is None:
        dp = t.dp if t.dp is not None else max(args.world_size // (t.tp * t.pp), 1)
        gbs = t.per_device_train_batch_size * t.gradient_accumulation_steps * dp
    torch.manual_seed(t.seed)
    model = job.build_model()
    train, _ = job.build_datasets()
    batch = profile_inputs(
        model, train, args.profile_batch or t.per_device_train_batch_size, job.optional("collate")
    )
    profile = profile_for_plan(model, batch, tp_plan=t.tp_plan, cache_dir=args.profile_cache)
    cands = plan(
        profile,
        world_size=args.world_size,
        memory_per_device=memory,
        global_batch_size=gbs,
        zero_stage=t.zero_stage,
        compute_slots=args.compute_slots,
    )
    print(
        f"{len(cands)} feasible configurations for {args.world_size} ranks, {memory} bytes per device, "
        f"global batch {gbs} (profile: {profile.num_layers} layers on {profile.device})"
    )
    print(format_plan(cands, top=args.top))
    if args.write_config:
        write_job(args.config, args.write_config, cands[0].training_fields(), overrides=args.overrides)
        print(f"wrote {args.write_config}")
    return 0


def _add_cluster_flags(p: argparse.ArgumentParser, *, plan: bool) -> None:
    """Planning for a described cluster and dry runs at N ranks (merak_core.planner.cluster_job)."""
    p.add_argument(
        "--cluster",
        default=None,
        metavar="FILE|NAME",
        help="a cluster description (YAML) or a shipped one (a100-80gb-8x, h100-sxm-8x, h200-8x): price "
        "the meta-traced model on it instead of profiling here" + ("" if plan else " (dry run)"),
    )
    p.add_argument(
        "--dry-run-ranks",
        type=int,
        default=None,
        metavar="N",
        help="build, in this process, what each of N ranks would build (groups, stages, schedule, "
        "recomputation, tied-parameter groups, memory against the cluster's device); dp = N/(tp*pp)",
    )
    if plan:
        p.add_argument("--nodes", type=int, default=None, help="nodes of the --cluster to plan for")
        p.add_argument(
            "--dry-run",
            action="store_true",
            help="with --cluster and --nodes: dry-run the job's layout on every rank of those nodes",
        )


def _cluster_command(args: argparse.Namespace, job: Any) -> int:
    """``--cluster FILE --nodes N`` (ranked plan) and ``--dry-run-ranks N`` / ``--dry-run`` (dry run)."""
    from merak_core.planner.cluster import load_cluster
    from merak_core.planner.cluster_job import dry_run_job, job_model, plan_job_on_cluster

    cluster = load_cluster(args.cluster if args.cluster is not None else "h100-sxm-8x")
    nodes = getattr(args, "nodes", None)
    ranks = args.dry_run_ranks
    if ranks is None and getattr(args, "dry_run", False):
        if nodes is None:
            raise ValueError("merak plan --dry-run needs --cluster FILE --nodes N (or --dry-run-ranks N)")
        ranks = nodes * cluster.devices_per_node
    if ranks is None and nodes is None:
        raise ValueError("--cluster needs --nodes N (how many nodes to plan for) or --dry-run-ranks N")
    for name, v in (("--nodes", nodes), ("--dry-run-ranks", ranks)):
        if v is not None and v < 1:
            raise ValueError(f"{name}={v}: expected >= 1")
    jm = job_model(job)
    if args.cluster is None:
        print(f"cluster: {cluster.name} (the default; pass --cluster FILE for another)")
    if ranks is not None:
        report = dry_run_job(jm, cluster, world_size=ranks, training=job.training)
        print(report.summary())
        return 0 if report.ok else 1
    assert nodes is not None  # checked above
    t = job.training
    gbs = args.global_batch_size or t.per_device_train_batch_size * t.gradient_accumulation_steps * max(
        nodes * cluster.devices_per_node // (t.tp * t.pp), 1
    )
    text, best = plan_job_on_cluster(jm, cluster, num_nodes=nodes, global_batch_size=gbs, top=args.top)
    print(text)
    if args.write_config:
        from merak_core.job import write_job

        write_job(args.config, args.write_config, best.training_fields(), overrides=args.overrides)
        print(f"wrote {args.write_config}")
    return 0


def _add_plans(sub: argparse._SubParsersAction) -> None:
    sub.add_parser(
        "plans",
        help="list the registered tensor-parallel plans and the model types they cover",
        description="List the TP plans merak_tp knows (built in: transformers families by model_type), "
        "for training.tp_plan.",
    )


def _plans(_args: argparse.Namespace) -> int:
    import merak_tp

    for name, covers in merak_tp.list_plans().items():
        print(f"{name:<18} {', '.join(covers) or '-'}")
    return 0


def _add_check(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "check",
        help="check that the job's TP plan shards its model exactly",
        description="Run one batch through the job's model unsharded and sharded with its TP plan "
        "on tp CPU processes (gloo), and report the largest difference of every sharded module's "
        "output. Exits 1 when one is above the tolerance.",
    )
    p.add_argument("config", help="YAML job file")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides of the job file")
    p.add_argument(
        "--tp", type=int, default=None, help="TP ranks to check on (default: the job's tp, at least 2)"
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="largest relative difference accepted (default 1e-9, float64 rounding; 1e-5 when the "
        "sharded modules compute in float32 inside)",
    )
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--tiny",
        action="store_true",
        default=None,
        help="check the same family at a tiny config (transformers models)",
    )
    size.add_argument(
        "--full", dest="tiny", action="store_false", help="check the job's model itself, however large"
    )
    p.add_argument(
        "--max-params",
        type=int,
        default=None,
        help="above this many parameters the tiny config is checked (default 200,000,000); a model "
        "that does not fit the check's memory is checked at the tiny config too",
    )


def _check(args: argparse.Namespace) -> int:
    from merak_core.job import JobConfig
    from merak_core.tp_check import default_tolerance, format_report
    from merak_core.tp_check_job import check_job

    job = JobConfig.from_yaml(args.config, args.overrides)
    rows, checked = check_job(job, tp=args.tp, tiny=args.tiny, max_params=args.max_params)
    tolerance = default_tolerance(rows) if args.tolerance is None else args.tolerance
    print(f"TP plan check of {args.config}: {checked}")
    print(format_report(rows, tolerance=tolerance))
    return 1 if any(r.relative > tolerance for r in rows) else 0


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="merak", description="Automated 3D-parallel training for PyTorch.")
    parser.add_argument("--version", action="version", version=f"merak {__version__}")
    parser.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_train(sub)
    _add_plan(sub)
    _add_plans(sub)
    _add_check(sub)
    from merak_core.hf.cli import add_parser as _add_export

    _add_export(sub)
    from merak_core.eval_job import add_parser as _add_eval

    _add_eval(sub)
    return parser


class _StoppedBeforeLaunch(BaseException):
    """SIGINT or SIGTERM while ``merak train`` checks the job (the signal's name is the message).

    A ``BaseException``, like ``KeyboardInterrupt``: the checks report a factory's ``Exception`` as bad input.
    """


@contextlib.contextmanager
def _stop_before_launch() -> Iterator[None]:
    """Turn SIGINT/SIGTERM into :class:`_StoppedBeforeLaunch` (torchrun's supervisor installs its own meanwhile)."""

    def stop(signum: int, frame: Any) -> None:
        raise _StoppedBeforeLaunch(signal.Signals(signum).name)

    if threading.current_thread() is not threading.main_thread():  # only the main thread has handlers
        yield
        return
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    except KeyboardInterrupt:  # a SIGINT handler of someone else's
        raise _StoppedBeforeLaunch("SIGINT") from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "train":
        try:
            with _stop_before_launch():
                return _train(args)
        except ValueError as exc:  # a bad job file or override: one clear line, no traceback
            print(f"merak train: error: {exc}", file=sys.stderr)
            return BAD_INPUT
        except _StoppedBeforeLaunch as exc:  # SIGINT/SIGTERM before torchrun started (while checking the job)
            print(
                f"merak train: stopped by {exc} before the job started (nothing was launched)",
                file=sys.stderr,
            )
            return PREEMPTED
    if args.command == "plan":
        try:
            return _plan(args)
        except ValueError as exc:
            print(f"merak plan: error: {exc}", file=sys.stderr)
            return 2
    if args.command == "plans":
        return _plans(args)
    if args.command == "check":
        try:
            return _check(args)
        except ValueError as exc:
            print(f"merak check: error: {exc}", file=sys.stderr)
            return BAD_INPUT
    if args.command == "export":
        from merak_core.hf.cli import run as _export

        try:
            return _export(args)
        except ValueError as exc:  # CheckpointError included
            print(f"merak export: error: {exc}", file=sys.stderr)
            return BAD_INPUT
    if args.command == "eval":
        from merak_core.eval_job import run as _eval

        try:
            return _eval(args)
        except ValueError as exc:
            print(f"merak eval: error: {exc}", file=sys.stderr)
            return BAD_INPUT
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
