"""Per-stage peak memory: predicted from a profile and a schedule, and measured from a run.

A stage's peak is what its rank holds for it at the step's worst moment: parameters, gradients and
optimizer states (each under the ZeRO stage in use, see :func:`model_state_bytes`) plus the peak of
the activations autograd keeps for backward, with the schedule's microbatches in flight and the
stage's recomputation (the simulator's memory model, :func:`merak_pipe.simulate`: a recomputing
stage keeps its input and a ``1 - f`` share per microbatch and re-creates ``f`` for one microbatch
at a time). :func:`predict_stage_memory` computes it from a :class:`ModelProfile` for a layout;
the planner uses the same terms to reject what does not fit ``memory_per_device``.

Measured (:mod:`merak_core.planner.memory_meter`: ``SavedActivationMeter``, ``measure_held_bytes``,
``cuda_peak_bytes``): the bytes of the tensors autograd saves, per
stage, plus the parameter, gradient and optimizer-state bytes the rank holds;
:func:`merak_core.planner.memory_check.measure_step` runs one step under them (ZeRO-2/3 included).

The planner keeps a margin below ``memory_per_device`` for what the prediction misses
([Note: memory margin]).

[Note: frozen weights] A frozen parameter (a LoRA run's base weights, ``requires_grad=False``) is
held as a weight only: autograd gives it no gradient, the optimizer no state, and ZeRO has no
gradient or state of it to shard. The profile says which bytes train
(``ModelProfile.layer_trainable_bytes``, measured from ``requires_grad``); the gradient and
optimizer terms, the DP gradient all-reduce and the optimizer's time count those bytes alone.

[Note: peak as a sum] The predicted and the measured peak are both the held state plus the
activation peak. Gradients only appear with the first backward, when activations start to be
freed, so the true simultaneous peak (the allocator's) can be lower than this sum; never higher,
except for the allocator's fragmentation and workspaces, which neither count.

Not done here: temporaries inside one operator (matmul workspaces, the logits' softmax), memory
of communication buffers, and CPU offload.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from merak_core.parallel.fsdp import default_reshard_after_forward, warn_nothing_to_shard
from merak_core.planner.profile import ModelProfile
from merak_pipe import schedule_info

__all__ = [
    "MEMORY_MARGIN",
    "WEIGHT_GRAD_FRACTION",
    "ZERO_STAGES",
    "StageMemory",
    "compare_stage_memory",
    "model_state_bytes",
    "predict_stage_memory",
    "relative_errors",
    "usable_memory",
]

ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class StageMemory:
    """One stage's memory at its peak, in bytes (see [Note: peak as a sum])."""

    stage: int
    rank: int
    """The pipeline rank holding the stage."""
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    activation_bytes: float
    """Peak bytes of saved activations of this stage (microbatches in flight and recomputation included)."""

    @property
    def state_bytes(self) -> float:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def total_bytes(self) -> float:
        return self.state_bytes + self.activation_bytes


WEIGHT_GRAD_FRACTION = 1.0
"""[Note: kept between I and W] The share of a microbatch's activations a split-backward schedule
(``zb_h1``, ``zb_v``) keeps from its input-gradient action ``I`` to its weight-gradient action ``W``.
merak-pipe's ``I`` runs ``torch.autograd.grad`` with the graph retained, so autograd frees none of
the saved tensors before ``W``: 1, not the simulator's default of one half (with one half, ZB-V's
first stage at pp=2 was predicted at two microbatches where it holds three)."""

MEMORY_MARGIN = 0.15
"""[Note: memory margin] The planner keeps a configuration only when its predicted peak is at most
``(1 - MEMORY_MARGIN) * memory_per_device`` (:func:`usable_memory`), so that a measured peak up to
``MEMORY_MARGIN`` above the prediction still fits. What it covers, as measured by
``tests/core/test_memory_model.py``: the largest under-estimate there is 11.4%, at tp=2 on GPT-2,
because the model divides every parameter and activation by tp while layer norms, the biases of
row-parallel layers and the inputs of column-parallel layers are held whole by every TP rank (at
tp=1 the largest is 0.4%). It also leaves room for what neither the prediction nor the CPU
measurement counts: temporaries inside one operator, communication buffers, the gradients a
split-backward ``I`` keeps for its ``W`` (not saved tensors), the allocator's fragmentation."""


def usable_memory(memory_per_device: float) -> float:
    """The bytes of ``memory_per_device`` a predicted peak may use ([Note: memory margin])."""
    return float(memory_per_device) * (1.0 - MEMORY_MARGIN)


