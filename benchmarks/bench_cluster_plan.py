"""Benchmark: dry runs at cluster scale, and the Merak paper's 64-GPU experiments by simulation.

``dryrun``: :func:`merak_core.planner.dryrun.dry_run` of a Llama-70B-shaped and a GPT-20B-shaped
model (meta device, no weights) at N = 64, 256 and 1024 ranks of 8 x H100 nodes: every rank's
groups built over torch's fake process group, the meta partition, schedule, recomputation plan,
tied-parameter groups and memory. Reported: seconds per phase and in all, the first failure.

``paper``: the four GPT sizes of the Merak paper on 64 GPUs (8 nodes of a cluster file, default
8 x A100-80GB), global batch 256 sequences of 1024 tokens: (a) the baseline of Megatron-LM /
DeepSpeed-style 3D training: 1F1B, full recomputation, TP all-reduces not overlapped, the best
layout (dp, tp, pp), microbatches and ZeRO stage for that baseline; (b) Merak's best plan: shifted
critical path, stage-aware recomputation, sub-pipelined TP, its own best layout; (c) Merak's
techniques at the baseline's layout. Prints a Markdown table with the ratios beside the paper's.

``cpu``: this machine described as a cluster (one core per device, nominal numbers, see
``CPU_CLUSTER``) and the demo model (examples/addition, fp32, real weights): each pipeline stage of
pp = 1, 2, 4 is timed (forward + backward, one thread, median of 5) at micro batch 16 and 64 in
this one process, against the cluster model's prediction for that stage.

``steps``: whole steps. This machine as a measured cluster file (2 devices: the 2 cores), and the
demo trained with the real Trainer on the fork pool's gloo ranks at every layout of 1 or 2 ranks
(schedules, recomputation, TP overlap), a few steps per round over several rounds; the cluster
model's predicted step time beside the contention-corrected measured one, the median and largest
error, Spearman's rank correlation and whether the model picks the fastest layout (see
``benchmarks/_cluster_steps.py``). The file includes per-operator-class rates
(``device.op_class_gb_s``, ``benchmarks/_cluster_classes.py``), and each table is printed again
without them (the model before them, on the same measurements). ``--save FILE`` keeps the
measurements, ``--measured FILE`` predicts them again (after a change to the model) without training.

Run (single process)::

    OMP_NUM_THREADS=1 python benchmarks/bench_cluster_plan.py dryrun
    OMP_NUM_THREADS=1 python benchmarks/bench_cluster_plan.py paper [--cluster a100-80gb-8x]
    OMP_NUM_THREADS=1 python benchmarks/bench_cluster_plan.py cpu
    OMP_NUM_THREADS=1 python benchmarks/bench_cluster_plan.py steps [--quick] [--save FILE | --measured FILE]
"""

from __future__ import annotations

import argparse
import time

from merak_core.config.layout_choice import LayoutChoice
from merak_core.planner.cluster import load_cluster
from merak_core.planner.cluster_cost import model_costs, trace_for_cluster
from merak_core.planner.cluster_search import ClusterCandidate, plan_cluster, predict_config
from merak_core.planner.dryrun import dry_run
from merak_core.planner.gpt_shapes import PAPER_MODELS, REFERENCE_MODELS, build_decoder, decoder_inputs

PAPER_RATIOS = {"gpt-1.5b": 1.42, "gpt-2.5b": 1.39, "gpt-8.3b": 1.43, "gpt-20b": 1.61}
DRY_LAYOUTS = {
    "llama-70b": dict(tp=8, pp=8, num_microbatches=32),
    "gpt-20b": dict(tp=8, pp=4, num_microbatches=32),
}


def bench_dryrun(cluster_name: str, sizes: list[int]) -> None:
    cluster = load_cluster(cluster_name)
    print("| model | params | N ranks | layout | trace s | groups s | total s | first failure |")
    print("|---|---|---|---|---|---|---|---|")
    for name, layout in DRY_LAYOUTS.items():
        shape = REFERENCE_MODELS[name]
        for n in sizes:
            model = build_decoder(shape)
            t0 = time.perf_counter()
            report = dry_run(
                model,
                decoder_inputs(shape),
                cluster,
                world_size=n,
                schedule="shifted_critical_path",
                recompute="stage_aware",
                zero_stage=1,
                tp_overlap=True,
                num_heads=shape.num_heads,
                num_kv_heads=shape.kv_heads,
                vocab_size=shape.vocab_size,
                **layout,
            )
            total = time.perf_counter() - t0
            dp, tp, pp = report.degrees or (0, 0, 0)
            first = report.first_failure
            print(
                f"| {name} | {shape.num_parameters() / 1e9:.1f}B | {n} | dp{dp}-tp{tp}-pp{pp} "
                f"| {report.seconds.get('trace', 0):.2f} | {report.seconds.get('groups', 0):.2f} | {total:.2f} "
                f"| {first.kind + ' rank ' + str(first.rank) if first else 'none'} |",
                flush=True,
            )


