"""The ``steps`` mode of bench_cluster_plan.py: whole step times of the demo's 1- and 2-rank layouts,
predicted by the cluster cost model for this machine described as a cluster, against training them.

This machine as a cluster (:func:`cluster_file`): one node of 2 devices (the 2 cores, one thread each).
Measured first, on this machine, in CPU time: the sustained fp32 FLOP/s of a GEMM of the demo's
shapes, the bandwidth of a large element-wise add, the rate of each operator class (GELU, layer norm,
softmax, attention at the demo's shapes: ``_cluster_classes.py``), the fixed cost per operator (a chain of
tiny ops, forward and backward), and the link: its bandwidth from gloo send/recv ping-pong between 2
pool ranks (4 B and 32 MiB, the fastest trip of each), its latency from what one more all-reduce
costs 2 ranks that compute between them ([Note: a message's cost in a step]).
The result is written as a cluster file and read back with ``load_cluster``.

Each configuration (:data:`CONFIGS`: every dp x tp x pp with product 1 or 2, the cluster search's
schedules, recomputation none / full, TP overlap) trains the demo (examples/addition, global
batch 64) with the real Trainer on the fork pool's gloo ranks, a few steps after a warm-up; every
round runs every configuration once, in a rotated order, so that load changes hit all alike.

[Note: contention-free step time] The machine is shared: with a load average of 5-30 on 2 cores,
the wall time of a step measures the other processes. Each rank reads, around every step, every
thread's ``/proc/self/task/*/schedstat``: nanoseconds on a CPU (run) and nanoseconds runnable but
waiting for one (queued). When a rank is runnable it gets the CPU a fraction ``share = run / (run
+ queued)`` of the time; the idle waits of a step (bubble, waiting for the other rank's message)
are waits for the other rank's runnable time, stretched by the same factor. So the step the ranks
would take alone is ``wall x share``, with ``share`` over both ranks' threads in that step, and
``wall`` the slowest rank's. On one rank this is exactly its CPU time. We also report the busiest
rank's CPU time (``cpu``: no bubble, no idle wait), a lower bound. What this does not undo: caches
and memory bandwidth shared with the other processes, and uneven load within one step.

[Note: rates of the row's own run] The CPU time of the same code changes with the machine's load (other
processes evict the caches the step's many small operators live in): on this machine the demo's step
outside its pipeline took 2.0 ms of CPU at load 6 and 4.9 ms at load 12, and the GEMM probe read 149
and 86 GFLOP/s on different runs. A rate measured once per round then prices a row run minutes later
under another load. So every rank also measures the compute rates (GEMM, add, operator overhead)
just before and just after its own training steps, all ranks at once as they train, and the table
is given a second time with each row priced at its own rates (the median over its ranks, before and
after, and its rounds).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples/addition/config.yaml"
GLOBAL_BATCH = 64
NOMINAL_PEAK_TFLOPS = 0.134
"""2.1 GHz x 2 AVX-512 FMA units x 16 fp32 lanes x 2 FLOPs: this machine's nominal fp32 peak per core."""


@dataclass(frozen=True)
class StepConfig:
    dp: int
    tp: int
    pp: int
    schedule: str
    num_microbatches: int
    recompute: str = "none"
    tp_overlap: bool = False

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def micro_batch_size(self) -> int:
        return GLOBAL_BATCH // (self.dp * self.num_microbatches)

    @property
    def label(self) -> str:
        extra = " tp-overlap" if self.tp_overlap else ""
        return f"dp{self.dp}-tp{self.tp}-pp{self.pp} {self.schedule} m={self.num_microbatches} {self.recompute}{extra}"

    def overrides(self) -> list[str]:
        return [
            f"training.dp={self.dp}",
            f"training.tp={self.tp}",
            f"training.pp={self.pp}",
            f"training.schedule={self.schedule}",
            f"training.per_device_train_batch_size={self.micro_batch_size}",
            f"training.gradient_accumulation_steps={self.num_microbatches}",
            f"training.recompute={self.recompute}",
            f"training.overlap_chunks={2 if self.tp_overlap else 1}",
        ]


