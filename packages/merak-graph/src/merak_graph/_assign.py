"""Assign a chain of shards to contiguous pipeline stages (the step after sharding).

One validated :class:`_Options` object carries the choices every entry point of
``partitioning.py`` accepts; :func:`assign_stages` runs the steps in order: solve the stage
bounds, check memory, build the stage modules, then their name maps, byte counts and the
parameters shared across stages. Pure: no process group, no device work.

[Note: in-flight microbatches] Memory per stage counts ``in_flight[i]`` microbatches of
activations. merak-graph does not know schedules (it must not import merak-pipe), so a caller
that runs a schedule passes its counts as a list (merak-pipe's ``in_flight_counts(schedule)``).
The shorthands are for merak-graph used alone: ``None``/``"none"`` (one microbatch each) and
``"1f1b"``, 1F1B's closed form ``S - i`` (its peak when there are at least ``S`` microbatches).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from merak_graph.errors import PartitionError
from merak_graph.partition_result import Partition, SharedParameter, StageInfo
from merak_graph.sharding import Shard, ShardedGraph
from merak_graph.solver import (
    optimal_contiguous_partition,
    smallest_boundary_partition,
    stage_bounds_cost,
    uniform_partition,
)
from merak_graph.stage import StageModule

logger = logging.getLogger(__name__)

METHODS = ("cost", "uniform", "parameters")

PARAM_MEMORY_FACTOR = 4.0
"""Default bytes held per parameter byte: the weight, its gradient and two Adam moments."""


@dataclass(frozen=True, kw_only=True)
class _Options:
    """How shards are assigned to stages (the arguments of ``merak_graph.partition``)."""

    method: str = "cost"
    """``"cost"``, ``"uniform"`` or ``"parameters"``."""
    memory_limit: float | None = None
    """Bytes per stage, or None (no limit)."""
    param_memory_factor: float = PARAM_MEMORY_FACTOR
    """Bytes held per parameter byte."""
    in_flight: str | Sequence[float] | None = None
    """Microbatches of activations per stage (see [Note: in-flight microbatches])."""
    balance_tolerance: float = 0.0
    """Relative slack on the slowest stage within which the smallest boundaries are preferred."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r} is not one of {METHODS}")
        if self.balance_tolerance < 0:
            raise ValueError(
                f"balance_tolerance={self.balance_tolerance} must be >= 0 (0 keeps the exact optimum)"
            )
        if isinstance(self.in_flight, str) and self.in_flight not in ("none", "1f1b"):
            raise ValueError(
                f"in_flight={self.in_flight!r} must be None, 'none', '1f1b' or a list with one number "
                "per stage"
            )

    def in_flight_counts(self, num_stages: int) -> list[float]:
        """One count per stage (see [Note: in-flight microbatches])."""
        if self.in_flight is None or self.in_flight == "none":
            return [1.0] * num_stages
        if self.in_flight == "1f1b":
            return [float(num_stages - i) for i in range(num_stages)]
        values = [float(x) for x in self.in_flight]
        if len(values) != num_stages:
            raise ValueError(f"in_flight has {len(values)} entries, expected {num_stages} (one per stage)")
        return values


def assign_stages(
    sharded: ShardedGraph, num_stages: int, options: _Options, model: nn.Module | None
) -> Partition:
    """Assign the shards of ``sharded`` to ``num_stages`` contiguous stages (see ``partition``)."""
    shards = sharded.shards
    _check_stage_count(num_stages, sharded)
    flight = options.in_flight_counts(num_stages)
    bounds = _solve_bounds(shards, num_stages, options, flight)
    _check_memory(shards, bounds, options, flight)
    canonical = _canonical_names(model) if model is not None else {}
    strict = sharded.graph_module.meta.get("merak_trace_method") == "export"
    stages = [_stage_module(shards[bounds[i] : bounds[i + 1]], strict) for i in range(num_stages)]
    names = [_name_map(dict(stage.named_parameters()), canonical) for stage in stages]
    buffer_names = [_name_map(dict(stage.named_buffers()), canonical) for stage in stages]
    infos = [
        _stage_info(i, shards, bounds, stages[i], options.param_memory_factor, flight[i])
        for i in range(num_stages)
    ]
    logger.info(
        "partitioned into %d stages (%s): stage times %s",
        num_stages,
        options.method,
        [f"{x.time_s:.3g}" for x in infos],
    )
    return Partition(
        stages=stages,
        stage_info=infos,
        shared_parameters=_shared_parameters(stages, names),
        sharded=sharded,
        bounds=bounds,
        method=options.method,
        input_names=list(sharded.input_names),
        model=model,
        _names=names,
        _buffer_names=buffer_names,
    )


