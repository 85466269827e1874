"""Benchmark: LoRA (r=8 on every linear of the blocks) against full fine-tuning, in the Trainer, same run.

Same model (bench_core_3d's GPT-style decoder, ~100M parameters by default, built here: no
download), same initial weights, same batches, same gloo ranks. Per layout (dp x tp x pp, default
2x1x2 and 1x2x2), two Trainers live on every rank: ``full`` trains every weight, ``lora`` trains
adapters of rank 8 on query/key/value/out/up/down of every block (``merak_core.LoraConfig``; the
head, embeddings and norms frozen). Both use AdamW, 1F1B, ZeRO-0 and gradient clipping.

Paired rounds: each round steps both Trainers once, after a barrier each, in an order that
alternates between rounds, so load changes on a shared machine hit both alike; a step's time is the
slowest rank's. Reported per layout: the gradient + optimizer-state bytes every rank holds after a
step (:func:`merak_core.planner.memory_meter.measure_held_bytes`) for both and their ratio (target <= 5%),
the memory model's prediction of the same bytes for the LoRA job
(:func:`merak_core.planner.memory.model_state_bytes` with the rank's trainable bytes), and the
median step times and the median over rounds of the paired ratio lora / full (target <= 0.8).

Run (4 processes, forked, FileStore rendezvous)::

    OMP_NUM_THREADS=1 python benchmarks/bench_lora.py [--quick] [--rounds N] [--layouts 2,1,2 1,2,2]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ranks import init_rank, machine_line, rotated, run_ranks  # noqa: E402
from bench_core_3d import TP_PLAN, Tokens, build_model, lm_loss  # noqa: E402

MODES = ("full", "lora")
TARGETS = ["query", "key", "value", "out", "up", "down"]


def _trainer(cfg: dict[str, Any], layout: Any, mode: str, data: Any) -> Any:
    from merak_core import LoraConfig, Trainer
    from merak_core.config import TrainingArguments

    dp, tp, pp = cfg["layout"]
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="merak-benchlora-"),
        dp=dp,
        tp=tp,
        pp=pp,
        per_device_train_batch_size=cfg["micro_batch"],
        gradient_accumulation_steps=cfg["num_microbatches"],
        learning_rate=1e-4,
        lr_scheduler_type="constant",
        weight_decay=0.01,
        max_grad_norm=1.0,
        max_steps=1000,
        schedule="1f1b",
        tp_plan=TP_PLAN if tp > 1 else None,
        seed=0,
        logging_steps=1000,
    )
    lora = LoraConfig(r=cfg["r"], alpha=2 * cfg["r"], target_modules=TARGETS) if mode == "lora" else None
    return Trainer(build_model(cfg), args, data, loss_fn=lm_loss, layout=layout, lora=lora)


def _state(trainer: Any, layout: Any) -> dict[str, float]:
    """Bytes this rank holds for its stage after a step, and the memory model's gradient + optimizer bytes."""
    from merak_core.planner.memory import model_state_bytes
    from merak_core.planner.memory_meter import measure_held_bytes

    module = trainer.model.module
    params, grads, optimizer = measure_held_bytes({layout.pp_rank: module}, trainer.optimizer)[layout.pp_rank]
    local = sum(p.numel() * p.element_size() for p in module.parameters())
    trainable = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    _, pred_grads, pred_optimizer = model_state_bytes(
        local, zero_stage=0, dp=layout.dp, trainable_bytes=trainable
    )
    return {
        "params": params,
        "grads": grads,
        "optimizer": optimizer,
        "predicted": pred_grads + pred_optimizer,
        "trainable": trainable,
    }