def model_state_bytes(
    param_bytes: float,
    *,
    zero_stage: int,
    dp: int,
    optimizer_state_factor: float = 2.0,
    largest_unit_bytes: float = 0.0,
    stage_index: int = 0,
    num_stages: int = 1,
    trainable_bytes: float | None = None,
) -> tuple[float, float, float]:
    """(parameter, gradient, optimizer-state) bytes a rank holds for ``param_bytes`` of its stage at the peak.

    ``trainable_bytes``: the part of ``param_bytes`` that trains (None: all of it). Frozen weights (a
    LoRA run's base) are weights only: no gradient, no optimizer state, nothing for ZeRO to shard
    ([Note: frozen weights]).

    ``optimizer_state_factor``: optimizer-state bytes per parameter byte (2 for Adam's moments in the
    parameter dtype). ZeRO-1 shards the optimizer states over ``dp``; ZeRO-2 and ZeRO-3 (FSDP2, see
    :mod:`merak_core.parallel.fsdp`) also keep parameters and gradients sharded between steps, but within a
    step they hold the accumulated gradients unsharded until the one reduce-scatter after the last
    backward ([Note: one gradient sync per step] there); ZeRO-2 keeps each unit's parameters gathered
    from its first forward to that reduce-scatter, ZeRO-3 gathers one unit (``largest_unit_bytes``)
    at a time on top of its shards, except on the stage that does not reshard after forward (the
    last of ``num_stages > 1``, [Note: reshard after forward per stage]), which holds them as ZeRO-2.
    At ``dp == 1`` there is nothing to shard: every ZeRO stage holds what ZeRO-0 holds (the Trainer
    says so when it starts, :func:`merak_core.parallel.fsdp.warn_nothing_to_shard`).
    """
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage={zero_stage!r}; expected one of {ZERO_STAGES}")
    if not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp={dp!r}; expected an int >= 1")
    p = float(param_bytes)
    t = p if trainable_bytes is None else float(trainable_bytes)
    if not 0.0 <= t <= p * (1 + 1e-9):  # (sums of the same bytes in another order may differ in the last bit)
        raise ValueError(
            f"trainable_bytes={trainable_bytes!r}; expected 0 <= trainable_bytes <= param_bytes={p}"
        )
    t = min(t, p)
    optimizer = t * optimizer_state_factor / (dp if zero_stage >= 1 else 1)
    if zero_stage <= 1 or dp == 1:
        return p, t, optimizer
    frozen = p - t  # whole on every DP rank: FSDP2 leaves it alone ([Note: frozen parameters under ZeRO-2/3])
    shard = t / dp
    if zero_stage == 2 or not default_reshard_after_forward(
        zero_stage, stage_index=stage_index, num_stages=num_stages
    ):
        return frozen + shard + t, t, optimizer
    return frozen + shard + min(float(largest_unit_bytes), t), t, optimizer


def _stage_ranges(stage_layers: Sequence[int]) -> list[range]:
    bounds = [0]
    for n in stage_layers:
        bounds.append(bounds[-1] + int(n))
    return [range(bounds[s], bounds[s + 1]) for s in range(len(stage_layers))]


