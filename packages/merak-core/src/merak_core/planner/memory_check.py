"""Measured per-stage memory of a composed model: one step under the saved-activation meter.

:func:`measure_step` runs one step (the caller's function: a Trainer step, or a pipeline step of
another schedule over the same stages, :func:`pipeline_step_fn`) under
:class:`~merak_core.planner.memory_meter.SavedActivationMeter` and then counts the parameter, gradient
and optimizer bytes held (:func:`~merak_core.planner.memory_meter.measure_held_bytes`); the result is
one :class:`~merak_core.planner.memory.StageMemory` per stage of this rank. :func:`gather_stages`
collects every stage of the pipeline (from DP rank 0 and TP rank 0) on every rank.

On CUDA, :func:`measure_step` also reads the allocator's peak over the step
(:func:`~merak_core.planner.memory_meter.cuda_peak_bytes`), per rank. That path is written to the
allocator's API and has not run on a GPU.

Not done here: predictions (:mod:`merak_core.planner.memory`) and choosing what to measure.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from merak_core.parallel.fsdp import ShardedDataParallel
from merak_core.planner.memory import StageMemory
from merak_core.planner.memory_meter import SavedActivationMeter, cuda_peak_bytes, measure_held_bytes

__all__ = ["gather_stages", "measure_step", "pipeline_step_fn"]


def measure_step(
    stage_modules: Mapping[int, nn.Module],
    stage_to_rank: Sequence[int],
    run_step: Callable[[], Any],
    *,
    optimizer: Any = None,
    device: torch.device | None = None,
    sharded: ShardedDataParallel | None = None,
    num_backwards: int = 1,
) -> tuple[list[StageMemory], int | None]:
    """Run ``run_step()`` once under the meter; (this rank's stages, the CUDA allocator's peak or None).

    Gradients are read right after the step, so ``run_step`` must leave them in place (a Trainer
    step does: it clears them at the start of the next one).

    ``sharded`` (ZeRO-2/3, the engine's :class:`~merak_core.parallel.fsdp.ShardedDataParallel`): ``run_step``
    is then a pipeline step without the gradient sync (:func:`pipeline_step_fn`); this arms the sync
    for ``num_backwards`` backwards, runs it, and calls ``finish()`` (the reduce-scatter) after it.
    A stage's parameter bytes are then its shards plus the most FSDP2 held gathered during the step
    (sampled whenever a unit starts its forward or backward reads a saved tensor), its gradient bytes
    the unsharded gradients held right before the reduce-scatter: the terms of
    :func:`~merak_core.planner.memory.model_state_bytes`.
    """
    gathered = dict.fromkeys(stage_modules, 0)

    def sample() -> None:
        assert sharded is not None
        for stage, (params, _) in sharded.unsharded_bytes_by_stage().items():
            gathered[stage] = max(gathered.get(stage, 0), params)

    meter = SavedActivationMeter(stage_modules, on_access=sample if sharded is not None else None)
    cuda_peak: int | None = None
    if sharded is not None:
        sharded.prepare_step(num_backwards)
    if device is not None and device.type == "cuda":
        with cuda_peak_bytes(device) as stats, meter.measuring():
            run_step()
        cuda_peak = stats["peak_bytes"]
    else:
        with meter.measuring():
            run_step()
    unsharded_grads = dict.fromkeys(stage_modules, 0)
    if sharded is not None:
        sample()
        unsharded_grads.update({s: g for s, (_, g) in sharded.unsharded_bytes_by_stage().items()})
        sharded.finish()
    held = measure_held_bytes(stage_modules, optimizer)
    out = [
        StageMemory(
            stage=s,
            rank=int(stage_to_rank[s]),
            param_bytes=float(held[s][0] + gathered[s]),
            grad_bytes=float(max(held[s][1], unsharded_grads[s])),
            optimizer_bytes=float(held[s][2]),
            activation_bytes=float(meter.peak[s]),
        )
        for s in sorted(stage_modules)
    ]
    return out, cuda_peak


def pipeline_step_fn(
    stage_modules: Mapping[int, nn.Module],
    schedule: Any,
    *,
    loss_fn: Callable[[Any, Any], Any],
    group: Any,
    inputs: Any,
    labels: Any,
    shared_parameters: Sequence[Any] = (),
    device: torch.device | str = "cpu",
) -> Callable[[], Any]:
    """A function running one pipeline step of ``schedule`` over this rank's ``stage_modules``.

    ``schedule`` is a merak-pipe schedule whose stages and placement match the modules (e.g. another
    schedule, microbatch count or recomputation than the Trainer's, over the same partition). With
    one stage and no pipeline (``group`` None), it runs the microbatches one after the other.
    """
    from merak_pipe import PipelineRunner, PipelineStage

    if group is None:
        (module,) = stage_modules.values()

        def single() -> None:
            chunks = zip(
                _split(inputs, schedule.num_microbatches),
                _split(labels, schedule.num_microbatches),
                strict=True,
            )
            for x, y in chunks:
                out = (
                    module(*x) if isinstance(x, tuple) else module(**x) if isinstance(x, dict) else module(x)
                )
                (loss_fn(out, y) / schedule.num_microbatches).backward()

        return single
    stages = [
        PipelineStage(m, stage_index=s, num_stages=schedule.num_stages, group=group, device=device)
        for s, m in sorted(stage_modules.items())
    ]
    runner = PipelineRunner(
        stages, schedule, loss_fn=loss_fn, group=group, shared_parameters=list(shared_parameters)
    )
    return lambda: runner.step(
        inputs if runner.holds_first_stage else None, labels if runner.holds_last_stage else None
    )


def _split(value: Any, parts: int) -> list[Any]:
    if isinstance(value, torch.Tensor):
        return list(value.chunk(parts))
    if isinstance(value, tuple):
        columns = [_split(v, parts) for v in value]
        return [tuple(c[i] for c in columns) for i in range(parts)]
    if isinstance(value, Mapping):
        split = {k: _split(v, parts) for k, v in value.items()}
        return [{k: v[i] for k, v in split.items()} for i in range(parts)]
    raise TypeError(f"cannot split a batch of type {type(value).__name__} into microbatches")


def gather_stages(mine: Sequence[StageMemory], *, report: bool) -> list[StageMemory]:
    """Every stage's measurement on every rank (collective over the world), from the ranks with ``report``
    (one replica: DP rank 0 and TP rank 0), sorted by stage."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, list(mine) if report else [])
    by_stage: dict[int, StageMemory] = {}
    for part in gathered:
        for m in part:
            by_stage.setdefault(m.stage, m)
    return [by_stage[s] for s in sorted(by_stage)]
