"""Benchmark: interleaved-1F1B (virtual stages, v = 2) against 1F1B, measured in the Trainer, and the simulator.

Same model (the demo's GPT-style decoder, examples/addition/model.py), same initial weights, same
batches, same gloo ranks, same run. Per pipeline size pp in {2, 4} (dp = tp = 1), three Trainers on
every rank: ``schedule=1f1b`` (pp stages), ``schedule=interleaved_1f1b, virtual_stages=2``
(2 * pp stages, round-robin) and ``schedule=zb_v, virtual_stages=2`` (a V). Steps rotate between
them (and which goes first), each after a barrier, so a load change on a shared machine hits both alike; a step's time is the slowest rank's.
The ratios are medians over rounds of the per-round paired ratios against 1F1B.

Simulator (merak_pipe.simulate) columns, from each run's own per-action timings
(``merak_pipe.timing.measured_costs``, every rank gathered): ``sim`` is the schedule simulated on
the costs the same step measured (its error against the measured step); ``pred ratio`` is the
interleaved schedule simulated on the 1F1B run's costs, each stage's forward/backward split in two
halves, over the 1F1B schedule simulated on the same costs: what the simulator predicts before
running interleaved.

Run (forked processes, FileStore rendezvous)::

    OMP_NUM_THREADS=1 python benchmarks/bench_virtual_stages.py [--quick] [--pp 2,4] [--rounds N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _data import Tokens
from _ranks import init_rank, rotated, run_ranks

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "addition"))


def _trainer(cfg: dict[str, Any], pp: int, schedule: str, v: int) -> Any:
    from model import build_model  # type: ignore[import-not-found]

    from merak_core import Trainer
    from merak_core.config import TrainingArguments

    torch.manual_seed(0)
    model = build_model(
        depth=cfg["depth"], width=cfg["width"], heads=4, vocab_size=cfg["vocab"], context=cfg["seq"]
    )
    steps = cfg["rounds"] + cfg["warmup"]
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="merak-benchv-"),
        pp=pp,
        per_device_train_batch_size=cfg["micro_batch"],
        gradient_accumulation_steps=cfg["num_microbatches"],
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        max_steps=steps,
        schedule=schedule,
        virtual_stages=v,
        seed=0,
        logging_steps=10**6,
    )
    data = Tokens(cfg["micro_batch"] * cfg["num_microbatches"] * steps, cfg["vocab"], cfg["seq"])
    return Trainer(model, args, data)


def _sim(trainer: Any, costs: Any) -> float:
    from merak_pipe import simulate

    return simulate(trainer.engine.schedule, costs).makespan


def _halved(costs: Any, pp: int, v: int) -> Any:
    """Per-stage costs of pp * v stages from pp measured stages: each split into v equal parts."""
    import dataclasses

    out = {}
    for name in ("forward", "backward"):
        values = getattr(costs, name)
        per = list(values) if isinstance(values, (list, tuple)) else [values] * pp
        out[name] = [per[s % pp] / v for s in range(pp * v)]
    return dataclasses.replace(
        costs, forward=out["forward"], backward=out["backward"], recompute=out["forward"]
    )


def _worker(rank: int, world: int, store_path: str, cfg: dict[str, Any], queue: Any) -> None:
    init_rank(rank, world, store_path, timeout_s=900)
    from merak_pipe.timing import gather_timings, measured_costs

    modes = {
        "1f1b": _trainer(cfg, world, "1f1b", 1),
        "interleaved": _trainer(cfg, world, "interleaved_1f1b", 2),
        "zb_v": _trainer(cfg, world, "zb_v", 2),
    }
    loaders = {m: iter(t.train_loader) for m, t in modes.items()}
    rows: list[dict[str, float]] = []
    for step in range(cfg["warmup"] + cfg["rounds"]):
        row: dict[str, float] = {}
        for mode in rotated(list(modes), step):  # who goes first changes every round
            trainer = modes[mode]
            batch = next(loaders[mode])
            dist.barrier()
            start = time.perf_counter()
            trainer.training_step(batch.inputs, batch.labels, record_timing=True)
            took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            timings = gather_timings(trainer.last_result.timings or [])
            costs = measured_costs(timings, trainer.engine.schedule)
            row[mode] = float(took)
            row[f"{mode}_pipe"] = max(t.end_s for t in timings) - min(t.start_s for t in timings)
            row[f"{mode}_sim"] = _sim(trainer, costs)
            if mode == "1f1b":
                from merak_pipe import simulate

                row["pred_ratio"] = (
                    simulate(modes["interleaved"].engine.schedule, _halved(costs, world, 2)).makespan
                    / simulate(trainer.engine.schedule, costs).makespan
                )
        if step >= cfg["warmup"]:
            rows.append(row)
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def run(cfg: dict[str, Any], pp: int) -> list[dict[str, float]]:
    rows: list[dict[str, float]] = run_ranks(_worker, pp, cfg, timeout_s=3600)
    return rows


def _median(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model, few rounds")
    parser.add_argument("--pp", default="2,4", help="pipeline sizes (default 2,4)")
    parser.add_argument("--rounds", type=int, default=None, help="measured rounds (default 20; quick 4)")
    args = parser.parse_args(argv)
    cfg: dict[str, Any] = (
        dict(vocab=64, seq=16, width=64, depth=8, micro_batch=2, num_microbatches=8, warmup=1, rounds=4)
        if args.quick
        else dict(
            vocab=256, seq=64, width=128, depth=8, micro_batch=4, num_microbatches=8, warmup=3, rounds=20
        )
    )
    if args.rounds is not None:
        cfg["rounds"] = args.rounds
    print(
        f"torch {torch.__version__}, gloo, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; model: "
        f"{cfg['depth']} layers x width {cfg['width']}, seq {cfg['seq']}, {cfg['num_microbatches']} microbatches "
        f"of {cfg['micro_batch']}; median of {cfg['rounds']} paired rounds after {cfg['warmup']} warm-up"
    )
    print(
        "| pp | 1f1b ms | interleaved v=2 ms | interleaved / 1f1b (paired) | pred ratio (sim on 1f1b costs) "
        "| 1f1b sim error | interleaved sim error | zb_v ms | zb_v / 1f1b (paired) | zb_v sim error |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for pp in (int(x) for x in args.pp.split(",")):
        rows = run(cfg, pp)
        ratio = statistics.median(r["interleaved"] / r["1f1b"] for r in rows)
        err = {
            m: statistics.median(r[f"{m}_sim"] / r[f"{m}_pipe"] - 1 for r in rows)
            for m in ("1f1b", "interleaved", "zb_v")
        }
        zbv = statistics.median(r["zb_v"] / r["1f1b"] for r in rows)
        print(
            f"| {pp} | {_median(rows, '1f1b') * 1e3:.1f} | {_median(rows, 'interleaved') * 1e3:.1f} | {ratio:.3f} | "
            f"{_median(rows, 'pred_ratio'):.3f} | {100 * err['1f1b']:+.1f}% | {100 * err['interleaved']:+.1f}% | "
            f"{_median(rows, 'zb_v') * 1e3:.1f} | {zbv:.3f} | {100 * err['zb_v']:+.1f}% |",
            flush=True,
        )
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
