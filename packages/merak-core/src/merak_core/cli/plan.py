"""``merak plan CONFIG.yaml``: the planner's ranked configurations for a job, here or on a described cluster.

Without ``--cluster`` the job's model is profiled on this machine (one forward and backward on a
batch of the training set, in the job's dtype and under its bf16 autocast, as ``layout: auto``) and :func:`merak_core.planner.plan` ranks the layouts; ``--write-config``
writes the job with the best one. ``--cluster FILE --nodes N`` prices the meta-traced model on a
described cluster instead, and ``--dry-run-ranks N`` builds what each of N ranks would build
(:mod:`merak_core.autoplan.cluster_job`; ``merak train`` takes the same flags).

Not done here: the planning itself (``planner/``).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping
from typing import Any

from merak_core.cli.job_args import add_job_command

__all__ = ["add_cluster_flags", "add_parser", "cluster_command", "plan_memory", "run", "runtime_costs"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = add_job_command(
        sub,
        "plan",
        help="rank (dp, tp, pp) layouts, schedules, microbatches and recomputation for a job",
        description="Profile the job's model on this machine (one forward and backward on a batch of the training "
        "set), then print the planner's ranked configurations and why the first wins.",
    )
    p.add_argument(
        "--world-size", type=int, default=None, help="number of ranks (devices); required unless --cluster"
    )
    p.add_argument(
        "--memory-per-device",
        default=None,
        help="memory of one device, bytes or e.g. 8GiB (default: the job's training.memory_per_device, else "
        "as layout: auto: a CUDA device's free memory less a margin, or this machine's RAM / --world-size)",
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
        "--split-backward-scale",
        type=float,
        default=None,
        help="the pipeline runtime's (I + W) / B, what the zero-bubble schedules' split backward costs against "
        "one backward (default: measured here on the profiled model's first block, as layout: auto does)",
    )
    p.add_argument(
        "--per-action-us",
        type=float,
        default=0.0,
        help="the pipeline runtime's own microseconds per action (default 0: it needs the job's ranks to "
        "measure; layout: auto measures it, benchmarks/bench_pipe_runtime.py --section actions prints it)",
    )
    p.add_argument(
        "--write-config", default=None, metavar="OUT.yaml", help="write the job with the best configuration"
    )
    add_cluster_flags(p, plan=True)


def run(args: argparse.Namespace) -> int:
    import torch

    from merak_core.autoplan.auto import (
        cast_floats,
        profile_for_plan,
        profile_inputs,
        with_adapters,
    )
    from merak_core.autoplan.givens import model_degrees
    from merak_core.job import JobConfig, write_job
    from merak_core.planner import format_plan, plan
    from merak_core.planner.choices import searched_virtual_stages
    from merak_core.planner.context_cost import runnable_cp

    job = JobConfig.from_yaml(args.config, args.overrides)
    if args.cluster is not None or args.dry_run_ranks is not None:
        given = ["--split-backward-scale"] if args.split_backward_scale is not None else []
        given += ["--per-action-us"] if args.per_action_us else []
        if given:
            raise ValueError(
                f"{' and '.join(given)} with --cluster/--dry-run-ranks: the cluster file prices the pipeline "
                "runtime (device.per_action_us); these flags are for planning on this machine: drop them or --cluster"
            )
        return cluster_command(args, job)
    t = job.training
    check_runtime_flags(args)
    if args.world_size is None or args.world_size < 1:
        raise ValueError(
            f"--world-size={args.world_size}: expected a number of ranks >= 1 (or plan for a cluster "
            "with --cluster FILE --nodes N)"
        )
    memory, memory_from = plan_memory(args.memory_per_device, t.memory_per_device, args.world_size)
    gbs = args.global_batch_size
    if gbs is None:
        dp = t.dp if t.dp is not None else max(args.world_size // (t.cp * t.tp * t.pp), 1)
        gbs = t.per_device_train_batch_size * t.gradient_accumulation_steps * dp
    torch.manual_seed(t.seed)
    model = job.build_model().to(dtype=t.torch_dtype)  # profiled as the job trains: its dtype, its autocast
    if job.model.lora is not None:  # the adapters train, the rest is frozen: weights only in the plan
        with_adapters(model, job.model.lora, seed=t.seed)
    train, _ = job.build_datasets()
    batch = profile_inputs(
        model, train, args.profile_batch or t.per_device_train_batch_size, job.optional("collate")
    )
    batch = cast_floats(batch, t.torch_dtype)
    flags = {"loss_fn_given": job.optional("loss") is not None}
    flags["compute_metrics_given"] = job.optional("metrics") is not None
    degrees = model_degrees(model, batch, t, args.world_size, lora=job.model.lora, **flags)
    profile = profile_for_plan(model, batch, tp_plan=t.tp_plan, bf16=t.bf16, cache_dir=args.profile_cache)
    comm, comm_from = runtime_costs(args, model, batch, bf16=t.bf16)
    cands = plan(
        profile,
        comm=comm,
        world_size=args.world_size,
        memory_per_device=memory,
        global_batch_size=gbs,
        zero_stage=t.zero_stage,
        compute_slots=args.compute_slots,
        virtual_stages=searched_virtual_stages(args.compute_slots),  # what layout: auto searches
        cp_degrees=degrees["cp"],  # what the model and its batch allow, as layout: auto
        cp_mode=t.cp_mode,
        ep_degrees=degrees["ep"],
    )
    cands = runnable_cp(cands, model)
    print(f"memory per device: {memory} bytes ({memory / 2**30:.3g} GiB), {memory_from}")
    print(comm_from)
    print(
        f"{len(cands)} feasible configurations for {args.world_size} ranks, {memory} bytes per device, "
        f"global batch {gbs} (profile: {profile.num_layers} layers on {profile.device})"
    )
    print(format_plan(cands, top=args.top))
    if args.write_config:
        axes = [f"training.cp={cands[0].cp}", f"training.ep={cands[0].ep}"]  # the plan's, not the job's
        write_job(args.config, args.write_config, cands[0], overrides=[*args.overrides, *axes])
        print(f"wrote {args.write_config}")
    return 0


def check_runtime_flags(args: argparse.Namespace) -> None:
    """``--per-action-us`` and ``--split-backward-scale``, refused by name before the model is built."""
    from merak_core.planner.action_cost import check_split_backward_scale

    if not (math.isfinite(args.per_action_us) and args.per_action_us >= 0):
        raise ValueError(
            f"--per-action-us={args.per_action_us}: expected the runtime's microseconds per action, a finite "
            "number >= 0 (layout: auto measures it; benchmarks/bench_pipe_runtime.py --section actions prints it)"
        )
    if args.split_backward_scale is not None:
        check_split_backward_scale("--split-backward-scale", args.split_backward_scale)


def runtime_costs(args: argparse.Namespace, model: Any, batch: Any, *, bf16: bool) -> tuple[Any, str]:
    """The ``CommModel`` ``merak plan`` plans with: the pipeline runtime's per-action cost and split
    backward, given or measured, and a line saying which.

    ``layout: auto`` measures both on the job's ranks; ``merak plan`` runs in one process, so it
    measures the split backward (one block of the profiled model, no collective:
    :func:`~merak_core.planner.action_cost.measure_split_backward_scale`) and takes the per-action
    cost from ``--per-action-us`` (0 when not given). Without this, the zero-bubble schedules were
    planned as if their split backward cost what one backward does (a scale of 1).
    """
    import torch

    from merak_core.parallel.devices import autocast
    from merak_core.planner import CommModel
    from merak_core.planner.action_cost import measure_split_backward_scale

    # the flags were checked before the model was built (check_runtime_flags)
    if args.split_backward_scale is not None:
        scale = float(args.split_backward_scale)
        how = "given"
    elif args.world_size == 1:  # as layout: auto: one rank has no pipeline to split
        scale, how = 1.0, "one rank: no pipeline, not measured"
    else:
        param = next(model.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")
        with autocast(bf16, device):
            scale = measure_split_backward_scale(model, batch)
        how = "measured here on the model's first block"
    comm = CommModel(per_action_s=args.per_action_us * 1e-6, split_backward_scale=scale)
    line = (
        f"pipeline runtime: split backward (I + W) / B = {scale:.3g} ({how}), "
        f"{args.per_action_us:g} us per action ({'given' if args.per_action_us else 'not measured: --per-action-us'})"
    )
    return comm, line


def plan_memory(flag: str | None, job_value: int | str | None, world_size: int) -> tuple[int, str]:
    """The memory per device ``merak plan`` plans with (checked before the model is built), and where it came from.

    ``--memory-per-device``, else the job's ``training.memory_per_device``, else the default of
    ``layout: auto`` (:func:`~merak_core.autoplan.givens.default_memory_per_device`) for a device of this
    machine: CUDA device 0 when there is one, else the CPU shared by ``world_size`` ranks.
    """
    from merak_core.config import parse_bytes

    if flag is not None:
        return parse_bytes(flag), "from --memory-per-device"
    if job_value is not None:
        return parse_bytes(job_value), "from training.memory_per_device"
    import torch

    from merak_core.autoplan.givens import default_memory_per_device

    if torch.cuda.is_available():
        device, what = torch.device("cuda", 0), "CUDA device 0's free memory less a margin"
    else:
        device, what = torch.device("cpu"), f"this machine's RAM / {world_size} ranks"
    memory = default_memory_per_device(device, ranks=world_size)
    return memory, f"the default, as layout: auto ({what}); pass --memory-per-device to plan for another"


def add_cluster_flags(p: argparse.ArgumentParser, *, plan: bool) -> None:
    """Planning for a described cluster and dry runs at N ranks (merak_core.autoplan.cluster_job)."""
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


def _cluster_cps(job: Any, jm: Any, ranks: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The cp degrees and modes ``merak plan --cluster`` tries ([Note: cluster cp search] in
    planner/cluster_context.py): those ``layout: auto`` may choose for the job's model and sequence among the
    divisors of ``ranks`` (the devices of a node the world fills), both modes unless the job sets its cp;
    cp=1 only when the job asks for expert parallelism (the run refuses cp > 1 with it)."""
    from merak_core.autoplan.givens import model_cp_degrees
    from merak_core.planner.context_cost import CP_MODES

    t = job.training
    modes = (t.cp_mode,) if t.cp > 1 else CP_MODES
    if t.ep > 1:
        return (1,), modes
    sample = jm.example_inputs if isinstance(jm.example_inputs, Mapping) else jm.example_inputs[0]
    flags = {
        "loss_fn_given": job.optional("loss") is not None,
        "compute_metrics_given": job.optional("metrics") is not None,
    }
    return model_cp_degrees(jm.model, sample, t, ranks, lora=getattr(job.model, "lora", None), **flags), modes


def cluster_command(args: argparse.Namespace, job: Any) -> int:
    """``--cluster FILE --nodes N`` (ranked plan) and ``--dry-run-ranks N`` / ``--dry-run`` (dry run)."""
    from merak_core.autoplan.cluster_job import dry_run_job, job_model, plan_job_on_cluster
    from merak_core.planner.cluster import load_cluster

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
        nodes * cluster.devices_per_node // (t.cp * t.tp * t.pp), 1
    )
    cps, modes = _cluster_cps(job, jm, math.gcd(nodes * cluster.devices_per_node, cluster.devices_per_node))
    text, best = plan_job_on_cluster(
        jm, cluster, num_nodes=nodes, global_batch_size=gbs, top=args.top, cps=cps, cp_mode=modes
    )
    print(text)
    if args.write_config:
        from merak_core.job import write_job

        write_job(args.config, args.write_config, best, overrides=args.overrides)
        print(f"wrote {args.write_config}")
    return 0
