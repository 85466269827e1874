"""Benchmark: sub-pipelined TP (overlap_chunks = 2, 4) against plain TP (overlap_chunks = 1).

Same block, weights and input, TP = 2 on gloo, one run, the settings taking turns step by
step. Blocks: an MLP region (column -> GELU -> row), an attention region (q/k/v column ->
attention -> o row), and a pre-norm transformer block (LayerNorm + attention region +
LayerNorm + MLP region). Reported: median forward+backward time on rank 0 and the speedup
time(k=1) / time(k) (above 1 = overlap helps).

On a CPU machine the gloo collectives run on threads that compete with the compute for the
same cores, so overlap can hide little; on GPUs (NCCL on its own stream) it is where the
sub-pipelining pays off.

Run::

    OMP_NUM_THREADS=1 PYTHONPATH=packages/merak-tp/src python benchmarks/bench_tp_overlap.py [--quick]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_tp_vs_torch import MLP, PLANS, Attention, launch, time_modes  # noqa: E402


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, max(1, hidden // 64))
        self.ln_2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def _plan(kind: str) -> Any:
    import merak_tp

    if kind == "block":
        layers = {f"attn.{k}": v for k, v in PLANS["attn"].items()}
        layers.update({f"mlp.{k}": v for k, v in PLANS["mlp"].items()})
        return merak_tp.TPPlan(name="bench_block", layers=layers, regions=("attn", "mlp"))
    return merak_tp.TPPlan(name=f"bench_{kind}", layers=PLANS[kind], regions=("",))


def bench(
    configs: list[tuple[str, int, int, int]], chunks: tuple[int, ...], steps: int, warmup: int
) -> list[dict[str, Any]]:
    import merak_tp

    rows = []
    for kind, hidden, batch, seq in configs:
        torch.manual_seed(0)
        ref = {"mlp": MLP, "attn": lambda h: Attention(h, max(1, h // 64)), "block": Block}[kind](hidden)
        modes = {
            f"k={k}": merak_tp.parallelize(
                copy.deepcopy(ref), _plan(kind), group=dist.group.WORLD, overlap_chunks=k
            )
            for k in chunks
        }
        torch.manual_seed(1)
        x = torch.randn(batch, seq, hidden)
        outs = {}
        for name, m in modes.items():
            m(x)  # the probe call: regions check their shape once
            with torch.no_grad():
                outs[name] = m(x)
        diff = max((outs[n] - outs["k=1"]).abs().max().item() for n in outs)
        t = time_modes(modes, x, steps, warmup)
        rows.append({"kind": kind, "hidden": hidden, "tokens": f"{batch}x{seq}", "t": t, "diff": diff})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="hidden 256 only, fewer steps")
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args()
    chunks = (1, 2, 4)
    configs = [("mlp", 256, 8, 64), ("attn", 256, 8, 64), ("block", 256, 8, 64)]
    if not args.quick:
        configs += [("mlp", 1024, 8, 128), ("block", 1024, 8, 128)]
    steps = args.steps or (20 if args.quick else 30)
    rows = launch(2, bench, configs, chunks, steps, 5)
    print(
        f"TP=2 on gloo, {torch.__version__}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, "
        f"median of {steps} steps (forward+backward)"
    )
    head = " | ".join(f"k={k} ms" for k in chunks)
    speed = " | ".join(f"speedup k={k}" for k in chunks[1:])
    print(f"| block | hidden | tokens | {head} | {speed} |")
    print("|---|---|---|" + "---|" * (2 * len(chunks) - 1))
    for r in rows:
        t = r["t"]
        ms = " | ".join(f"{1e3 * t[f'k={k}']:.2f}" for k in chunks)
        sp = " | ".join(f"{t['k=1'] / t[f'k={k}']:.2f}x" for k in chunks[1:])
        print(f"| {r['kind']} | {r['hidden']} | {r['tokens']} | {ms} | {sp} |")
    print(f"max |k - (k=1)| output difference: {max(r['diff'] for r in rows):.2e}")


if __name__ == "__main__":
    sys.exit(main())