def predict_stage_memory(
    profile: ModelProfile,
    *,
    stage_layers: Sequence[int],
    virtual_stages: int = 1,
    schedule: str,
    num_microbatches: int,
    micro_batch_size: int,
    recompute_fractions: Sequence[float] | None = None,
    tp: int = 1,
    dp: int = 1,
    zero_stage: int = 0,
    optimizer_state_factor: float = 2.0,
) -> list[StageMemory]:
    """The predicted peak of every stage (``len(stage_layers)`` stages, ``stage_layers[s]`` layers each).

    ``schedule`` is a merak-pipe schedule name (``1f1b``, ``interleaved-1f1b``, ``zb-v``, ...; the
    config's underscores are accepted), run over ``len(stage_layers) / virtual_stages`` pipeline
    ranks and placing the stages as it does (round-robin, a V). Parameters, activations and their TP share are the profile's
    divided by ``tp``; a parameter shared by the first and the last layer (a tied embedding,
    ``profile.shared_param_bytes``) is held by both of their stages unless one stage holds both.
    """
    from merak_pipe import CostModel, RecomputePlan, build_schedule, simulate

    num_stages = len(stage_layers)
    if num_stages < 1 or sum(stage_layers) != profile.num_layers or min(stage_layers) < 1:
        raise ValueError(
            f"stage_layers={list(stage_layers)} must be >= 1 layer per stage and sum to the profile's "
            f"{profile.num_layers} layers"
        )
    if virtual_stages < 1 or num_stages % virtual_stages:
        raise ValueError(f"virtual_stages={virtual_stages} must divide the {num_stages} stages")
    warn_nothing_to_shard(zero_stage, dp)
    name = schedule_info(schedule).name
    fractions = list(recompute_fractions) if recompute_fractions is not None else [0.0] * num_stages
    if len(fractions) != num_stages:
        raise ValueError(f"recompute_fractions has {len(fractions)} values for {num_stages} stages")
    sched = build_schedule(
        name,
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        num_ranks=num_stages // virtual_stages,
        recompute=RecomputePlan(tuple(float(f) for f in fractions)),
        check=False,
    )
    placement = sched.stage_to_rank
    ranges = _stage_ranges(stage_layers)
    b = micro_batch_size
    acts = [b * sum(profile.layer_activation_bytes[i] for i in r) / tp for r in ranges]
    boundary = b * profile.boundary_bytes  # the residual stream is not sharded by TP
    costs = CostModel(
        forward=1.0,
        backward=2.0,
        recompute=1.0,
        activation_bytes=acts,
        input_bytes=boundary,
        weight_grad_fraction=WEIGHT_GRAD_FRACTION,
    )
    peaks = simulate(sched, costs).peak_memory
    out = []
    trainable_per_layer = profile.trainable_bytes
    for s, r in enumerate(ranges):
        params = sum(profile.layer_param_bytes[i] for i in r)
        trainable = sum(trainable_per_layer[i] for i in r)
        first_and_last = 0 in r and profile.num_layers - 1 in r
        if first_and_last or _holds_other_copy(s, placement, ranges, profile.num_layers):
            # one local copy of the tied parameter (on this stage, or the rank's other stage holds it)
            params -= profile.shared_param_bytes
            trainable -= profile.shared_trainable
        unit = max((profile.layer_param_bytes[i] for i in r), default=0.0) / tp
        p, g, o = model_state_bytes(
            params / tp,
            zero_stage=zero_stage,
            dp=dp,
            optimizer_state_factor=optimizer_state_factor,
            largest_unit_bytes=unit,
            stage_index=s,
            num_stages=num_stages,
            trainable_bytes=trainable / tp,
        )
        out.append(
            StageMemory(
                stage=s,
                rank=placement[s],
                param_bytes=p,
                grad_bytes=g,
                optimizer_bytes=o,
                activation_bytes=float(peaks[s]),
            )
        )
    return out


def _holds_other_copy(s: int, placement: Sequence[int], ranges: Sequence[range], num_layers: int) -> bool:
    """True when stage ``s`` holds the last layer and an earlier stage of its rank holds the first
    (the tied copy is one local parameter, counted on that earlier stage)."""
    if num_layers - 1 not in ranges[s]:
        return False
    return any(placement[t] == placement[s] and 0 in ranges[t] for t in range(s))


def relative_errors(predicted: Sequence[StageMemory], measured: Sequence[StageMemory]) -> list[float]:
    """Per stage: |predicted - measured| / measured of the total peak."""
    by_stage = {m.stage: m for m in measured}
    out = []
    for p in predicted:
        m = by_stage[p.stage]
        out.append(abs(p.total_bytes - m.total_bytes) / max(m.total_bytes, 1.0))
    return out


def compare_stage_memory(predicted: Sequence[StageMemory], measured: Sequence[StageMemory]) -> str:
    """A per-stage table of predicted against measured bytes, and the median and largest error."""
    by_stage = {m.stage: m for m in measured}
    lines = [
        f"{'stage':>5} {'rank':>4} {'pred MiB':>9} {'meas MiB':>9} {'error':>7}  "
        "(params/grads/optimizer/activations, predicted | measured, MiB)"
    ]
    errors = relative_errors(predicted, measured)
    mib = 2.0**20

    def parts(x: Any) -> str:
        return "/".join(
            f"{v / mib:.3f}" for v in (x.param_bytes, x.grad_bytes, x.optimizer_bytes, x.activation_bytes)
        )

    for p, err in zip(predicted, errors, strict=True):
        m = by_stage[p.stage]
        lines.append(
            f"{p.stage:>5} {p.rank:>4} {p.total_bytes / mib:>9.3f} {m.total_bytes / mib:>9.3f} "
            f"{100 * err:>6.1f}%  {parts(p)} | {parts(m)}"
        )
    lines.append(f"median error {100 * statistics.median(errors):.1f}%, max {100 * max(errors):.1f}%")
    return "\n".join(lines)