def _configs(quick: bool) -> list[StepConfig]:
    out = []
    for recompute in ("none", "full"):
        out += [
            StepConfig(1, 1, 1, "1f1b", 4, recompute),
            StepConfig(2, 1, 1, "1f1b", 2, recompute),
            StepConfig(1, 2, 1, "1f1b", 4, recompute),
            StepConfig(1, 1, 2, "1f1b", 4, recompute),
            StepConfig(1, 1, 2, "shifted_critical_path", 4, recompute),
        ]
    out.append(StepConfig(1, 2, 1, "1f1b", 4, "none", tp_overlap=True))
    if not quick:  # the bubble's weight: fewer and more microbatches at pp=2
        out += [StepConfig(1, 1, 2, "1f1b", 2), StepConfig(1, 1, 2, "1f1b", 8)]
    return out


# ---------------------------------------------------------------------------- per-thread scheduler times


def sched_ns() -> tuple[int, int, int]:
    """(ns on a CPU, ns runnable but queued) of the calling thread, and ns on a CPU of every thread
    of this process (gloo's I/O threads do part of the communication)."""
    me = threading.get_native_id()
    run = queued = total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                r, q, _ = f.read().split()
        except (OSError, ValueError):
            continue  # the thread ended
        total += int(r)
        if int(tid) == me:
            run, queued = int(r), int(q)
    return run, queued, total


def sched_delta(before: tuple[int, int, int], after: tuple[int, int, int]) -> tuple[float, float, float]:
    """Seconds (run, queued, run of all threads) between two :func:`sched_ns` readings."""
    return tuple((a - b) / 1e9 for a, b in zip(after, before, strict=True))  # type: ignore[return-value]


def corrected(walls: list[float], runs: list[float], queued: list[float]) -> float:
    """The step time without the other processes: the slowest rank's wall x the calling threads'
    share of a CPU while runnable (see [Note: contention-free step time])."""
    busy = sum(runs)
    return max(walls) * (busy / (busy + sum(queued)) if busy > 0 else 1.0)


# ---------------------------------------------------------------------------- calibration


def _measure_flops() -> float:
    """fp32 FLOP/s of the demo's GEMMs (256 tokens x 64 -> 256 and back) on this thread."""
    from bench_cluster_plan import thread_median_s

    a, w1, w2 = torch.randn(256, 64), torch.randn(64, 256), torch.randn(256, 64)

    def gemms() -> None:
        for _ in range(50):
            torch.mm(torch.mm(a, w1), w2)

    return 50 * 2 * (2 * 256 * 64 * 256) / thread_median_s(gemms, 7)


def _measure_bandwidth() -> float:
    """Bytes/s of a large element-wise add (two reads and a write of 16 MiB each) on this thread."""
    from bench_cluster_plan import thread_median_s

    x, y, z = torch.randn(4 << 20), torch.randn(4 << 20), torch.empty(4 << 20)
    return 3 * x.nbytes / thread_median_s(lambda: torch.add(x, y, out=z), 9)


