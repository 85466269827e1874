"""Benchmark: per-rank memory and step time of ZeRO stages 0, 1, 2 and 3 in the Trainer.

Same model (the GPT-style decoder of ``bench_core_3d.py``, untied head), same weights and batches,
same gloo ranks, same run, for each layout (default ``2x2x2`` and ``4x1x2``, dp x tp x pp) and each
ZeRO stage. Per rank it reports, in bytes:

- ``held``: parameters + gradients + optimizer states the rank holds after a step (each storage
  once; a DTensor counts its local shard), from :func:`merak_core.planner.memory_meter.measure_held_bytes`
  (the planner's measurement, so the benchmark and the plan check count the same way);
- ``in step``: for ZeRO-2/3, what FSDP2 holds on top of the shards right before the step's one
  gradient reduce-scatter (gathered parameters, unsharded accumulated gradients), from
  :meth:`merak_core.parallel.fsdp.ShardedDataParallel.unsharded_bytes`;
- ``activations``: the peak of the bytes autograd saves for backward during the step
  (:class:`merak_core.planner.memory_meter.SavedActivationMeter`, saved-tensor hooks);
- ``predicted`` against ``measured`` state at the step's peak: the planner's
  :func:`merak_core.planner.memory.model_state_bytes` for the rank's stage and ZeRO stage, against
  the shards plus the most FSDP2 held gathered during the step (sampled as units run) and the
  unsharded gradients before the reduce-scatter.

Step time: the median of the timed steps per ZeRO stage, and its ratio to ZeRO-1's in the same run.
The ZeRO stages run one after the other (one Trainer alive at a time, so memory stays low), in two
rounds of opposite order, so a change of machine load hits them alike. The target: at dp=4, ZeRO-3's
held bytes per rank <= 0.3x ZeRO-0's.

Run (8 processes, forked, FileStore rendezvous)::

    OMP_NUM_THREADS=1 python benchmarks/bench_core_memory.py [--quick] [--layouts 2,2,2 4,1,2]
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

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ranks import init_rank, machine_line, run_ranks  # noqa: E402
from bench_core_3d import TP_PLAN, Tokens, build_model, lm_loss  # noqa: E402

ZERO_STAGES = (0, 1, 2, 3)


def _trainer(cfg: dict[str, Any], layout: Any, zero_stage: int, data: Any) -> Any:
    from merak_core import Trainer
    from merak_core.config import TrainingArguments

    dp, tp, pp = cfg["layout"]
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="merak-benchmem-"),
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
        zero_stage=zero_stage,
    )
    return Trainer(build_model(cfg), args, data, loss_fn=lm_loss, layout=layout)


def _sharded(trainer: Any) -> Any:
    from merak_core.parallel.fsdp import ShardedDataParallel

    for owner in (trainer, getattr(trainer, "engine", None)):
        sync = getattr(owner, "dp_sync", None) if owner is not None else None
        if isinstance(sync, ShardedDataParallel):
            return sync
    return None


def _measure_stage(cfg: dict[str, Any], layout: Any, zero_stage: int, data: Any) -> dict[str, Any]:
    """One ZeRO stage on this rank: step times, held bytes after a step, in-step and activation peaks,
    and the planner's prediction of the state at the peak."""
    from merak_core.planner.memory_meter import SavedActivationMeter, measure_held_bytes

    trainer = _trainer(cfg, layout, zero_stage, data)
    module = trainer.model.module
    sharded = _sharded(trainer)
    in_step = {"params": 0, "grads": 0, "gathered_peak": 0}

    def sample_gathered() -> None:  # whenever a unit starts its forward or backward reads a saved tensor
        in_step["gathered_peak"] = max(in_step["gathered_peak"], sharded.unsharded_bytes()[0])

    if sharded is not None:
        finish = sharded.finish

        def finish_and_record() -> None:
            params, grads = sharded.unsharded_bytes()
            in_step["params"], in_step["grads"] = max(in_step["params"], params), max(in_step["grads"], grads)
            finish()

        sharded.finish = finish_and_record
    batches = iter(trainer.train_loader)
    times = []
    meter = SavedActivationMeter(
        {layout.pp_rank: module}, on_access=sample_gathered if sharded is not None else None
    )
    for step in range(cfg["warmup"] + cfg["steps"]):
        batch = next(batches)
        dist.barrier()
        start = time.perf_counter()
        if step == 0:
            with meter.measuring():
                trainer.training_step(batch.inputs, batch.labels)
        else:
            trainer.training_step(batch.inputs, batch.labels)
        if step >= cfg["warmup"]:
            times.append(time.perf_counter() - start)
    p_bytes, g_bytes, o_bytes = measure_held_bytes({layout.pp_rank: module}, trainer.optimizer)[
        layout.pp_rank
    ]
    out = {
        "times": times,
        "params": p_bytes,
        "grads": g_bytes,
        "optimizer": o_bytes,
        "in_step_params": in_step["params"],
        "in_step_grads": in_step["grads"],
        "activations": meter.peak[layout.pp_rank],
        "in_step_params_peak": in_step["gathered_peak"],
        "predicted": _predicted_state(module, layout, zero_stage),
    }
    del trainer, module, meter
    gc.collect()
    return out