def _worker(rank: int, world: int, store_path: str, cfg: dict[str, Any], queue: Any) -> None:
    init_rank(rank, world, store_path, timeout_s=3600)
    from merak_core import ParallelLayout

    dp, tp, pp = cfg["layout"]
    layout = ParallelLayout.build(dp=dp, tp=tp, pp=pp)
    steps = cfg["warmup"] + cfg["rounds"]
    data = Tokens(dp * cfg["micro_batch"] * cfg["num_microbatches"] * steps, cfg["vocab"], cfg["seq"])
    trainers = {mode: _trainer(cfg, layout, mode, data) for mode in MODES}
    loaders = {mode: iter(t.train_loader) for mode, t in trainers.items()}
    rounds: list[dict[str, float]] = []
    for step in range(steps):
        row: dict[str, float] = {}
        for mode in rotated(MODES, step):  # who goes first alternates
            batch = next(loaders[mode])
            dist.barrier()
            start = time.perf_counter()
            trainers[mode].training_step(batch.inputs, batch.labels)
            took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            row[mode] = float(took)
        if step >= cfg["warmup"]:
            rounds.append(row)
    states = {mode: _state(t, layout) for mode, t in trainers.items()}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {"coords": (layout.pp_rank, layout.dp_rank, layout.tp_rank), **states})
    if rank == 0:
        queue.put({"rounds": rounds, "ranks": gathered})
    del trainers, loaders
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def report(cfg: dict[str, Any], out: dict[str, Any]) -> None:
    dp, tp, pp = cfg["layout"]
    print(f"\n### layout {dp}x{tp}x{pp} (dp x tp x pp)\n")
    print(
        "| rank (pp,dp,tp) | full: grads + optimizer MiB | lora: grads + optimizer MiB | lora / full | "
        "lora predicted MiB | params MiB (lora run) |"
    )
    print("|---|---|---|---|---|---|")
    ratios = []
    for r in out["ranks"]:
        full = r["full"]["grads"] + r["full"]["optimizer"]
        lora = r["lora"]["grads"] + r["lora"]["optimizer"]
        ratios.append(lora / full)
        print(
            f"| {r['coords']} | {_mib(full)} | {_mib(lora)} | {100 * lora / full:.2f}% | "
            f"{_mib(r['lora']['predicted'])} | {_mib(r['lora']['params'])} |"
        )
    rounds = out["rounds"]
    t_full = statistics.median(x["full"] for x in rounds)
    t_lora = statistics.median(x["lora"] for x in rounds)
    paired = statistics.median(x["lora"] / x["full"] for x in rounds)
    print(
        f"\nlargest lora / full gradient + optimizer bytes over ranks: {100 * max(ratios):.2f}% (target <= 5%)"
    )
    print(
        f"step time, median of {len(rounds)} paired rounds: full {t_full:.2f} s, lora {t_lora:.2f} s, "
        f"median paired lora / full {paired:.2f} (target <= 0.8); per round: "
        + ", ".join(f"{x['lora'] / x['full']:.2f}" for x in rounds),
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small model, to check the benchmark runs")
    parser.add_argument("--rounds", type=int, default=None, help="measured paired rounds (default 3)")
    parser.add_argument("--layouts", nargs="+", default=["2,1,2", "1,2,2"], help="dp,tp,pp per layout")
    args = parser.parse_args(argv)
    cfg: dict[str, Any] = (
        dict(vocab=512, seq=16, width=64, depth=4, heads=4)
        if args.quick
        else dict(vocab=8192, seq=64, width=768, depth=12, heads=12)
    )
    cfg.update(r=8, micro_batch=1, num_microbatches=2, warmup=1, rounds=args.rounds or 3)
    numel = sum(p.numel() for p in build_model(cfg).parameters())
    print(f"{machine_line()}, load average {os.getloadavg()[0]:.1f}")
    print(
        f"model: GPT {cfg['depth']} layers x width {cfg['width']}, vocab {cfg['vocab']}, seq {cfg['seq']}, "
        f"{numel / 1e6:.1f}M parameters (float32), AdamW, ZeRO-0; {cfg['num_microbatches']} microbatches of "
        f"{cfg['micro_batch']}, 1F1B; LoRA r={cfg['r']} alpha={2 * cfg['r']} on {', '.join(TARGETS)}; "
        f"{cfg['warmup']} warm-up round, {cfg['rounds']} measured"
    )
    for text in args.layouts:
        layout = tuple(int(x) for x in text.split(","))
        if len(layout) != 3:
            parser.error(f"a layout is dp,tp,pp, got {text!r}")
        cfg["layout"] = layout
        world = layout[0] * layout[1] * layout[2]
        report(cfg, run_ranks(_worker, world, cfg, timeout_s=7200))
    print(f"\nload average at the end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
