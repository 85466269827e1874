"""Benchmark: the planner's predicted step time against measured step time, demo model, 4 and 8 CPU ranks.

The demo model (examples/addition) is profiled on rank 0 alone (``--contended``: on every rank at once) (:func:`merak_core.planner.profile_model`),
the communication model is measured on the ranks (:func:`merak_core.planner.measure_comm`), and the
planner ranks every layout (dp, tp, pp) with dp*tp*pp = N for the job's global batch, knowing that
the N ranks share this machine's cores (``compute_slots``). The grid is exhaustive over layouts: for
each feasible layout, the planner's best configuration of that layout is trained for a few steps
with the real Trainer on N gloo ranks, and the median step time (after warm-up) is compared with
the prediction.
Reported: per layout predicted / measured / error, the median absolute error, Spearman's rank
correlation, and how far the planner's top choice is from the best measured layout.

Run::

    OMP_NUM_THREADS=1 PYTHONPATH=packages/merak-pipe/src:packages/merak-graph/src:packages/merak-tp/src:\\
packages/merak-core/src:. python benchmarks/bench_core_planner.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIG = ROOT / "examples/addition/config.yaml"


def _profile_body(contended: bool) -> Any:
    """Profile the demo model (on every rank at once when ``contended``: the cores are shared as in training)."""
    import torch.distributed as dist
    from torch.utils.data import default_collate

    from merak_core.job import JobConfig
    from merak_core.planner import measure_comm, measure_contention, profile_model

    job = JobConfig.from_yaml(CONFIG)
    torch.manual_seed(0)
    model = job.build_model()
    train, _ = job.build_datasets()
    batch = default_collate([train[i] for i in range(job.training.per_device_train_batch_size)])
    profile = None
    dist.barrier()
    if contended or dist.get_rank() == 0:
        profile = profile_model(model, {"input_ids": batch["input_ids"]}, repeats=5)
    dist.barrier()
    contention = measure_contention(model, {"input_ids": batch["input_ids"]})
    return profile, measure_comm(repeats=5), contention


def _probe_body(profile: Any, comm: Any, slots: float) -> Any:
    """merak_core.autoplan.probe.measure_tp_scale on the demo job (every TP degree the world allows)."""
    from merak_core.autoplan.probe import measure_tp_scale
    from merak_core.job import JobConfig

    job = JobConfig.from_yaml(
        CONFIG, ["data.kwargs.train_size=4096", "training.dp=null", "training.tp=1", "training.pp=1"]
    )
    torch.manual_seed(0)
    model = job.build_model()
    train, _ = job.build_datasets()
    return measure_tp_scale(
        job.training, model, train, profile, comm, slots, data_collator=job.optional("collate")
    )


def _train_body(
    fields: dict[str, Any], steps: int, out_dir: str, context: Any = None
) -> tuple[list[float], list[float], Any]:
    """Per step, the slowest rank's step time and pipeline (``runner.step``) time; with a plan
    context, also the plan check's measurement (rank 0)."""
    import time

    import torch.distributed as dist

    from merak_core import Trainer
    from merak_core.autoplan.prepare import prepare_job
    from merak_core.job import JobConfig

    overrides = [f"training.{k}={v}" for k, v in fields.items()] + [
        f"training.max_steps={steps}",
        "training.eval_steps=null",
        "training.logging_steps=1000",
        f"training.output_dir={out_dir}",
        "data.kwargs.train_size=4096",
        f"training.plan_check_steps={steps if context is not None else 0}",
    ]
    job = JobConfig.from_yaml(CONFIG, overrides)
    train_data, _ = job.build_datasets()
    trainer = Trainer.from_prepared(prepare_job(job, (train_data, None), plan_context=context))
    pipeline: list[float] = []
    run_step = trainer.runner.step

    def timed_step(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = run_step(*args, **kwargs)
        pipeline.append(time.perf_counter() - start)
        return out

    trainer.runner.step = timed_step  # type: ignore[method-assign]
    history = trainer.train()
    times = torch.tensor([[h["step_time_s"] for h in history], pipeline], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank ends
    check = trainer.plan_check
    measured = check.comparison.measured if check is not None and check.comparison is not None else None
    return times[0].tolist(), times[1].tolist(), measured


def _spearman(a: list[float], b: list[float]) -> float:
    def ranks(x: list[float]) -> list[float]:
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        for pos, i in enumerate(order):
            r[i] = float(pos)
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (va * vb) if va > 0 and vb > 0 else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer steps")
    parser.add_argument("--world-size", type=int, nargs="+", default=[4, 8])
    parser.add_argument(
        "--no-probe-tp",
        dest="probe_tp",
        action="store_false",
        help="plan without the TP probe (by default, as layout: auto does, short runs of the pure "
        "DP x TP layouts first measure how much slower TP shards run: merak_core.autoplan.probe)",
    )
    parser.add_argument(
        "--contended",
        action="store_true",
        help="profile on every rank at once (cores shared as in training) instead of rank 0 alone",
    )
    args = parser.parse_args()
    steps, warm = (6, 2) if args.quick else (14, 4)
    for world in args.world_size:
        _grid(world, steps, warm, args.contended, args.probe_tp)


def _grid(world: int, steps: int, warm: int, contended: bool, probe_tp: bool = False) -> None:
    import os

    from merak_core.job import JobConfig
    from merak_core.planner import PlanContext, correct_profile, plan, predict
    from tests.support.dist import run_on_ranks

    job = JobConfig.from_yaml(CONFIG)
    t = job.training
    cores = len(os.sched_getaffinity(0)) // max(int(os.environ.get("OMP_NUM_THREADS", "1")), 1)
    profile, comm, contention = run_on_ranks(world, _profile_body, contended)[0]
    slots = world / contention
    if probe_tp:
        profile = profile.__class__(**{**profile.__dict__, "vocab_size": None})
        profile = run_on_ranks(world, _probe_body, profile, comm, slots)[0].apply(profile)
    profile = profile.__class__(
        **{**profile.__dict__, "vocab_size": None}
    )  # the demo's TP plan shards no embedding
    gbs = t.per_device_train_batch_size * t.gradient_accumulation_steps * 2
    cands = plan(
        profile,
        world_size=world,
        memory_per_device=2**30,
        global_batch_size=gbs,
        comm=comm,
        schedules=("1f1b", "gpipe"),
        recompute_modes=("none",),
        compute_slots=slots,
    )
    best_per_layout: dict[str, Any] = {}
    for c in cands:
        best_per_layout.setdefault(c.layout, c)
    context = PlanContext(profile=profile, comm=comm, memory_per_device=2**30, compute_slots=slots)
    rows = []
    calibration = None
    with tempfile.TemporaryDirectory() as tmp:
        for i, (layout, c) in enumerate(best_per_layout.items()):
            fields = {k: v for k, v in c.training_fields().items()}
            # The top choice also runs the plan check: the closing-the-loop measurement.
            times, pipe, measured = run_on_ranks(
                world, _train_body, fields, steps, f"{tmp}/{i}", context if i == 0 else None
            )[0]
            if i == 0:
                calibration = measured
            rows.append((layout, c, statistics.median(times[warm:]), statistics.median(pipe[warm:])))
    corrected = correct_profile(context, rows[0][1], calibration) if calibration is not None else None
    print(
        f"\n## {world} ranks on {cores} cores, global batch {gbs}: the model runs {contention:.2f}x slower with all "
        f"ranks at once, so {slots:.2f} compute slots"
    )
    print(
        f"profile: {'every rank at once' if contended else 'rank 0 alone'}, per-microbatch overhead "
        f"{profile.microbatch_overhead_s * 1e3:.2f} ms, optimizer {profile.optimizer_s_per_byte * 1e9:.2f} ns/byte"
    )
    table = "; ".join(
        f"{n} ranks " + ", ".join(f"{x / 1024:g} KiB {t * 1e3:.2f} ms" for x, t in points)
        for n, points in sorted(comm.allreduce_by_group.items())
    )
    print(
        f"comm: p2p {comm.p2p_latency_s * 1e6:.1f} us + {comm.p2p_bandwidth / 1e6:.0f} MB/s; wait per "
        f"synchronisation with all ranks busy {comm.sync_wait_s * 1e3:.2f} ms; all-reduce by group size {table}"
    )
    print(
        "| planner rank | layout | schedule | m | predicted ms | measured ms | error % | pipeline ms: predicted "
        "/ measured | rest ms: predicted / measured | after the check on #1: predicted ms | error % |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    errors, after = [], []
    for rank, (layout, c, measured, pipe) in enumerate(rows, 1):
        err = 100 * (c.step_time_s - measured) / measured
        errors.append(abs(err))
        rest = c.step_time_s - c.pipeline_s
        again = "- | -"
        if corrected is not None:
            p = predict(
                corrected,
                dp=c.dp,
                tp=c.tp,
                pp=c.pp,
                schedule=c.schedule,
                num_microbatches=c.num_microbatches,
                micro_batch_size=c.micro_batch_size,
                recompute=c.recompute,
                comm=comm,
                compute_slots=slots,
            )
            e2 = 100 * (p.step_time_s - measured) / measured
            after.append(abs(e2))
            again = f"{p.step_time_s * 1e3:.2f} | {e2:+.1f}"
        print(
            f"| {rank} | {layout} | {c.schedule} | {c.num_microbatches} | {c.step_time_s * 1e3:.2f} | "
            f"{measured * 1e3:.2f} | {err:+.1f} | {c.pipeline_s * 1e3:.1f} / {pipe * 1e3:.1f} | "
            f"{rest * 1e3:.1f} / {(measured - pipe) * 1e3:.1f} | {again} |"
        )
    if probe_tp:
        staged = [e for e, (_, c, _, _) in zip(errors, rows, strict=True) if c.pp > 1]
        print(
            f"probe factors {', '.join(f'tp{k}: x{v:.2f}' for k, v in sorted(profile.tp_scale.items()))}, "
            f"outside the pipeline x{profile.overhead_scale:.2f}; median |error| over the layouts with pipeline "
            f"stages (not probed): {statistics.median(staged) if staged else float('nan'):.1f}%"
        )
    if after:
        print(
            f"after the plan check on the top choice (closing the loop): median |error| over the other layouts "
            f"{statistics.median(after[1:]):.1f}%"
        )
    pred = [c.step_time_s for _, c, _, _ in rows]
    meas = [m for _, _, m, _ in rows]
    best = min(meas)
    print(
        f"median |error| {statistics.median(errors):.1f}%  spearman {_spearman(pred, meas):.2f}  "
        f"top choice {rows[0][0]} is {100 * (meas[0] / best - 1):.1f}% slower than the best measured "
        f"({rows[meas.index(best)][0]})",
        flush=True,
    )


if __name__ == "__main__":
    main()
