"""Benchmark: DP gradient sync — bucketed + overlapped vs per-parameter blocking vs torch DDP.

Same model, same data, same gloo ranks, same run: each training step is
``num_microbatches`` forward+backward passes with gradient accumulation, then the
DP gradient average. Modes:

- ``no_sync``: compute only (no communication), the floor;
- ``per_param``: one blocking all-reduce per parameter after the last backward;
- ``bucketed``: merak ``DataParallelGradSync.sync()`` after the last backward (blocking);
- ``overlapped``: merak ``DataParallelGradSync`` armed on the last microbatch (overlapped);
- ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` (``no_sync`` for all but the last microbatch).

Reported: median step time (rank 0, after a barrier per step; the modes take turns step by
step in a rotating order, so load changes on a shared machine hit them alike) and the ratio to DDP measured in the
same run; also the largest gradient difference between merak's
overlapped sync and DDP (a sanity check, not a test).

Run::

    OMP_NUM_THREADS=1 PYTHONPATH=packages/merak-core/src python benchmarks/bench_core_dp.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from _ranks import init_rank, machine_line, rotated, run_ranks
from torch import nn

MODES = ("no_sync", "per_param", "bucketed", "overlapped", "ddp")


def _model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width)]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def _worker(rank: int, world: int, store_path: str, cfg: dict[str, Any], queue: Any) -> None:
    from merak_core.parallel.data_parallel import DataParallelGradSync, allreduce_gradients_per_parameter

    init_rank(rank, world, store_path, timeout_s=300)
    bucket_bytes = int(cfg["bucket_mb"] * 2**20)
    micro = cfg["num_microbatches"]
    g = torch.Generator().manual_seed(100 + rank)
    data = [torch.randn(cfg["batch"], cfg["width"], generator=g) for _ in range(micro)]
    # One model (+ sync) per mode, stepped round-robin so that load changes on a shared
    # machine hit every mode alike.
    models: dict[str, nn.Module] = {}
    runners: dict[str, nn.Module] = {}
    syncs: dict[str, DataParallelGradSync] = {}
    for mode in MODES:
        models[mode] = _model(cfg["width"], cfg["depth"])
        runners[mode] = models[mode]
        if mode == "ddp":
            runners[mode] = nn.parallel.DistributedDataParallel(models[mode], bucket_cap_mb=cfg["bucket_mb"])
        elif mode in ("bucketed", "overlapped"):
            syncs[mode] = DataParallelGradSync(models[mode], None, bucket_size_bytes=bucket_bytes)
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for step in range(cfg["warmup"] + cfg["steps"]):
        for mode in rotated(MODES, step):  # no position bias
            model, runner, sync = models[mode], runners[mode], syncs.get(mode)
            model.zero_grad(set_to_none=True)
            dist.barrier()
            start = time.perf_counter()
            for i, x in enumerate(data):
                last = i == micro - 1
                loss = runner(x).pow(2).mean() / micro
                if mode == "ddp" and not last:
                    with runner.no_sync():  # type: ignore[operator]
                        loss.backward()
                elif mode == "overlapped" and last:
                    assert sync is not None
                    with sync.sync_on_this_backward():
                        loss.backward()
                else:
                    loss.backward()
            if mode == "per_param":
                allreduce_gradients_per_parameter(model.parameters())
            elif mode == "bucketed":
                assert sync is not None
                sync.sync()
            elapsed = time.perf_counter() - start
            if step >= cfg["warmup"]:
                times[mode].append(elapsed)
    results = {mode: statistics.median(t) for mode, t in times.items()}
    final_grads = {mode: [p.grad.detach().clone() for p in models[mode].parameters()] for mode in MODES}
    for sync in syncs.values():
        sync.remove_hooks()
    diff = max(
        (a - b).abs().max().item() for a, b in zip(final_grads["overlapped"], final_grads["ddp"], strict=True)
    )
    if rank == 0:
        numel = sum(p.numel() for p in _model(cfg["width"], cfg["depth"]).parameters())
        queue.put({"world": world, "times": results, "diff": diff, "numel": numel})
    dist.barrier()
    dist.destroy_process_group()


def run(world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = run_ranks(_worker, world, cfg, timeout_s=1800, join_s=60)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model, few steps, 2 ranks only")
    parser.add_argument("--worlds", default=None, help="comma-separated world sizes (default 2,4; quick: 2)")
    parser.add_argument(
        "--steps", type=int, default=None, help="measured steps per mode (default 30; quick: 5)"
    )
    args = parser.parse_args(argv)
    cfg = (
        dict(width=256, depth=4, batch=16, num_microbatches=2, bucket_mb=0.25, warmup=2, steps=5)
        if args.quick
        else dict(width=512, depth=8, batch=32, num_microbatches=2, bucket_mb=1.0, warmup=3, steps=30)
    )
    if args.steps is not None:
        cfg["steps"] = args.steps
    worlds = [int(w) for w in (args.worlds or ("2" if args.quick else "2,4")).split(",")]
    print(machine_line())
    print(
        f"model: {cfg['depth']} x (Linear {cfg['width']} + GELU + LayerNorm), batch {cfg['batch']} per microbatch, "
        f"{cfg['num_microbatches']} microbatches, bucket {cfg['bucket_mb']} MiB (ours and DDP), "
        f"median of {cfg['steps']} steps after {cfg['warmup']} warm-up"
    )
    print()
    print(
        f"| ranks | params | {' | '.join(f'{m} ms' for m in MODES)} | overlapped/ddp | per_param/ddp | "
        "bucketed/ddp | max |grad diff| vs DDP |"
    )
    print("|" + "---|" * (len(MODES) + 6))
    for world in worlds:
        res = run(world, cfg)
        t = res["times"]
        row = " | ".join(f"{t[m] * 1e3:.1f}" for m in MODES)
        print(
            f"| {world} | {res['numel'] / 1e6:.2f}M | {row} | {t['overlapped'] / t['ddp']:.2f} | "
            f"{t['per_param'] / t['ddp']:.2f} | {t['bucketed'] / t['ddp']:.2f} | {res['diff']:.1e} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
