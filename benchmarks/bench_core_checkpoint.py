"""Benchmark: DCP checkpoint save/load of the demo model at dp=2 tp=2 pp=2 vs torch.save of one device's state.

The demo job (``examples/addition/config.yaml``, optionally wider) is trained for one
step on 8 gloo ranks (so AdamW states exist), then ``trainer.checkpoints.save()`` and
``trainer.checkpoints.load()`` are timed ``--repeats`` times (wall time of the slowest
rank, each call between barriers). The baseline, measured in the same run in one
process: the same model unsharded with a plain AdamW after one step, ``torch.save``
of ``{"model": state_dict, "optimizer": state_dict}`` and ``torch.load`` of it.
Sizes are the bytes on disk.

Run::

    OMP_NUM_THREADS=1 PYTHONPATH=packages/merak-pipe/src:packages/merak-graph/src:packages/merak-tp/src:\\
packages/merak-core/src python benchmarks/bench_core_checkpoint.py [--quick] [--width 256]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "addition" / "config.yaml"


def _job(out_dir: str, width: int, depth: int) -> Any:
    from merak_core.job import JobConfig

    overrides = [
        f"training.output_dir={out_dir}",
        "training.max_steps=1",
        "training.eval_steps=null",
        f"model.kwargs.width={width}",
        f"model.kwargs.depth={depth}",
        "data.kwargs.train_size=512",
        "data.kwargs.eval_size=64",
        "training.logging_steps=1000",
    ]
    return JobConfig.from_yaml(CONFIG, overrides)


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _worker(rank: int, world: int, store_path: str, cfg: dict[str, Any], queue: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    from merak_core import Trainer
    from merak_core.autoplan.prepare import prepare_job

    job = _job(cfg["out"], cfg["width"], cfg["depth"])
    train, _ = job.build_datasets()
    trainer = Trainer.from_prepared(prepare_job(job, (train, None)))
    trainer.train()
    saves, loads = [], []
    path = None
    for _ in range(cfg["repeats"]):
        dist.barrier()
        start = time.perf_counter()
        path = trainer.checkpoints.save()
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        saves.append(float(elapsed))
        dist.barrier()
        start = time.perf_counter()
        trainer.checkpoints.load(path)
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        loads.append(float(elapsed))
    if rank == 0:
        assert path is not None
        files = [f for f in path.iterdir() if f.is_file()]
        queue.put(
            {
                "save": saves,
                "load": loads,
                "bytes": _dir_bytes(path),
                "files": len(files),
                "params": sum(t.numel() for t in (trainer.full_state_dict() or {}).values()),
            }
        )
    else:
        trainer.full_state_dict()
    dist.barrier()
    dist.destroy_process_group()


def _baseline(cfg: dict[str, Any], out_dir: str) -> dict[str, Any]:
    job = _job(out_dir, cfg["width"], cfg["depth"])
    targs = job.training
    torch.manual_seed(targs.seed)
    model = job.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=targs.learning_rate, foreach=False)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    path = Path(out_dir) / "single.pt"
    saves, loads = [], []
    for _ in range(cfg["repeats"]):
        start = time.perf_counter()
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
        saves.append(time.perf_counter() - start)
        start = time.perf_counter()
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        loads.append(time.perf_counter() - start)
    return {
        "save": saves,
        "load": loads,
        "bytes": path.stat().st_size,
        "params": sum(p.numel() for p in model.parameters()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 repeats instead of 10")
    parser.add_argument("--width", type=int, default=64, help="model width (the demo: 64)")
    parser.add_argument("--depth", type=int, default=4, help="model depth (the demo: 4)")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    out = tempfile.mkdtemp(prefix="merak-bench-ckpt-")
    cfg = {"out": out, "width": args.width, "depth": args.depth, "repeats": 3 if args.quick else 10}
    try:
        base = _baseline(cfg, out)
        world = 8
        ctx = mp.get_context("fork")
        queue = ctx.Queue()
        store = os.path.join(out, "store")
        procs = [ctx.Process(target=_worker, args=(r, world, store, cfg, queue)) for r in range(world)]
        for p in procs:
            p.start()
        dcp_result = queue.get(timeout=600)
        for p in procs:
            p.join(timeout=60)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    rows = [("torch.save, 1 process (baseline)", base), ("DCP, dp=2 tp=2 pp=2, 8 ranks", dcp_result)]
    print(
        f"model: addition demo, width {args.width}, depth {args.depth}, {base['params']:,} parameters "
        f"(float32), AdamW state; median of {cfg['repeats']} repeats"
    )
    print(f"{'checkpoint':<36} {'save ms':>9} {'load ms':>9} {'size KiB':>10} {'save x':>7} {'load x':>7}")
    for label, r in rows:
        save, load = statistics.median(r["save"]), statistics.median(r["load"])
        print(
            f"{label:<36} {save * 1e3:9.1f} {load * 1e3:9.1f} {r['bytes'] / 1024:10.1f} "
            f"{save / statistics.median(base['save']):7.2f} {load / statistics.median(base['load']):7.2f}"
        )
    print(
        f"DCP files per checkpoint: {dcp_result['files']} (one per rank that wrote, .metadata, "
        "merak_checkpoint.json)"
    )


if __name__ == "__main__":
    main()