def _describe(c: ClusterCandidate) -> str:
    rc = (
        c.recompute
        if c.recompute != "stage_aware"
        else "sa[" + ",".join(f"{f:.2f}" for f in c.recompute_fractions) + "]"
    )
    return (
        f"{c.layout} m={c.num_microbatches} mbs={c.micro_batch_size} zero{c.zero_stage} {c.schedule} {rc}"
        f"{' tp-overlap' if c.tp_overlap else ''}"
    )


def bench_paper(
    cluster_name: str, global_batch_size: int, max_microbatches: int, memory_gb: float | None = None
) -> None:
    import dataclasses

    cluster = load_cluster(cluster_name)
    if memory_gb is not None:  # the same devices with less memory (where recomputation matters)
        cluster = dataclasses.replace(
            cluster, name=f"{cluster.name} with {memory_gb:g} GB", memory_bytes=memory_gb * 1e9
        )
    nodes = 64 // cluster.devices_per_node
    print(
        f"cluster {cluster.name}: {nodes} nodes x {cluster.devices_per_node} {cluster.device_name}, global batch "
        f"{global_batch_size} x 1024 tokens\n"
    )
    print(
        "| model | (a) baseline: configuration | (a) step s | (b) Merak: configuration | (b) step s "
        "| ratio a/b | (c) Merak at (a)'s layout, s | ratio a/c | paper |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, shape in PAPER_MODELS.items():
        t0 = time.perf_counter()
        model = build_decoder(shape)
        costs = model_costs(
            trace_for_cluster(model, decoder_inputs(shape), cluster),
            model,
            num_heads=shape.num_heads,
            vocab_size=shape.vocab_size,
        )
        common = dict(num_nodes=nodes, global_batch_size=global_batch_size, max_microbatches=max_microbatches)
        base = plan_cluster(
            costs, cluster, schedules=("1f1b",), recompute_modes=("full",), tp_overlaps=(False,), **common
        )[0]
        merak = plan_cluster(
            costs,
            cluster,
            schedules=("shifted_critical_path",),
            recompute_modes=("stage_aware",),
            tp_overlaps=(True,),
            **common,
        )[0]
        same = predict_config(
            costs,
            cluster,
            LayoutChoice(
                dp=base.dp,
                tp=base.tp,
                pp=base.pp,
                schedule="shifted_critical_path",
                num_microbatches=base.num_microbatches,
                micro_batch_size=base.micro_batch_size,
                recompute="stage_aware",
                zero_stage=base.zero_stage,
                tp_overlap=True,
            ),
        )
        same_s = f"{same.step_time_s:.3f}" if same is not None and same.fits else "does not fit"
        same_r = f"{base.step_time_s / same.step_time_s:.2f}" if same is not None and same.fits else "-"
        print(
            f"| {name} | {_describe(base)} | {base.step_time_s:.3f} | {_describe(merak)} | {merak.step_time_s:.3f} "
            f"| {base.step_time_s / merak.step_time_s:.2f} | {same_s} | {same_r} | {PAPER_RATIOS[name]:.2f} |",
            flush=True,
        )
        print(f"<!-- {name}: {time.perf_counter() - t0:.1f} s to trace and search -->", flush=True)


# This machine: 2 cores of an Intel Xeon (AVX-512, 2 FMA units, 2.1 GHz): 2.1e9 x 2 x 16 x 2 = 134
# GFLOP/s fp32 per core; memory bandwidth and links are nominal guesses, not measured.
CPU_CLUSTER = {
    "name": "cpu-2core",
    "source": "nominal numbers for this machine's cores (not a spec sheet, not measured)",
    "devices_per_node": 2,
    "device": {
        "name": "xeon-core",
        "peak_tflops": {"bf16": 0.134, "fp32": 0.134},
        "memory_gb": 4,
        "memory_bandwidth_gb_s": 10,
    },
    "intra_node": {"bandwidth_gb_s": 5, "latency_us": 20},
    "efficiency": {"compute": 0.5, "memory": 0.8, "link": 0.8},
}


def thread_median_s(fn, repeats: int = 5) -> float:
    """Median CPU seconds of ``fn`` on this thread (one torch thread: all its work runs here).

    CPU time, not wall time: on a shared machine the wall time of a single-threaded kernel
    grows with every other process on the core, its CPU time hardly does.
    """
    import statistics

    fn()
    times = []
    for _ in range(repeats):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return statistics.median(times)


def measure_op_overhead_us(num_ops: int = 200, repeats: int = 9) -> float:
    """Fixed microseconds per forward operator on this core, as the cluster model counts them.

    A chain of ``num_ops`` element-wise ops on a one-element tensor, forward and backward: the
    arithmetic is nil, so the time is dispatch and autograd bookkeeping. The cluster model charges
    ``op_overhead_s`` per forward op and twice that in the backward, so the F+B time of the chain
    divided by 3 x ``num_ops`` is the value to compare with.
    """
    import torch

    x = torch.ones(1, requires_grad=True)

    def chain() -> None:
        y = x
        for _ in range(num_ops):
            y = torch.tanh(y)
        y.backward()

    return thread_median_s(chain, repeats) / (3 * num_ops) * 1e6


def bench_cpu() -> None:
    import statistics
    import sys
    from pathlib import Path

    import torch

    import merak_graph as mg
    from merak_core.planner.cluster import ClusterSpec

    torch.set_num_threads(1)
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root))
    from examples.addition.model import build_model

    overhead_us = measure_op_overhead_us()
    raw = {**CPU_CLUSTER, "device": {**CPU_CLUSTER["device"], "op_overhead_us": overhead_us}}
    cluster = ClusterSpec.from_dict(raw)
    torch.manual_seed(0)
    model = build_model(depth=4, width=64, heads=4, vocab_size=13, context=16)
    one = torch.randint(0, 13, (1, 16))
    sharded = trace_for_cluster(model, (one,), cluster, dtype="fp32")
    costs = model_costs(sharded, model, dtype="fp32")
    print(
        f"cluster {cluster.name}: {cluster.flops('fp32') / 1e9:.0f} GFLOP/s fp32 sustained per core, "
        f"{overhead_us:.2f} us per operator (measured: a chain of tiny ops, F+B)\n"
    )
    print(
        "| pp | stage | micro batch | predicted F+B ms | of which per-op overhead | roofline only | measured F+B ms "
        "| error | error without overhead |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    errors, roof_errors = [], []
    for pp in (1, 2, 4):
        part = mg.partition_sharded(sharded, pp, model=model)
        for mbs in (16, 64):
            values = (torch.randint(0, 13, (mbs, 16)),)
            for s, stage in enumerate(part.stages):
                inputs = tuple(v.detach().requires_grad_(v.is_floating_point()) for v in values)

                def step(stage=stage, inputs=inputs) -> None:
                    out = stage(*inputs)
                    outs = out if isinstance(out, tuple) else (out,)
                    sum(o.float().sum() for o in outs if o.is_floating_point()).backward()

                measured = thread_median_s(step)
                lo, hi = part.bounds[s], part.bounds[s + 1]
                roofline = 3 * mbs * sum(ly.forward_s for ly in costs.layers[lo:hi])
                overhead = 3 * cluster.op_overhead_s * sum(ly.num_ops for ly in costs.layers[lo:hi])
                predicted = roofline + overhead
                err = (predicted - measured) / measured
                roof_err = (roofline - measured) / measured
                errors.append(abs(err))
                roof_errors.append(abs(roof_err))
                print(
                    f"| {pp} | {s} | {mbs} | {predicted * 1e3:.3f} | {overhead * 1e3:.3f} | {roofline * 1e3:.3f} "
                    f"| {measured * 1e3:.3f} | {100 * err:+.0f}% | {100 * roof_err:+.0f}% |",
                    flush=True,
                )
                with torch.no_grad():
                    out = stage(*values)
                values = out if isinstance(out, tuple) else (out,)
    print(
        f"\nmedian absolute error: {100 * statistics.median(errors):.0f}% "
        f"(roofline alone: {100 * statistics.median(roof_errors):.0f}%)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="what", required=True)
    d = sub.add_parser("dryrun")
    d.add_argument("--cluster", default="h100-sxm-8x")
    d.add_argument("--sizes", default="64,256,1024")
    p = sub.add_parser("paper")
    p.add_argument("--cluster", default="a100-80gb-8x")
    p.add_argument("--global-batch-size", type=int, default=256)
    p.add_argument("--max-microbatches", type=int, default=128)
    p.add_argument("--memory-gb", type=float, default=None, help="override the device memory (GB)")
    sub.add_parser("cpu")
    s = sub.add_parser("steps")
    s.add_argument("--quick", action="store_true", help="fewer configurations, rounds and steps")
    s.add_argument("--save", help="write the measurements (and the cluster file) to this JSON file")
    s.add_argument("--measured", help="predict again for measurements saved with --save (no training)")
    args = parser.parse_args()
    if args.what == "cpu":
        bench_cpu()
    elif args.what == "steps":
        from _cluster_steps import run

        run(args.quick, measured=args.measured, save=args.save)
    elif args.what == "dryrun":
        bench_dryrun(args.cluster, [int(x) for x in args.sizes.split(",")])
    else:
        bench_paper(args.cluster, args.global_batch_size, args.max_microbatches, args.memory_gb)


if __name__ == "__main__":
    main()
