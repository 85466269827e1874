"""Measured shard costs: time each shard's forward and backward on a real device.

``profile_shards(sharded, example_inputs, device=...)`` runs the shard chain on
``device`` with the example inputs, timing each shard's forward and its
backward (gradients of ones for its floating-point outputs), and writes the
median of ``repeats`` runs into ``shard.time_s`` so that a following
``partition_sharded`` balances measured instead of estimated time. Shards are
copied to the device one at a time (a meta shard gets random values), so
profiling needs one shard's memory, not the model's; the model itself is never
touched.

Not done: profiling with the real pipeline's microbatch sizes (pass inputs of
that size), or communication time.
"""

from __future__ import annotations

import copy
import logging
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from merak_graph.empty import is_meta_module, materialize
from merak_graph.sharding import ShardedGraph
from merak_graph.stage import retarget_devices

__all__ = ["profile_shards"]

logger = logging.getLogger(__name__)


def _random_init(module: nn.Module) -> None:
    with torch.no_grad():
        for t in [*module._parameters.values(), *module._buffers.values()]:
            if t is None:
                continue
            if t.is_floating_point():
                t.normal_(0.0, 0.02)
            else:
                t.zero_()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_shards(
    sharded: ShardedGraph,
    example_inputs: Sequence[Any],
    *,
    device: torch.device | str,
    repeats: int = 3,
    warmup: int = 1,
    update: bool = True,
) -> list[float]:
    """Measured forward+backward seconds of every shard (median of ``repeats``); sets ``shard.time_s``."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats={repeats} must be >= 1 and warmup={warmup} >= 0")
    device = torch.device(device)
    values: tuple[Any, ...] = tuple(
        x.to(device) if isinstance(x, torch.Tensor) else x for x in example_inputs
    )
    times: list[float] = []
    for s in sharded.shards:
        module = copy.deepcopy(s.module)
        retarget_devices(module, device)
        if is_meta_module(module):
            materialize(module, device=device, init_fn=_random_init)
        else:
            module.to(device)
        samples = []
        outputs: Any = None
        for step in range(warmup + repeats):
            inputs = tuple(
                v.detach().requires_grad_(v.is_floating_point()) if isinstance(v, torch.Tensor) else v
                for v in values
            )
            _sync(device)
            start = time.perf_counter()
            outputs = module(*inputs)
            flat = outputs if isinstance(outputs, tuple) else (outputs,)
            grads_for = [o for o in flat if isinstance(o, torch.Tensor) and o.requires_grad]
            if grads_for:
                torch.autograd.backward(grads_for, [torch.ones_like(o) for o in grads_for])
            _sync(device)
            if step >= warmup:
                samples.append(time.perf_counter() - start)
            module.zero_grad(set_to_none=True)
        measured = statistics.median(samples)
        times.append(measured)
        if update:
            s.time_s = measured
        flat = outputs if isinstance(outputs, tuple) else (outputs,)
        values = tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in flat)
        del module
    logger.info("profiled %d shards on %s: total %.4g s", len(times), device, sum(times))
    return times
