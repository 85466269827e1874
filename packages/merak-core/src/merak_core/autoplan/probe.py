"""Probe the real model in the pure DP x TP layouts: how far the planner's cost model is off.

The planner models a TP shard as the layer's compute divided by tp plus two all-reduces per layer
and direction, and ranks sharing cores as slowed down by ranks / slots. On small layers and CPU
ranks sharing cores the real shards are slower: the operators' fixed costs do not shrink with tp,
and an all-reduce waits for peers that are not running. The time outside the pipeline also holds
what the model leaves out (the ranks' skew, Python work per step).

:func:`measure_tp_scale` (collective) trains the job's model for a few steps in each layout
``(world / k, k, 1)`` with one microbatch of ``per_device_train_batch_size`` samples, for k = 1 and
every TP degree the world allows, and divides the median measured pipeline time (the slowest
rank's) by the planner's prediction for that configuration: the factors go into
:attr:`merak_core.planner.ModelProfile.tp_scale`, which scales the layers' time at that degree in
every layout the planner considers (with pipeline stages too). The median over the probes of the
measured / predicted time outside the pipeline becomes ``ModelProfile.overhead_scale``.

The probe trains a copy of the model (or what the model function builds) with the step engine
(:class:`merak_core.run.engine.ParallelEngine`, no Trainer: no metrics, checkpoints or files) and
leaves the caller's random stream as it was.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from merak_core.config import TrainingArguments
from merak_core.config.layout_choice import LayoutChoice
from merak_core.planner import CommModel, ModelProfile, predict

logger = logging.getLogger(__name__)

__all__ = ["ProbeResult", "measure_tp_scale", "slowest_probe_note"]


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """What the probe runs measured against the model (see the module docstring)."""

    tp_scale: dict[int, float]
    """Per TP degree (1 included): measured / predicted pipeline time."""
    overhead_scale: float
    """Median over the probes of measured / predicted time outside the pipeline."""
    measured: dict[int, tuple[float, int]] = dataclasses.field(default_factory=dict)
    """Per TP degree: the measured step seconds (median, slowest rank) and the samples one step took."""

    def apply(self, profile: ModelProfile) -> ModelProfile:
        """``profile`` with these factors."""
        return dataclasses.replace(profile, tp_scale=dict(self.tp_scale), overhead_scale=self.overhead_scale)


def measure_tp_scale(
    args: TrainingArguments,
    model: nn.Module | Callable[[], nn.Module],
    train_dataset: Any,
    profile: ModelProfile,
    comm: CommModel,
    compute_slots: float | None,
    *,
    data_collator: Callable[[list[Any]], Any] | None = None,
    steps: int = 5,
    degrees: list[int] | None = None,
) -> ProbeResult:
    """Measured / predicted times of the pure DP x TP layouts (collective; every rank gets the same).

    ``degrees`` defaults to 1 and every k >= 2 that divides the world size and the model's heads,
    kv heads and vocabulary (``profile.tp_allowed``). Raises ValueError (on every rank, before any
    collective) for ``steps`` < 3.
    """
    from merak_core.parallel.layout import ParallelLayout

    if steps < 3:
        raise ValueError(
            f"measure_tp_scale: steps={steps}; expected >= 3 (one warm-up step and two measured)"
        )
    world = dist.get_world_size()
    ks = (
        degrees
        if degrees is not None
        else [k for k in range(1, world + 1) if world % k == 0 and profile.tp_allowed(k)]
    )
    base = dataclasses.replace(profile, tp_scale={}, overhead_scale=1.0)
    micro = args.per_device_train_batch_size
    scale: dict[int, float] = {}
    rest: list[float] = []
    steps_s: dict[int, tuple[float, int]] = {}
    for k in ks:
        probe = dataclasses.replace(
            args,
            layout="manual",
            dp=world // k,
            tp=k,
            pp=1,
            gradient_accumulation_steps=1,
            max_steps=steps,
            schedule="1f1b",
            recompute="none",
            memory_budget=None,
            save_steps=None,
            eval_steps=None,
            plan_check_steps=0,
            logging_steps=10**9,
        )
        layout = ParallelLayout.build(world // k, k, 1)
        with torch.random.fork_rng():
            copy_ = model() if not isinstance(model, nn.Module) else copy.deepcopy(model)
            pipeline, step = _times(copy_, probe, layout, train_dataset, data_collator, steps)
        measured = torch.tensor(
            [statistics.median(pipeline[1:]), statistics.median(step[1:])],
            dtype=torch.float64,
            device=layout.device,
        )
        dist.all_reduce(measured, op=dist.ReduceOp.MAX)
        predicted = predict(
            base,
            LayoutChoice(
                dp=world // k, tp=k, pp=1, schedule="1f1b", num_microbatches=1, micro_batch_size=micro
            ),
            comm=comm,
            compute_slots=compute_slots,
        )
        pipe_s, step_s = (float(x) for x in measured)
        scale[k] = pipe_s / predicted.pipeline_s
        steps_s[k] = (step_s, world // k * micro)
        outside = predicted.step_time_s - predicted.pipeline_s
        if outside > 0:
            rest.append(max(step_s - pipe_s, 0.0) / outside)
        if dist.get_rank() == 0:
            logger.info(
                "probe dp%d-tp%d, microbatch %d: pipeline %.2f ms measured / %.2f ms modelled (x%.2f); "
                "outside the pipeline %.2f / %.2f ms",
                world // k,
                k,
                micro,
                pipe_s * 1e3,
                predicted.pipeline_s * 1e3,
                scale[k],
                (step_s - pipe_s) * 1e3,
                outside * 1e3,
            )
    return ProbeResult(
        tp_scale=scale, overhead_scale=statistics.median(rest) if rest else 1.0, measured=steps_s
    )


def slowest_probe_note(chosen: Any, measured: dict[int, tuple[float, int]]) -> str | None:
    """One line when the plan ranks first (``chosen``, a Candidate) the pure DP x TP layout the probe measured slowest.

    ``measured``: :attr:`ProbeResult.measured`. The probes compare by time per sample (the layouts'
    steps take different numbers of samples); None when the first candidate was not probed (pp > 1),
    fewer than two layouts were, or another was measured slower.
    """
    if len(measured) < 2 or chosen.pp != 1 or chosen.tp not in measured:
        return None
    per = {k: s / n for k, (s, n) in measured.items()}
    if per[chosen.tp] < max(per.values()) or max(per.values()) == min(per.values()):
        return None
    world = chosen.dp * chosen.tp
    fastest = min(per, key=lambda k: per[k])
    step_s, samples = measured[chosen.tp]
    others = ", ".join(f"dp{world // k}-tp{k} {per[k] * 1e3:.3g} ms" for k in sorted(per) if k != chosen.tp)
    return (
        f"layout auto: the plan ranks dp{chosen.dp}-tp{chosen.tp}-pp1 first, but its probe measured that layout "
        f"slowest: {step_s * 1e3:.3g} ms per step of {samples} samples ({per[chosen.tp] * 1e3:.3g} ms per sample; "
        f"{others} per sample); the cost model and this machine disagree here: to train the measured fastest, set "
        f"layout: manual with training.dp={world // fastest} training.tp={fastest} training.pp=1"
    )


def _times(
    model: nn.Module,
    args: TrainingArguments,
    layout: Any,
    train_dataset: Any,
    data_collator: Callable[[list[Any]], Any] | None,
    steps: int,
) -> tuple[list[float], list[float]]:
    """Train ``steps`` steps of ``model`` with the step engine; each step's pipeline and whole seconds."""
    from merak_core.data.loader import StageAwareDataLoader
    from merak_core.run import bootstrap
    from merak_core.run.engine import ParallelEngine, default_loss

    device = bootstrap.run_device(layout)
    loader = StageAwareDataLoader.from_training_args(
        train_dataset, args, layout, collate_fn=data_collator, device=device
    )
    inputs, labels = bootstrap.example_batch(train_dataset, data_collator, args.micro_batch_size)
    composed = bootstrap.compose(model, args, layout, device, example_inputs=inputs)
    engine = ParallelEngine(
        composed,
        layout,
        args,
        device=device,
        loss_fn=default_loss,
        num_training_steps=steps,
        example_labels=labels,
    )
    pipeline: list[float] = []
    whole: list[float] = []
    batches = iter(loader)
    for number in range(1, steps + 1):
        try:
            batch = next(batches)
        except StopIteration:
            batches = iter(loader)
            batch = next(batches)
        start = time.perf_counter()
        result = engine.step(
            batch.inputs, batch.labels, step=number
        )  # a Python float loss: the device finished
        whole.append(time.perf_counter() - start)
        pipeline.append(result.pipeline_s)
    return pipeline, whole
