"""Per-operator-class rates for ``bench_cluster_plan.py steps`` ([Note: operator class rates] in
``merak_core.planner.cluster_classes``): each class's forward and backward on a tensor of the demo's
shapes at micro batch 16, one thread, CPU time.

A rate is the bytes merak-graph's roofline counts for the node (inputs + outputs + parameters) x 3
(forward and a backward twice as costly, as the model prices every node) over the measured forward +
backward time less the model's fixed per-operator charge for that node (3 x ``op_us``: the model adds it
on top). So at the probed shape the model prices one operator of the class at its measured time.

Run alone (``python benchmarks/_cluster_classes.py``) it prints, per class, the measured forward +
backward time beside what the cluster model charged for it with the add's bandwidth: the cause of the
under-prediction of the demo's step, shown in one run.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
_TOKENS, _WIDTH, _HEADS = (16, 16), 64, 4
"""The demo at micro batch 16: 16 sequences of 16 tokens, width 64, 4 heads of 16."""


def _cases() -> dict[str, tuple[Callable[[], torch.Tensor], float]]:
    """Class -> (one forward of an operator of the class at the demo's shapes, its counted bytes)."""
    b, t = _TOKENS
    x = torch.randn(b, t, _WIDTH, requires_grad=True)
    h = torch.randn(b, t, 4 * _WIDTH, requires_grad=True)
    s = torch.randn(b, _HEADS, t, t, requires_grad=True)
    q, k, v = (torch.randn(b, _HEADS, t, _WIDTH // _HEADS, requires_grad=True) for _ in range(3))
    norm = torch.nn.LayerNorm(_WIDTH)
    return {
        "activation": (lambda: F.gelu(h), 2 * h.nbytes),
        "norm": (lambda: norm(x), 2 * x.nbytes + 2 * _WIDTH * 4),
        "softmax": (lambda: torch.softmax(s, dim=-1), 2 * s.nbytes),
        "attention": (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), 4 * q.nbytes),
    }


def _controls() -> dict[str, tuple[Callable[[], torch.Tensor], float]]:
    """The demo's GEMM (a linear 64 -> 256) and its residual add, which the model prices without a class."""
    b, t = _TOKENS
    x, y = (torch.randn(b, t, _WIDTH, requires_grad=True) for _ in range(2))
    up = torch.nn.Linear(_WIDTH, 4 * _WIDTH)
    return {
        "GEMM (no class)": (lambda: up(x), x.nbytes + 4 * x.nbytes + up.weight.nbytes + up.bias.nbytes),
        "add (no class)": (lambda: x + y, 3 * x.nbytes),
    }


def _forward_backward_s(forward: Callable[[], torch.Tensor], reps: int = 50) -> float:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_cluster_plan import thread_median_s

    def run() -> None:
        for _ in range(reps):
            out = forward()
            out.backward(torch.ones_like(out))

    return thread_median_s(run, 5) / reps


def measure_classes(op_us: float) -> dict[str, float]:
    """Bytes/s per operator class, ``op_us`` (the measured per-operator cost) taken out."""
    out = {}
    for cls, (forward, nbytes) in _cases().items():
        seconds = max(_forward_backward_s(forward) - 3 * op_us * 1e-6, 1e-9)
        out[cls] = 3 * nbytes / seconds
    return out


def main() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _cluster_steps import load_average, measure_compute

    torch.set_num_threads(1)
    print(load_average())
    rates = measure_compute()
    print(
        f"GEMM {rates['flops'] / 1e9:.1f} GFLOP/s, add {rates['bandwidth'] / 1e9:.1f} GB/s, "
        f"{rates['op_us']:.2f} us per op\n"
    )
    print(
        "| class | counted bytes | measured F+B us | priced by the roofline (GEMM rate, add's bandwidth) us | ratio |"
    )
    print("|---|---|---|---|---|")
    from torch.utils.flop_counter import FlopCounterMode

    for cls, (forward, nbytes) in {**_controls(), **_cases()}.items():
        measured = _forward_backward_s(forward)
        with FlopCounterMode(display=False) as counter:
            forward()
        roofline = max(counter.get_total_flops() / rates["flops"], nbytes / rates["bandwidth"])
        model = 3 * roofline + 3 * rates["op_us"] * 1e-6
        print(f"| {cls} | {nbytes:.0f} | {measured * 1e6:.1f} | {model * 1e6:.1f} | {measured / model:.2f} |")
    print(load_average())


if __name__ == "__main__":
    main()
