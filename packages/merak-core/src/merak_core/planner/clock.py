"""Clocks for the planner's measurements: host seconds after the device's queued work, timed calls.

[Note: device clocks] On CUDA a kernel launch returns before the kernel runs, so every time
taken here reads the host clock after ``torch.cuda.synchronize`` (:func:`now`); per-layer hooks
synchronise too, which serialises the profiled run but makes each layer's time its own.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["device_of", "forward_backward", "now", "step_seconds", "timed"]


def now(device: torch.device | None = None) -> float:
    """Host seconds, after the device's queued work is done on CUDA (a kernel launch returns at once)."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def timed(fn: Any, repeats: int, device: torch.device | None = None) -> float:
    """Mean seconds of ``fn()`` over ``repeats`` calls after a warm-up (synchronised on CUDA)."""
    fn()  # warm-up
    t0 = now(device)
    for _ in range(repeats):
        fn()
    return (now(device) - t0) / repeats


def device_of(sample: torch.Tensor | Mapping[str, torch.Tensor]) -> torch.device:
    first = sample if isinstance(sample, torch.Tensor) else next(iter(sample.values()))
    return first.device


def forward_backward(model: nn.Module, sample: torch.Tensor | Mapping[str, torch.Tensor]) -> None:
    """One forward and backward of ``model(sample)`` (the first tensor of a dict / ModelOutput)."""
    model.zero_grad(set_to_none=True)
    y = model(sample) if isinstance(sample, torch.Tensor) else model(**sample)
    if not isinstance(y, torch.Tensor):
        y = next(v for v in y.values() if isinstance(v, torch.Tensor))
    y.float().sum().backward()


def step_seconds(model: nn.Module, sample: torch.Tensor | Mapping[str, torch.Tensor], repeats: int) -> float:
    return timed(lambda: forward_backward(model, sample), repeats, device_of(sample))