def _predicted_state(module: Any, layout: Any, zero_stage: int) -> tuple[float, float, float]:
    """The planner's (parameter, gradient, optimizer) bytes at the step's peak for this rank's stage
    (:func:`merak_core.planner.memory.model_state_bytes`), from its unsharded parameter bytes and its
    largest FSDP unit (a DTensor's numel is the whole tensor's)."""
    from merak_core.parallel.fsdp import fsdp_units
    from merak_core.planner.memory import model_state_bytes

    def nbytes(m: Any) -> int:
        return sum(p.numel() * p.element_size() for p in m.parameters())

    return model_state_bytes(
        nbytes(module),
        zero_stage=zero_stage,
        dp=layout.dp,
        largest_unit_bytes=max(nbytes(u) for u in fsdp_units(module)),
        stage_index=layout.pp_rank,
        num_stages=layout.pp,
    )


def _measured_state(r: dict[str, Any]) -> tuple[float, float, float]:
    """What the prediction counts, measured: shards plus the most gathered during the step, the
    unsharded gradients before the reduce-scatter (or the held ones), the optimizer states."""
    return (
        r["params"] + r["in_step_params_peak"],
        max(r["grads"], r["in_step_grads"]),
        r["optimizer"],
    )


def _worker(rank: int, world: int, store_path: str, cfg: dict[str, Any], queue: Any) -> None:
    init_rank(rank, world, store_path, timeout_s=1800)
    from merak_core import ParallelLayout

    dp, tp, pp = cfg["layout"]
    layout = ParallelLayout.build(dp=dp, tp=tp, pp=pp)
    mbs, micro = cfg["micro_batch"], cfg["num_microbatches"]
    data = Tokens(dp * mbs * micro * (cfg["warmup"] + cfg["steps"]) * 2, cfg["vocab"], cfg["seq"])
    results: dict[int, dict[str, Any]] = {}
    for order in (ZERO_STAGES, tuple(reversed(ZERO_STAGES))):
        for zero_stage in order:
            res = _measure_stage(cfg, layout, zero_stage, data)
            if zero_stage in results:
                results[zero_stage]["times"] += res["times"]
            else:
                results[zero_stage] = res
    gathered: list[Any] = [None] * world
    dist.all_gather_object(
        gathered,
        {
            "coords": (layout.pp_rank, layout.dp_rank, layout.tp_rank),
            **{
                z: {k: v for k, v in r.items() if k != "times"} | {"time": statistics.median(r["times"])}
                for z, r in results.items()
            },
        },
    )
    if rank == 0:
        queue.put(gathered)
    dist.barrier()
    dist.destroy_process_group()


