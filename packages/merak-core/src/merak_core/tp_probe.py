"""Probe the real TP-sharded model: how much slower its layers run than the planner's model says.

The planner models a TP shard as the layer's compute divided by tp plus two all-reduces per layer
and direction. On small layers (and on CPU ranks sharing cores) a shard is slower than that: the
operators' fixed costs do not shrink with tp, and an all-reduce waits for peers that are not
running. :func:`measure_tp_scale` (collective) measures the factor for every TP degree the world
allows: it trains the job's model for a few steps in the pure DP x TP layout ``(world / k, k, 1)``
with one microbatch of ``per_device_train_batch_size`` samples, takes the median pipeline time of a
step (the slowest rank's) and divides it by the planner's prediction for that configuration. The
factors go into :attr:`merak_core.planner.ModelProfile.tp_scale`, which scales the layers' time at
that degree in every layout the planner considers (with pipeline stages too).

The probe trains a copy of the model (or what the model function builds) and leaves the caller's
random stream as it was; it writes nothing outside a temporary folder.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import statistics
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from merak_core.config import TrainingArguments
from merak_core.planner import CommModel, ModelProfile, predict

logger = logging.getLogger(__name__)

__all__ = ["measure_tp_scale"]


def measure_tp_scale(args: TrainingArguments, model: nn.Module | Callable[[], nn.Module], train_dataset: Any,
                     profile: ModelProfile, comm: CommModel, compute_slots: float | None, *,
                     data_collator: Callable[[list[Any]], Any] | None = None, steps: int = 5,
                     degrees: list[int] | None = None) -> dict[int, float]:
    """Measured / predicted pipeline time of the pure DP x TP layout at each TP degree (collective).

    ``degrees`` defaults to every k >= 2 that divides the world size and the model's heads,
    kv heads and vocabulary (``profile.tp_allowed``). Every rank returns the same factors.
    Raises ValueError (on every rank, before any collective) for ``steps`` < 3.
    """
    from merak_core.layout import ParallelLayout
    from merak_core.trainer import Trainer

    if steps < 3:
        raise ValueError(f"measure_tp_scale: steps={steps}; expected >= 3 (one warm-up step and two measured)")
    world = dist.get_world_size()
    ks = degrees if degrees is not None else [k for k in range(2, world + 1)
                                              if world % k == 0 and profile.tp_allowed(k)]
    base = dataclasses.replace(profile, tp_scale={})
    micro = args.per_device_train_batch_size
    out: dict[int, float] = {}
    folder = [tempfile.mkdtemp(prefix="merak-tp-probe-") if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(folder, src=0)
    try:
        for k in ks:
            probe = dataclasses.replace(
                args, layout="manual", dp=world // k, tp=k, pp=1, gradient_accumulation_steps=1, max_steps=steps,
                schedule="1f1b", recompute="none", memory_budget=None,
                save_steps=None, eval_steps=None, plan_check_steps=0, logging_steps=10**9,
                output_dir=f"{folder[0]}/tp{k}")
            layout = ParallelLayout.build(world // k, k, 1)
            with torch.random.fork_rng():
                copy_ = model() if not isinstance(model, nn.Module) else _copy(model)
                trainer = Trainer(copy_, probe, train_dataset, None, data_collator=data_collator, layout=layout)
                pipeline = _pipeline_times(trainer, steps)
            measured = torch.tensor([statistics.median(pipeline[1:])], dtype=torch.float64)
            dist.all_reduce(measured, op=dist.ReduceOp.MAX)
            predicted = predict(base, dp=world // k, tp=k, pp=1, schedule="1f1b", num_microbatches=1,
                                micro_batch_size=micro, comm=comm, compute_slots=compute_slots)
            out[k] = float(measured) / predicted.pipeline_s
            if dist.get_rank() == 0:
                logger.info("tp probe: dp%d-tp%d, microbatch %d: pipeline %.2f ms measured, %.2f ms modelled: "
                            "x%.2f", world // k, k, micro, float(measured) * 1e3, predicted.pipeline_s * 1e3, out[k])
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(folder[0], ignore_errors=True)
    return out


def _copy(model: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(model)


def _pipeline_times(trainer: Any, steps: int) -> list[float]:
    """Train ``steps`` steps; the pipeline seconds of each (``Trainer.last_pipeline_s``)."""
    times: list[float] = []
    run = trainer.training_step

    def step(inputs: Any, labels: Any) -> float:
        loss = run(inputs, labels)
        times.append(trainer.last_pipeline_s)
        return loss

    trainer.training_step = step
    trainer.train()
    return times
