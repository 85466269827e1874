"""Benchmark: merak-tp layers vs torch's own TP (DTensor ``parallelize_module``) on an MLP and an attention block.

Same block, same weights, same input, same gloo ranks (TP = 2), same run. Modes:

- ``merak``: ``ColumnParallelLinear`` -> local compute -> ``RowParallelLinear`` (merak_tp, overlap_chunks=1);
- ``megatron``: a minimal hand-written Megatron block (plain ``F.linear`` + two tiny autograd
  functions for the all-reduces): the floor of what a TP layer kit can cost;
- ``torch``: ``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` on a 1-D CPU DeviceMesh.

Reported: median forward+backward time per step on rank 0 (a barrier before each step; the
modes take turns step by step so that load changes on a shared machine hit them alike), and
the ratio merak / torch (lower is better). A sanity check compares merak's and torch's outputs.

Run::

    OMP_NUM_THREADS=1 PYTHONPATH=packages/merak-tp/src python benchmarks/bench_tp_vs_torch.py [--quick]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

MODES = ("merak", "megatron", "torch")


class MLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.o_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


PLANS = {
    "mlp": {"fc1": "column", "fc2": "row"},
    "attn": {"q_proj": "column", "k_proj": "column", "v_proj": "column", "o_proj": "row"},
}


def build(kind: str, hidden: int) -> nn.Module:
    return MLP(hidden) if kind == "mlp" else Attention(hidden, max(1, hidden // 64))


# --------------------------------------------------------------------------- hand-written Megatron


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        g = g.contiguous()
        dist.all_reduce(g)
        return g


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g


def megatron(kind: str, ref: nn.Module, rank: int, world: int) -> nn.Module:
    """Slice ``ref`` by hand into a minimal Megatron block (no layer classes, no checks)."""
    m = copy.deepcopy(ref)
    with torch.no_grad():
        for name in PLANS[kind]:
            lin = getattr(m, name)
            if PLANS[kind][name] == "column":
                lin.weight = nn.Parameter(lin.weight.chunk(world, 0)[rank].clone())
                lin.bias = nn.Parameter(lin.bias.chunk(world, 0)[rank].clone())
            else:
                lin.weight = nn.Parameter(lin.weight.chunk(world, 1)[rank].clone())
                lin.bias = nn.Parameter(lin.bias / world)

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = m

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # Entry: all-reduce of the input gradient; exit: all-reduce of the row layer's partial output.
            return _Reduce.apply(self.inner(_Copy.apply(x)))

    return Wrapped()


# --------------------------------------------------------------------------- builders


def build_modes(kind: str, hidden: int, chunks: int = 1) -> dict[str, nn.Module]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import merak_tp

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = build(kind, hidden)
    ours = merak_tp.parallelize(
        copy.deepcopy(ref),
        merak_tp.TPPlan(name=f"bench_{kind}", layers=PLANS[kind], regions=("",)),
        group=dist.group.WORLD,
        overlap_chunks=chunks,
    )
    mesh = init_device_mesh("cpu", (world,))
    styles = {n: ColwiseParallel() if s == "column" else RowwiseParallel() for n, s in PLANS[kind].items()}
    theirs = parallelize_module(copy.deepcopy(ref), mesh, styles)
    return {"merak": ours, "megatron": megatron(kind, ref, rank, world), "torch": theirs}


def time_modes(modes: dict[str, nn.Module], x: torch.Tensor, steps: int, warmup: int) -> dict[str, float]:
    times: dict[str, list[float]] = {m: [] for m in modes}
    for step in range(warmup + steps):
        for name, model in modes.items():
            dist.barrier()
            t0 = time.perf_counter()
            xi = x.detach().requires_grad_(True)
            y = model(xi)
            y.sum().backward()
            dt = time.perf_counter() - t0
            if step >= warmup:
                times[name].append(dt)
    return {m: statistics.median(v) for m, v in times.items()}


def _worker(
    rank: int, world: int, store_path: str, fn: Callable[..., Any], args: tuple[Any, ...], out_path: str
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300))
    try:
        result = fn(*args)
        if rank == 0:
            torch.save(result, out_path)
    finally:
        dist.destroy_process_group()


def launch(world: int, fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(*args)`` on ``world`` fresh gloo ranks; return rank 0's result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        mp.start_processes(
            _worker,
            args=(world, os.path.join(tmp, "store"), fn, args, out),
            nprocs=world,
            start_method="fork",
        )
        return torch.load(out, weights_only=False)


def bench(configs: list[tuple[str, int, int, int]], steps: int, warmup: int) -> list[dict[str, Any]]:
    rows = []
    for kind, hidden, batch, seq in configs:
        modes = build_modes(kind, hidden)
        torch.manual_seed(1)
        x = torch.randn(batch, seq, hidden)
        with torch.no_grad():
            diff = (modes["merak"](x) - modes["torch"](x)).abs().max().item()
        t = time_modes(modes, x, steps, warmup)
        rows.append({"kind": kind, "hidden": hidden, "tokens": f"{batch}x{seq}", **t, "diff": diff})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="hidden 256 only, fewer steps")
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args()
    configs = [("mlp", 256, 8, 64), ("attn", 256, 8, 64)]
    if not args.quick:
        configs += [("mlp", 512, 8, 64), ("attn", 512, 8, 64), ("mlp", 1024, 8, 128), ("attn", 1024, 8, 128)]
    steps = args.steps or (20 if args.quick else 40)
    rows = launch(2, bench, configs, steps, 5)
    print(
        f"TP=2 on gloo, {torch.__version__}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, "
        f"median of {steps} steps (forward+backward)"
    )
    print(
        "| block | hidden | tokens | merak ms | hand-written Megatron ms | torch DTensor TP ms "
        "| merak / torch | Megatron / torch |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['kind']} | {r['hidden']} | {r['tokens']} | {1e3 * r['merak']:.2f} | {1e3 * r['megatron']:.2f} "
            f"| {1e3 * r['torch']:.2f} | {r['merak'] / r['torch']:.2f}x | {r['megatron'] / r['torch']:.2f}x |"
        )
    print(f"max |merak - torch| output difference: {max(r['diff'] for r in rows):.2e}")


if __name__ == "__main__":
    sys.exit(main())