def _check_stage_count(num_stages: int, sharded: ShardedGraph) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages={num_stages} must be >= 1")
    count = len(sharded.shards)
    if count < num_stages:
        raise PartitionError(
            f"the graph was cut into only {count} shards ({sharded.valid_positions} valid cut positions) "
            f"but num_stages={num_stages}: use at most {count} stages, give more split_points, or fewer "
            "leaf_modules so the graph has more places to cut"
        )


def _solve_bounds(shards: list[Shard], num_stages: int, options: _Options, flight: list[float]) -> list[int]:
    """Stage bounds: the balanced optimum, then, among near-optimal ones, the smallest boundaries."""
    if options.method == "uniform":
        return uniform_partition(len(shards), num_stages)
    pm = [s.param_bytes * options.param_memory_factor for s in shards]
    am = [float(s.activation_bytes) for s in shards]
    costs = [s.time_s for s in shards] if options.method == "cost" else [float(s.param_bytes) for s in shards]
    bounds = optimal_contiguous_partition(
        costs,
        num_stages,
        param_memory=pm,
        activation_memory=am,
        in_flight=flight,
        memory_limit=options.memory_limit,
    )
    # Among (near-)optimal assignments, prefer the smallest stage-to-stage boundaries (p2p volume).
    slowest = max(stage_bounds_cost(costs, bounds))
    cut_bytes = [float(sum(b.nbytes for b in s.outputs)) for s in shards]
    better = smallest_boundary_partition(
        costs,
        num_stages,
        cut_bytes,
        slowest * (1.0 + options.balance_tolerance) + 1e-12 * abs(slowest),
        param_memory=pm,
        activation_memory=am,
        in_flight=flight,
        memory_limit=options.memory_limit,
    )
    return bounds if better is None else better


def _check_memory(shards: list[Shard], bounds: list[int], options: _Options, flight: list[float]) -> None:
    """Every stage within ``memory_limit`` (the solver guarantees it for "cost"; "uniform" may not)."""
    limit = options.memory_limit
    if limit is None:
        return
    for i in range(len(bounds) - 1):
        group = shards[bounds[i] : bounds[i + 1]]
        mem = sum(s.param_bytes * options.param_memory_factor for s in group) + flight[i] * sum(
            float(s.activation_bytes) for s in group
        )
        if mem > limit:
            raise PartitionError(
                f"method={options.method!r} puts {mem:.4g} bytes on stage {i}, over memory_limit={limit:.4g}: "
                "use method='cost', raise memory_limit or add stages"
            )


def _stage_module(group: list[Shard], strict_shapes: bool) -> StageModule:
    return StageModule(
        *[s.module for s in group],
        input_names=[b.name for b in group[0].inputs],
        input_specs=group[0].inputs,
        strict_shapes=strict_shapes,
    )


def _canonical_names(model: nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        names.setdefault(id(t), name)
    return names


def _name_map(local: dict[str, object], canonical: dict[int, str]) -> dict[str, str]:
    """Local name in a stage module -> the original model's name (shard prefix dropped without a model)."""
    return {name: canonical.get(id(t), name.split(".", 1)[1]) for name, t in local.items()}


def _held_bytes(stage: StageModule) -> int:
    """Bytes of the stage's parameters and buffers, each tensor counted once."""
    seen: set[int] = set()
    total = 0
    for tensor in [*stage.parameters(), *stage.buffers()]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total


def _stage_info(
    i: int,
    shards: list[Shard],
    bounds: list[int],
    stage: StageModule,
    param_memory_factor: float,
    flight: float,
) -> StageInfo:
    lo, hi = bounds[i], bounds[i + 1]
    group = shards[lo:hi]
    pbytes = _held_bytes(stage)
    abytes = sum(s.activation_bytes for s in group)
    return StageInfo(
        index=i,
        shard_range=(lo, hi),
        inputs=group[0].inputs,
        outputs=group[-1].outputs,
        time_s=float(sum(stage_bounds_cost([s.time_s for s in shards], [lo, hi]))),
        flops=sum(s.flops for s in group),
        param_bytes=pbytes,
        activation_bytes=abytes,
        memory_bytes=pbytes * param_memory_factor + flight * abytes,
    )


def _shared_parameters(stages: list[StageModule], names: list[dict[str, str]]) -> list[SharedParameter]:
    """Parameters held by more than one stage, found by tensor identity (never by shape)."""
    holders: dict[int, list[tuple[int, str]]] = {}
    for i, stage in enumerate(stages):
        for local, t in stage.named_parameters():
            holders.setdefault(id(t), []).append((i, local))
    shared = [
        SharedParameter(name=names[places[0][0]][places[0][1]], stages=places)
        for places in holders.values()
        if len({stage for stage, _ in places}) > 1
    ]
    shared.sort(key=lambda s: s.name)
    return shared