def run(cfg: dict[str, Any]) -> list[dict[Any, Any]]:
    world = cfg["layout"][0] * cfg["layout"][1] * cfg["layout"][2]
    out: list[dict[Any, Any]] = run_ranks(_worker, world, cfg, timeout_s=7200)
    return out


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def report(cfg: dict[str, Any], ranks: list[dict[Any, Any]]) -> None:
    dp, tp, pp = cfg["layout"]
    print(f"\n### layout {dp}x{tp}x{pp} (dp x tp x pp), MiB per rank\n")
    print(
        "| ZeRO | rank (pp,dp,tp) | params | grads | optimizer | held | in-step gathered params | in-step "
        "unsharded grads | activation peak | ms/step | step time / ZeRO-1 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for z in ZERO_STAGES:
        for rank in ranks:
            r = rank[z]
            held = r["params"] + r["grads"] + r["optimizer"]
            print(
                f"| {z} | {rank['coords']} | {_mib(r['params'])} | {_mib(r['grads'])} | {_mib(r['optimizer'])} | "
                f"{_mib(held)} | {_mib(r['in_step_params'])} | {_mib(r['in_step_grads'])} | "
                f"{_mib(r['activations'])} | {r['time'] * 1e3:.0f} | {r['time'] / rank[1]['time']:.2f} |"
            )
    print(
        "\n| ZeRO | max held over ranks, MiB | held / ZeRO-0 (max over ranks) | median step time / ZeRO-1 |"
    )
    print("|---|---|---|---|")
    for z in ZERO_STAGES:
        held = [rank[z]["params"] + rank[z]["grads"] + rank[z]["optimizer"] for rank in ranks]
        base = [rank[0]["params"] + rank[0]["grads"] + rank[0]["optimizer"] for rank in ranks]
        ratio = max(h / b for h, b in zip(held, base, strict=True))
        times = statistics.median(rank[z]["time"] / rank[1]["time"] for rank in ranks)
        print(f"| {z} | {_mib(max(held))} | {ratio:.3f} | {times:.2f} |", flush=True)
    print(
        "\nState at the step's peak, predicted (merak_core.planner.memory.model_state_bytes) against "
        "measured (shards + most gathered during the step, unsharded gradients before the reduce-scatter), "
        "MiB params/grads/optimizer:\n"
    )
    print("| ZeRO | rank (pp,dp,tp) | predicted | measured | error of the sum |")
    print("|---|---|---|---|---|")
    for z in ZERO_STAGES:
        for rank in ranks:
            pred, meas = rank[z]["predicted"], _measured_state(rank[z])
            err = (sum(pred) - sum(meas)) / sum(meas)
            print(
                f"| {z} | {rank['coords']} | {'/'.join(_mib(x) for x in pred)} | "
                f"{'/'.join(_mib(x) for x in meas)} | {100 * err:+.1f}% |",
                flush=True,
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model, few steps")
    parser.add_argument("--layouts", nargs="+", default=["2,2,2", "4,1,2"], help="dp,tp,pp per layout")
    args = parser.parse_args(argv)
    cfg: dict[str, Any] = (
        dict(
            vocab=512,
            seq=16,
            width=64,
            depth=4,
            heads=4,
            micro_batch=2,
            num_microbatches=2,
            warmup=1,
            steps=2,
        )
        if args.quick
        else dict(
            vocab=16384,
            seq=32,
            width=512,
            depth=12,
            heads=8,
            micro_batch=2,
            num_microbatches=2,
            warmup=1,
            steps=2,
        )
    )
    numel = sum(p.numel() for p in build_model(cfg).parameters())
    print(f"{machine_line()}, load average {os.getloadavg()[0]:.1f}")
    print(
        f"model: GPT {cfg['depth']} layers x width {cfg['width']}, vocab {cfg['vocab']}, seq {cfg['seq']}, "
        f"{numel / 1e6:.1f}M parameters (float32), AdamW; {cfg['num_microbatches']} microbatches of "
        f"{cfg['micro_batch']}, 1F1B; median of {2 * cfg['steps']} steps per ZeRO stage"
    )
    for text in args.layouts:
        layout = tuple(int(x) for x in text.split(","))
        if len(layout) != 3:
            parser.error(f"a layout is dp,tp,pp, got {text!r}")
        cfg["layout"] = layout
        report(cfg, run(cfg))
    print(f"\nload average at the end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