def _ping_body(sizes: list[int], repeats: int) -> list[list[tuple[float, float, float]]]:
    """Round trips of send/recv between ranks 0 and 1: per size, per trip (wall, run, queued)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    out = []
    for n in sizes:
        buf = torch.zeros(max(n // 4, 1))
        rows = []
        for i in range(repeats + 2):
            dist.barrier()
            s0, t0 = sched_ns(), time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            wall = time.perf_counter() - t0
            run, queued, _ = sched_delta(s0, sched_ns())
            if i >= 2:
                rows.append((wall, run, queued))
        out.append(rows)
    return out


def _measure_link(quick: bool) -> tuple[float, float]:
    """(one-way latency s, bandwidth bytes/s) of gloo between two pool ranks from ping-pong trips: the
    latency from the fastest contention-corrected 4 B trip (a floor: other processes only add to a trip;
    a median trip read 133 to 2359 us on different runs of this shared machine), the bandwidth from the
    fastest raw trips of both sizes. Not corrected: gloo's I/O thread copies the bytes while the main
    thread, whose share the correction uses, sleeps in the wait (corrected, 32 MiB read 119 GB/s one
    way; raw, 5 GB/s)."""
    from tests.support.dist import run_on_ranks

    sizes = [4, 32 << 20]  # 32 MiB: clearly slower than 4 B even on a loaded machine
    per_rank = run_on_ranks(2, _ping_body, sizes, 10 if quick else 30)
    trips = range(len(per_rank[0][0]))  # the 4 B trips, measured on both ranks alike
    latency = min(corrected(*zip(*[per_rank[r][0][t] for r in range(2)], strict=True)) for t in trips) / 2
    raw = [
        min(max(per_rank[r][i][t][0] for r in range(2)) for t in range(len(per_rank[0][i]))) for i in range(2)
    ]
    if raw[1] <= raw[0]:
        raise RuntimeError(
            f"a 32 MiB round trip ({raw[1] * 1e6:.0f} us) was not slower than 4 B ({raw[0] * 1e6:.0f} us)"
        )
    return latency, sizes[1] / ((raw[1] - raw[0]) / 2)


MESSAGE_BYTES = 16 * 16 * 64 * 4
"""The demo's activation at micro batch 16 (16 sequences x 16 tokens x width 64, fp32): the size of
its TP all-reduces and of its pipeline messages."""


# [Note: a message's cost in a step]
# The cluster model prices a message at the link's latency (plus bytes / bandwidth), and an
# all-reduce at 2 (n - 1) latencies. The fastest ping-pong trip with a barrier before it is a floor
# (24-103 us one way here) that the steps do not reach: on this machine gloo's all-reduce of the
# demo's 64 KiB activation is bimodal (isolated calls: median 0.3 ms, p90 3.7-4.0 ms, mean 1.0-2.1
# ms, and gloo's TCP loop thread uses 0.5-1.1 ms of CPU per call, competing with the ranks' main
# threads for the 2 cores), and the demo's TP step makes 96 of them (0.82 ms each in the step,
# profiled). Priced at the floor, tp2 came out 68-84% low. So the latency in this machine's cluster
# file is what one more message costs a step: both ranks compute the demo's MLP between all-reduces
# of its activation, in blocks with and without the all-reduce, and the corrected difference per
# iteration, less the bytes' time, is the ring formula's 2 latencies at n = 2.


def _message_body(numel: int, iters: int, blocks: int) -> dict[bool, list[tuple[float, float, float]]]:
    """Blocks of ``iters`` iterations of the demo's MLP at micro batch 16, with (``True``) and without
    (``False``) an all-reduce of ``numel`` floats after each, alternating: per block (wall, run, queued)."""
    import torch.distributed as dist

    x = torch.zeros(numel)
    a, w1, w2 = torch.randn(256, 64), torch.randn(64, 256), torch.randn(256, 64)
    rows: dict[bool, list[tuple[float, float, float]]] = {True: [], False: []}
    for b in range(blocks + 1):
        for synced in (True, False) if b % 2 else (False, True):
            dist.barrier()
            s0, t0 = sched_ns(), time.perf_counter()
            for _ in range(iters):
                torch.mm(torch.nn.functional.gelu(torch.mm(a, w1)), w2)
                if synced:
                    dist.all_reduce(x)
            wall = time.perf_counter() - t0
            if b:  # the first pair warms up
                rows[synced].append((wall, *sched_delta(s0, sched_ns())[:2]))
    return rows


def _measure_message(quick: bool) -> float:
    """Seconds one more all-reduce of :data:`MESSAGE_BYTES` adds to a step of 2 pool ranks that compute
    between their all-reduces, as TP layers do ([Note: a message's cost in a step]): per block pair, the
    contention-corrected block times' difference per iteration; the median over the pairs."""
    from tests.support.dist import run_on_ranks

    iters, blocks = (20, 6) if quick else (50, 10)
    per_rank = run_on_ranks(2, _message_body, MESSAGE_BYTES // 4, iters, blocks)
    block = {
        synced: [
            corrected(*zip(*[per_rank[r][synced][i] for r in range(2)], strict=True)) / iters
            for i in range(blocks)
        ]
        for synced in (True, False)
    }
    return statistics.median(s - p for s, p in zip(block[True], block[False], strict=True))


def _action_body(microbatches: int, repeats: int) -> tuple[list[tuple[float, float, float]], int]:
    """Steps of the per-action probe (merak_core.planner.action_cost): (wall, run, queued) per step."""
    import torch.distributed as dist

    from merak_core.planner.action_cost import action_probe

    run_step, actions = action_probe(microbatches, torch.device("cpu"))
    rows = []
    for i in range(repeats + 2):
        dist.barrier()
        s0, t0 = sched_ns(), time.perf_counter()
        run_step()
        wall = time.perf_counter() - t0
        run, queued, _ = sched_delta(s0, sched_ns())
        if i >= 2:
            rows.append((wall, run, queued))
    return rows, actions


def _measure_per_action(quick: bool) -> float:
    """Seconds the pipeline runtime spends per action: the probe layout: auto runs ([Note: per-action
    measurement]) on 2 pool ranks, each step contention-corrected like the steps, the median."""
    from tests.support.dist import run_on_ranks

    per_rank = run_on_ranks(2, _action_body, 4, 10 if quick else 30)
    actions = per_rank[0][1]
    steps = [
        corrected(*zip(*[per_rank[r][0][i] for r in range(2)], strict=True))
        for i in range(len(per_rank[0][0]))
    ]
    return statistics.median(steps) / actions


def _overhead_body(
    depth: int, steps: int, warm: int, out_dir: str, width: int
) -> tuple[int, int, list[float]]:
    """One rank trains the demo's model at ``depth`` layers of ``width``, micro batch 1: (parameter
    tensors, parameters, per measured step the main thread's CPU seconds of the step outside its pipeline)."""
    overrides = [
        "training.dp=1",
        "training.tp=1",
        "training.pp=1",
        "training.per_device_train_batch_size=1",
        "training.gradient_accumulation_steps=1",
        f"model.kwargs.depth={depth}",
        f"model.kwargs.width={width}",
    ]
    trainer = _build_trainer(overrides, steps, out_dir)
    runner, inner = trainer.engine.runner, trainer._step
    pipeline_step = runner.step
    inside: list[float] = []
    outside: list[float] = []

    def timed_pipeline(*args: Any, **kwargs: Any) -> Any:
        t0 = time.thread_time()
        out = pipeline_step(*args, **kwargs)
        inside.append(time.thread_time() - t0)
        return out

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.thread_time()
        out = inner(*args, **kwargs)
        outside.append(time.thread_time() - t0 - inside[-1])
        return out

    runner.step = timed_pipeline
    trainer._step = timed  # type: ignore[method-assign]
    trainer.train()
    params = trainer.engine.params
    return len(params), sum(p.numel() for p in params), outside[warm:]


def measure_step_overhead(quick: bool) -> dict[str, float]:
    """Seconds of a step outside its pipeline on one rank of the real Trainer, per step (``step_overhead``),
    per parameter tensor (``step_tensor``) and per parameter (``step_param``) ([Note: measured step
    overhead] in the cluster cost model): the demo's model at width 8 with 1 and 8 layers (the line
    through their medians against the tensor count; their parameters are negligible), then at width
    128 with 2 layers (what the line leaves, per parameter)."""
    from tests.support.dist import run_on_ranks

    steps, warm = (12, 4) if quick else (30, 6)
    points = []
    for depth, width in ((1, 8), (8, 8), (2, 128)):
        with tempfile.TemporaryDirectory() as tmp:
            tensors, params, times = run_on_ranks(1, _overhead_body, depth, steps, warm, tmp, width)[0]
        points.append((tensors, params, statistics.median(times)))
    (n1, _, t1), (n2, _, t2), (n3, p3, t3) = points
    per_tensor = (t2 - t1) / (n2 - n1)
    fixed = t1 - per_tensor * n1
    per_param = (t3 - fixed - per_tensor * n3) / p3
    if not (per_tensor > 0 and fixed > 0 and per_param > 0):
        raise RuntimeError(
            f"step overhead probe: (tensors, parameters, seconds) {points}: expected a fixed cost, a cost per "
            "tensor and a cost per parameter > 0 (a loaded machine? run it again)"
        )
    return {"step_overhead": fixed, "step_tensor": per_tensor, "step_param": per_param}


def measure_compute() -> dict[str, float]:
    """This core's GEMM FLOP/s, element-wise bytes/s and microseconds per operator (one thread, CPU time)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _cluster_classes import measure_classes
    from bench_cluster_plan import measure_op_overhead_us

    torch.set_num_threads(1)
    op_us = measure_op_overhead_us()
    classes = {f"class_{k}": v for k, v in measure_classes(op_us).items()}
    return {"flops": _measure_flops(), "bandwidth": _measure_bandwidth(), "op_us": op_us, **classes}


def cluster_file(
    rates: list[dict[str, float]], latency: float, link: float, runtime: dict[str, float]
) -> dict[str, Any]:
    """This machine as a cluster file's mapping: the medians of the rounds' compute rates, the link and
    the runtime's own costs (``runtime``: per_action, step_overhead, step_tensor, step_param, in seconds)."""
    flops, bandwidth, op_us = (
        statistics.median(r[k] for r in rates) for k in ("flops", "bandwidth", "op_us")
    )
    classes = {  # [Note: operator class rates]; rates saved before they were measured have none
        k.removeprefix("class_"): round(statistics.median(r[k] for r in rates) / 1e9, 3)
        for k in rates[0]
        if k.startswith("class_")
    }
    out = {
        "name": "cpu-2core-measured",
        "source": (
            f"this machine, measured by bench_cluster_plan.py steps (CPU time, medians of {len(rates)} rounds): "
            f"GEMM {flops / 1e9:.1f} GFLOP/s, add {bandwidth / 1e9:.1f} GB/s, {op_us:.2f} us per op; gloo "
            f"{latency * 1e6:.0f} us per message in a step (contention-corrected) + {link / 1e9:.2f} GB/s; "
            f"{runtime['per_action'] * 1e6:.1f} us per pipeline action (corrected), a step outside its "
            f"pipeline {runtime['step_overhead'] * 1e6:.0f} us + {runtime['step_tensor'] * 1e6:.1f} us per "
            f"parameter tensor + {runtime['step_param'] * 1e9:.2f} ns per parameter (one rank, CPU time)"
        ),
        "devices_per_node": 2,
        "device": {
            "name": "cpu-core",
            "peak_tflops": {"bf16": NOMINAL_PEAK_TFLOPS, "fp32": NOMINAL_PEAK_TFLOPS},
            "memory_gb": 4,
            "memory_bandwidth_gb_s": round(bandwidth / 1e9, 3),
            "op_overhead_us": round(op_us, 3),
            "per_action_us": round(runtime["per_action"] * 1e6, 2),
            "step_overhead_us": round(runtime["step_overhead"] * 1e6, 1),
            "step_tensor_us": round(runtime["step_tensor"] * 1e6, 2),
            "step_param_ns": round(runtime["step_param"] * 1e9, 3),
        },
        "intra_node": {"bandwidth_gb_s": round(link / 1e9, 4), "latency_us": round(latency * 1e6, 2)},
        "efficiency": {
            "compute": round(min(flops / (NOMINAL_PEAK_TFLOPS * 1e12), 1.0), 4),
            "memory": 1.0,
            "link": 1.0,
        },
        "usable_memory_fraction": 0.9,
    }
    if classes:
        out["device"]["op_class_gb_s"] = classes
        out["source"] += ", per operator class (GB/s) " + ", ".join(f"{k} {v}" for k, v in classes.items())
    return out


# ---------------------------------------------------------------------------- training one configuration


def _build_trainer(overrides: list[str], steps: int, out_dir: str) -> Any:
    """The real Trainer of the demo's job with ``overrides``, for ``steps`` steps, no evaluation."""
    from merak_core import Trainer
    from merak_core.autoplan.prepare import prepare_job
    from merak_core.job import JobConfig

    job = JobConfig.from_yaml(
        CONFIG,
        overrides
        + [
            f"training.max_steps={steps}",
            "training.eval_steps=null",
            "training.logging_steps=1000",
            f"training.output_dir={out_dir}",
            "data.kwargs.train_size=4096",
        ],
    )
    train_data, _ = job.build_datasets()
    return Trainer.from_prepared(prepare_job(job, (train_data, None)))


def _train_body(overrides: list[str], steps: int, warm: int, out_dir: str) -> dict[str, Any]:
    """Train the demo for ``steps`` steps; per measured step this rank's (wall, main thread's run and
    queued, all threads' run) seconds, and the logical parameter names of this rank's stage."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.barrier()
    rates = [measure_compute()]  # every rank at once, as they train ([Note: rates of the row's own run])
    trainer = _build_trainer(overrides, steps, out_dir)
    rows: list[tuple[float, ...]] = []
    inner = trainer._step  # what the training loop calls (training_step wraps it and reads the loss)

    def timed(*args: Any, **kwargs: Any) -> Any:
        s0, t0 = sched_ns(), time.perf_counter()
        out = inner(*args, **kwargs)
        wall = time.perf_counter() - t0
        rows.append((wall, *sched_delta(s0, sched_ns())))
        return out

    trainer._step = timed  # type: ignore[method-assign]
    trainer.train()
    names = sorted(set(trainer.model.logical_names.values()))
    dist.barrier()
    rates.append(measure_compute())
    return {"rows": rows[warm:], "names": names, "rates": rates}


def measure(config: StepConfig, steps: int, warm: int) -> dict[str, Any]:
    """Per measured step: the contention-free step time (``free``), the busiest rank's CPU time
    (``cpu``) and the slowest rank's wall time (``wall``); the names of stage 0's parameters."""
    from tests.support.dist import run_on_ranks

    with tempfile.TemporaryDirectory() as tmp:
        per_rank = run_on_ranks(config.world, _train_body, config.overrides(), steps, warm, tmp)
    rates = [x for r in per_rank for x in r["rates"]]
    out: dict[str, Any] = {
        "free": [],
        "cpu": [],
        "wall": [],
        "names": per_rank[0]["names"],
        "rates": {k: statistics.median(x[k] for x in rates) for k in rates[0]},
    }
    for i in range(len(per_rank[0]["rows"])):
        walls, runs, queued, busy = zip(*[r["rows"][i] for r in per_rank], strict=True)
        out["free"].append(corrected(list(walls), list(runs), list(queued)))
        out["cpu"].append(max(busy))
        out["wall"].append(max(walls))
    return out


def load_average() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


# ---------------------------------------------------------------------------- predictions and the report


def _stage_layers(costs: Any, stage0_names: list[str], forward: list[float]) -> list[int]:
    """The cluster chain cut like the Trainer's pp=2 partition: the cut whose first stage holds the
    same parameters as the Trainer's stage 0 (ties: the most balanced forward)."""
    wanted = set(stage0_names)
    best: tuple[int, float, int] | None = None
    for k in range(1, costs.num_layers):
        held = {n for ly in costs.layers[:k] for n in ly.param_names}
        key = (len(held ^ wanted), abs(sum(forward[:k]) - sum(forward[k:])), k)
        best = key if best is None or key < best else best
    assert best is not None
    return [best[2], costs.num_layers - best[2]]


def predict_all(
    cluster: Any, configs: list[StepConfig], stage0_names: list[str] | None
) -> dict[StepConfig, Any]:
    """The cluster model's :class:`ClusterCandidate` for every configuration (the demo, fp32, real weights)."""
    from examples.addition.model import build_model
    from merak_core.config.layout_choice import LayoutChoice
    from merak_core.planner.cluster_cost import model_costs, trace_for_cluster
    from merak_core.planner.cluster_search import predict_config

    torch.manual_seed(0)
    model = build_model(depth=4, width=64, heads=4, vocab_size=13, context=16)
    sharded = trace_for_cluster(model, (torch.randint(0, 13, (1, 16)),), cluster, dtype="fp32")
    costs = model_costs(sharded, model, dtype="fp32")
    forward = [ly.forward_s for ly in costs.layers]
    out = {}
    for c in configs:
        cut = _stage_layers(costs, stage0_names, forward) if c.pp == 2 and stage0_names else None
        out[c] = predict_config(
            costs,
            cluster,
            LayoutChoice(
                dp=c.dp,
                tp=c.tp,
                pp=c.pp,
                schedule=c.schedule,
                num_microbatches=c.num_microbatches,
                micro_batch_size=c.micro_batch_size,
                recompute=c.recompute,
                tp_overlap=c.tp_overlap,
            ),
            stage_layers=cut if c.pp > 1 else None,
        )
    return out


def _ranks(x: list[float]) -> list[float]:
    """Ranks with ties averaged."""
    order = sorted(range(len(x)), key=lambda i: x[i])
    r = [0.0] * len(x)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
            j += 1
        for k in range(i, j + 1):
            r[order[k]] = (i + j) / 2
        i = j + 1
    return r


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (va * vb) if va > 0 and vb > 0 else float("nan")


def _measure_rounds(
    configs: list[StepConfig], rounds: int, steps: int, warm: int
) -> tuple[dict[StepConfig, Any], list[dict[str, float]]]:
    """Every configuration once per round, in an order rotated each round, after this round's
    measurement of the core's compute rates (so the calibration sees the same load as the runs)."""
    got: dict[StepConfig, dict[str, list[Any]]] = {
        c: {"free": [], "cpu": [], "wall": [], "names": [], "rates": []} for c in configs
    }
    rates = []
    for r in range(rounds):
        rates.append(measure_compute())
        shift = r * max(len(configs) // rounds, 1) % len(configs)
        for c in configs[shift:] + configs[:shift]:
            m = measure(c, steps, warm)
            for key in ("free", "cpu", "wall"):
                got[c][key].append(statistics.median(m[key]))
            got[c]["names"] = m["names"]
            got[c]["rates"].append(m["rates"])
            print(
                f"<!-- round {r + 1} {c.label}: {statistics.median(m['free']) * 1e3:.1f} ms -->", flush=True
            )
    return got, rates


def _measure(quick: bool) -> dict[str, Any]:
    """Everything measured: the link, the compute rates, every configuration's step times."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    before = load_average()
    floor, link = _measure_link(quick)
    message = _measure_message(quick)
    # [Note: a message's cost in a step]: the ring formula's 2 (n - 1) latencies at n = 2, less the bytes' time
    latency = max((message - MESSAGE_BYTES / link) / 2, floor)
    print(
        f"<!-- link: fastest trip {floor * 1e6:.0f} us one way; one all-reduce of {MESSAGE_BYTES} B in a step "
        f"{message * 1e6:.0f} us -> latency {latency * 1e6:.0f} us -->",
        flush=True,
    )
    runtime = {"per_action": _measure_per_action(quick), **measure_step_overhead(quick)}
    print(f"<!-- runtime costs (s): {runtime} -->", flush=True)
    configs = _configs(quick)
    rounds, steps, warm = (2, 6, 2) if quick else (3, 10, 3)
    got, rates = _measure_rounds(configs, rounds, steps, warm)
    return {
        "commit": commit.stdout.strip(),
        "load_before": before,
        "load_after": load_average(),
        "cluster": cluster_file(rates, latency, link, runtime),
        "link": {"fastest_trip_latency_s": floor, "message_s": message, "message_bytes": MESSAGE_BYTES},
        "rows": [{"config": dataclasses.asdict(c), **got[c]} for c in configs],
    }


def run(quick: bool, measured: str | None = None, save: str | None = None) -> None:
    """Measure (or read ``measured``, a JSON this function saved), predict, print the table."""
    import json

    import yaml

    from merak_core.planner.cluster import ClusterSpec, load_cluster

    sys.path.insert(0, str(ROOT))
    torch.set_num_threads(1)
    data = json.loads(Path(measured).read_text()) if measured else _measure(quick)
    if save:
        Path(save).write_text(json.dumps(data, indent=1))
    configs = [StepConfig(**row["config"]) for row in data["rows"]]
    got = {c: row for c, row in zip(configs, data["rows"], strict=True)}
    print(
        f"measured at commit {data['commit']}; load before: {data['load_before']}; after: {data['load_after']}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cpu-2core.yaml"
        path.write_text(yaml.safe_dump(data["cluster"], sort_keys=False))
        print(f"\ncluster file:\n```yaml\n{path.read_text()}```\n")
        cluster = load_cluster(path)
    names = next((got[c]["names"] for c in configs if c.pp == 2), None)
    pred = predict_all(cluster, configs, names)
    own = {}  # each row predicted with the compute rates measured on its own ranks around its own runs
    for c in configs:
        if not got[c].get("rates"):
            continue  # saved before the rows measured their own rates
        row_rates = [{k: statistics.median(r[k] for r in got[c]["rates"]) for k in got[c]["rates"][0]}]
        raw = cluster_file(row_rates, 1.0, 1.0, _runtime(data["cluster"]))
        raw = {**data["cluster"], "device": raw["device"], "efficiency": raw["efficiency"]}
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "row.yaml"
            path.write_text(yaml.safe_dump(raw, sort_keys=False))
            own[c] = (predict_all(load_cluster(path), [c], names)[c], row_rates[0])
    print("predicted with this round's rates (the cluster file above):\n")
    _report(configs, got, pred)
    if "op_class_gb_s" in data["cluster"]["device"]:  # the same file without them: the model before
        raw = {**data["cluster"], "device": dict(data["cluster"]["device"])}
        del raw["device"]["op_class_gb_s"]
        print("\nthe same without the operator class rates (every element-wise op at the add's bandwidth):\n")
        _report(configs, got, predict_all(ClusterSpec.from_dict(raw), configs, names))
    if len(own) == len(configs):
        print(
            "\npredicted with the rates measured on each row's own ranks around its runs ([Note: rates of the row's own run]):\n"
        )
        _report(configs, got, {c: own[c][0] for c in configs}, {c: own[c][1] for c in configs})


def _runtime(raw: dict[str, Any]) -> dict[str, float]:
    """The runtime costs (seconds) of a cluster file written by :func:`cluster_file`."""
    dev = raw["device"]
    return {
        "per_action": dev.get("per_action_us", 0.0) / 1e6,
        "step_overhead": dev.get("step_overhead_us", 0.0) / 1e6,
        "step_tensor": dev.get("step_tensor_us", 0.0) / 1e6,
        "step_param": dev.get("step_param_ns", 0.0) / 1e9,
    }


def _report(
    configs: list[StepConfig],
    got: dict[StepConfig, Any],
    pred: dict[StepConfig, Any],
    rates: dict[StepConfig, dict[str, float]] | None = None,
) -> None:
    rate_head = " GEMM GFLOP/s, us per op |" if rates else ""
    print(
        "| layout | schedule | m x mbs | recompute | predicted ms | of which pipeline / DP all-reduce / optimizer "
        f"| measured ms | rounds min-max | busiest rank CPU ms | raw wall ms |{rate_head} error |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|" + ("---|" if rates else "") + "---|")
    errors, p_s, m_s = [], [], []
    for c in configs:
        p = pred[c]
        meas = statistics.median(got[c]["free"])
        err = (p.step_time_s - meas) / meas
        errors.append(abs(err))
        p_s.append(p.step_time_s)
        m_s.append(meas)
        layout = f"dp{c.dp}-tp{c.tp}-pp{c.pp}" + (" tp-overlap" if c.tp_overlap else "")
        print(
            f"| {layout} | {c.schedule} | {c.num_microbatches} x {c.micro_batch_size} | {c.recompute} "
            f"| {p.step_time_s * 1e3:.1f} | {p.pipeline_s * 1e3:.1f} / {p.dp_allreduce_s * 1e3:.1f} / "
            f"{p.optimizer_s * 1e3:.1f} | {meas * 1e3:.1f} | {min(got[c]['free']) * 1e3:.1f}-"
            f"{max(got[c]['free']) * 1e3:.1f} | {statistics.median(got[c]['cpu']) * 1e3:.1f} "
            f"| {statistics.median(got[c]['wall']) * 1e3:.1f} |"
            + (f" {rates[c]['flops'] / 1e9:.0f}, {rates[c]['op_us']:.2f} |" if rates else "")
            + f" {100 * err:+.0f}% |"
        )
    two = [i for i, c in enumerate(configs) if c.world == 2]
    pick = min(two, key=lambda i: p_s[i])
    fastest = min(two, key=lambda i: m_s[i])
    print(
        f"\nmedian |error| {100 * statistics.median(errors):.0f}%, max {100 * max(errors):.0f}%; Spearman "
        f"(predicted vs measured) {spearman(p_s, m_s):.2f} over all rows, "
        f"{spearman([p_s[i] for i in two], [m_s[i] for i in two]):.2f} over the 2-rank rows; the model's pick "
        f"on 2 devices: {configs[pick].label} ({m_s[pick] * 1e3:.1f} ms measured, "
        f"{100 * (m_s[pick] / m_s[fastest] - 1):.0f}% slower than the measured fastest, {configs[fastest].label}, "
        f"{m_s[fastest] * 1e3:.1f} ms)"
    )
