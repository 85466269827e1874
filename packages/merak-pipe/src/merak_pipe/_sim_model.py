"""The simulator's inputs and outputs: the cost model and the result (``merak_pipe.sim`` re-exports them).

Kept apart from the event loops so that the simulators of training schedules (``sim.py``) and of decode
schedules (``_decode_rules.py``) share them without importing each other.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from merak_pipe.ir import Action, Schedule

__all__ = ["CostModel", "PerStage", "SimResult", "TimedAction"]

PerStage = float | Sequence[float]


def _per_stage(name: str, value: PerStage, num_stages: int) -> list[float]:
    if isinstance(value, (int, float)):
        values = [float(value)] * num_stages
    else:
        values = [float(v) for v in value]
        if len(values) != num_stages:
            raise ValueError(
                f"CostModel.{name} has {len(values)} values but the schedule has {num_stages} stages"
            )
    for v in values:
        if v < 0 or math.isnan(v):
            raise ValueError(f"CostModel.{name}={value!r}: expected values >= 0")
    return values


@dataclass(kw_only=True)
class CostModel:
    """Per-stage durations, a point-to-point model and activation sizes for :func:`simulate`."""

    forward: PerStage = 1.0
    """Time of one forward (F) per microbatch, one value or one per stage."""
    backward: PerStage = 2.0
    """Time of one full backward (B) per microbatch, without recomputation."""
    backward_input: PerStage | None = None
    """Time of the input-gradient backward (I); default: half of ``backward``."""
    backward_weight: PerStage | None = None
    """Time of the weight-gradient backward (W); default: ``backward`` minus ``backward_input``."""
    recompute: PerStage | None = None
    """Time to recompute the whole stage's forward (scaled by the recompute fraction); default: ``forward``."""
    p2p_latency: float = 0.0
    """Latency of one point-to-point message between ranks."""
    p2p_bandwidth: float = math.inf
    """Bytes per time unit of a point-to-point link."""
    boundary_bytes: PerStage = 0.0
    """Bytes of stage s's output for one microbatch (the message from s to s+1, and its gradient back)."""
    activation_bytes: PerStage = 1.0
    """Activation bytes of one microbatch on a stage when nothing is recomputed."""
    input_bytes: PerStage = 0.0
    """Bytes of a stage's input kept per microbatch when the stage recomputes (checkpoint input)."""
    weight_grad_fraction: float = 0.5
    """Fraction of a microbatch's activations kept between its I and its W."""
    per_action: float = 0.0
    """The runtime's own host time per action ([Note: per-action cost]): added to every compute
    action, and to every SEND/RECV of a lowered schedule (or, in a compute-only one, once per
    message the compute action sends or receives across ranks, which lowering would add)."""

    def __post_init__(self) -> None:
        if not self.per_action >= 0 or math.isinf(self.per_action):
            raise ValueError(
                f"CostModel.per_action={self.per_action!r}: expected the runtime's seconds per action, a "
                "finite value >= 0 (0 leaves it out)"
            )
        if self.p2p_latency < 0 or self.p2p_bandwidth <= 0:
            raise ValueError(
                f"p2p_latency={self.p2p_latency}, p2p_bandwidth={self.p2p_bandwidth}: expected latency >= 0 "
                "and bandwidth > 0 (use math.inf for free transfers)"
            )
        if not 0.0 <= self.weight_grad_fraction <= 1.0:
            raise ValueError(f"weight_grad_fraction={self.weight_grad_fraction}; expected a value in [0, 1]")


@dataclass(slots=True)
class TimedAction:
    """An action with its rank and simulated start and end."""

    rank: int
    action: Action
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class SimResult:
    """What :func:`simulate` returns."""

    schedule: Schedule
    makespan: float
    busy: list[float]
    """Compute time per rank."""
    bubble_fraction: list[float]
    """Per rank: 1 - busy / makespan."""
    critical_path: list[TimedAction]
    """A chain of actions from time 0 to the makespan, each starting when its predecessor ends."""
    memory: dict[int, list[tuple[float, float]]]
    """Per stage: (time, activation bytes) after each change, in time order."""
    peak_memory: list[float]
    """Per stage: highest activation bytes."""
    peak_memory_per_rank: list[float]
    """Per rank: highest sum over its stages (equals the stage peak for one stage per rank)."""
    costs: CostModel = field(repr=False, default_factory=CostModel)
    _order: list[tuple[int, int]] = field(repr=False, default_factory=list)
    _starts: list[list[float]] = field(repr=False, default_factory=list)
    _ends: list[list[float]] = field(repr=False, default_factory=list)
    _timeline: list[TimedAction] | None = field(repr=False, default=None)

    @property
    def timeline(self) -> list[TimedAction]:
        """Every action with its start and end, in an order that respects dependencies (built on first use)."""
        if self._timeline is None:
            acts, starts, ends = self.schedule.actions, self._starts, self._ends
            self._timeline = [
                TimedAction(r, acts[r][st], starts[r][st], ends[r][st]) for r, st in self._order
            ]
        return self._timeline

    def start_end(self, rank: int, step: int) -> tuple[float, float]:
        """Simulated start and end of ``schedule.actions[rank][step]``."""
        return self._starts[rank][step], self._ends[rank][step]

    @property
    def bubble_fraction_mean(self) -> float:
        return sum(self.bubble_fraction) / len(self.bubble_fraction)

    def summary(self) -> str:
        """A short table: makespan, bubble per rank, peak memory per stage."""
        lines = [
            f"{self.schedule.name}: makespan {self.makespan:.4g}, mean bubble {100 * self.bubble_fraction_mean:.1f}%"
        ]
        lines.append("rank | bubble % | peak activation memory (stages)")
        for rank in range(self.schedule.num_ranks):
            stages = self.schedule.stages_of(rank)
            peaks = ", ".join(f"s{s}={self.peak_memory[s]:.4g}" for s in stages)
            if len(stages) > 1:
                peaks += f" (rank: {self.peak_memory_per_rank[rank]:.4g})"
            lines.append(f"{rank:4d} | {100 * self.bubble_fraction[rank]:8.1f} | {peaks}")
        return "\n".join(lines)
