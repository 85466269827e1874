"""Partition a model into pipeline stages: trace, annotate, shard, assign shards to stages.

``partition(model, num_stages, ...)`` returns a ``Partition``: one
``StageModule`` per stage (shards keep their parameters under the original
fully-qualified names), the boundary description between stages, per-stage
cost and memory estimates, and the parameters shared across stages (tied
embeddings), detected from tensor identity in the traced graph, never from
shapes. ``Partition.build_stage(i, device=...)`` materialises one stage alone
for a model built under ``empty_init()``.

Methods: ``"uniform"`` (same number of shards per stage), ``"parameters"``
(balance parameter bytes) and ``"cost"`` (exact minimum of the slowest stage's
estimated time, see ``solver``), all respecting ``memory_limit``.

The three entry points start from a model, a traced graph or a chain of shards; each builds
one validated options object and hands it on (``_assign.py`` does the assignment, the
result types live in ``partition_result.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from merak_graph._assign import METHODS, PARAM_MEMORY_FACTOR, _Options, assign_stages
from merak_graph.costs import CostModel, annotate_costs
from merak_graph.errors import InputMismatchError
from merak_graph.partition_result import Partition, SharedParameter, StageInfo
from merak_graph.profiling import profile_shards
from merak_graph.sharding import ShardedGraph, natural_shard_count, shard
from merak_graph.tracing import LeafSpec, normalize_inputs, trace

__all__ = [
    "METHODS",
    "PARAM_MEMORY_FACTOR",
    "Partition",
    "SharedParameter",
    "StageInfo",
    "partition",
    "partition_sharded",
    "partition_traced",
]

logger = logging.getLogger(__name__)


def partition(
    model: nn.Module,
    num_stages: int,
    *,
    example_inputs: Sequence[Any] | Mapping[str, Any] | torch.Tensor | None = None,
    input_names: Sequence[str] | None = None,
    method: str = "cost",
    memory_limit: float | None = None,
    leaf_modules: Sequence[LeafSpec] = (),
    leaf_functions: Sequence[Callable[..., Any]] = (),
    split_points: Sequence[str] | None = None,
    num_shards: int | None = None,
    trace_method: str = "auto",
    static_kwargs: Mapping[str, Any] | None = None,
    cost_model: CostModel | None = None,
    param_memory_factor: float = PARAM_MEMORY_FACTOR,
    in_flight: str | Sequence[float] | None = None,
    balance_tolerance: float = 0.0,
    profile_device: torch.device | str | None = None,
) -> Partition:
    """Trace, cost-annotate, shard and partition ``model`` into ``num_stages`` pipeline stages.

    ``example_inputs`` (tuple in ``input_names`` order, or dict by name) give the shapes; meta tensors
    are fine and a model built under ``empty_init()`` is never materialised.
    ``method``: ``"cost"`` (minimise the slowest stage's estimated time), ``"parameters"`` or
    ``"uniform"``. ``memory_limit`` (bytes per stage) bounds ``param_bytes * param_memory_factor
    + activation_bytes * in_flight[i]``; ``in_flight="1f1b"`` counts ``S - i`` microbatches of
    activations on stage ``i``. ``num_shards`` defaults to one shard per natural cut (a position whose
    boundary is the smallest around it, e.g. every residual-stream point), at least 2 per stage; with
    ``method="cost"``, when that chain's optimum is more than 5% above its lower bound, finer shards
    (24 per stage) are tried and kept if they lower the slowest stage;
    ``split_points`` (module names) override the automatic cuts. ``leaf_modules`` and
    ``leaf_functions`` stay opaque calls (``trace``); the cost annotation runs them once on the
    example inputs. Among assignments whose slowest stage is within ``balance_tolerance`` (relative)
    of the optimum, the one with the smallest stage-to-stage boundary is returned (0: only exact
    optima). With ``profile_device``, shard costs are measured on that device (one shard
    materialised at a time) instead of estimated.
    """
    options = _options(method, memory_limit, param_memory_factor, in_flight, balance_tolerance)
    if num_stages < 1:
        raise ValueError(f"num_stages={num_stages} must be >= 1")
    if example_inputs is None:
        raise InputMismatchError("partition needs example_inputs (meta tensors are fine) to know the shapes")
    names, values, _ = normalize_inputs(model, example_inputs, input_names)
    assert values is not None
    gm = trace(
        model,
        example_inputs=example_inputs,
        input_names=input_names,
        leaf_modules=leaf_modules,
        method=trace_method,
        static_kwargs=static_kwargs,
        leaf_functions=leaf_functions,
    )
    annotate_costs(gm, values, cost_model=cost_model)
    inputs = _real_inputs(values, profile_device)
    return _partition_graph(gm, num_stages, options, model, num_shards, split_points, profile_device, inputs)


def _real_inputs(values: Sequence[Any], device: torch.device | str | None) -> list[Any] | None:
    """Example inputs usable for profiling: meta tensors become zeros (ints) or normal noise (floats)."""
    if device is None:
        return None
    out: list[Any] = []
    for v in values:
        if isinstance(v, torch.Tensor) and v.is_meta:
            v = (
                torch.randn(v.shape, dtype=v.dtype)
                if v.is_floating_point()
                else torch.zeros(v.shape, dtype=v.dtype)
            )
        out.append(v)
    return out


def partition_traced(
    gm: fx.GraphModule,
    num_stages: int,
    *,
    model: nn.Module | None = None,
    num_shards: int | None = None,
    split_points: Sequence[str] | None = None,
    method: str = "cost",
    memory_limit: float | None = None,
    param_memory_factor: float = PARAM_MEMORY_FACTOR,
    in_flight: str | Sequence[float] | None = None,
    balance_tolerance: float = 0.0,
    profile_device: torch.device | str | None = None,
    profile_inputs: Sequence[Any] | None = None,
) -> Partition:
    """Shard and partition a traced, cost-annotated graph (``partition`` without the tracing step).

    With ``profile_device``, shard costs are measured there (``profile_shards``) on
    ``profile_inputs`` instead of estimated.
    """
    options = _options(method, memory_limit, param_memory_factor, in_flight, balance_tolerance)
    return _partition_graph(
        gm, num_stages, options, model, num_shards, split_points, profile_device, profile_inputs
    )


def partition_sharded(
    sharded: ShardedGraph,
    num_stages: int,
    *,
    method: str = "cost",
    memory_limit: float | None = None,
    param_memory_factor: float = PARAM_MEMORY_FACTOR,
    in_flight: str | Sequence[float] | None = None,
    model: nn.Module | None = None,
    balance_tolerance: float = 0.0,
) -> Partition:
    """Assign the shards of ``sharded`` to ``num_stages`` contiguous stages (see ``partition``)."""
    options = _options(method, memory_limit, param_memory_factor, in_flight, balance_tolerance)
    return assign_stages(sharded, num_stages, options, model)


def _options(
    method: str,
    memory_limit: float | None,
    param_memory_factor: float,
    in_flight: str | Sequence[float] | None,
    balance_tolerance: float,
) -> _Options:
    """The entry points' assignment choices, validated (positional: each entry point passes its own)."""
    return _Options(
        method=method,
        memory_limit=memory_limit,
        param_memory_factor=param_memory_factor,
        in_flight=in_flight,
        balance_tolerance=balance_tolerance,
    )


def _partition_graph(
    gm: fx.GraphModule,
    num_stages: int,
    options: _Options,
    model: nn.Module | None,
    num_shards: int | None,
    split_points: Sequence[str] | None,
    profile_device: torch.device | str | None,
    profile_inputs: Sequence[Any] | None,
) -> Partition:
    """The one path from a traced graph to a partition: shard (finer where it pays), then assign."""
    auto = num_shards is None and not split_points

    def make_shards(count: int | None) -> ShardedGraph:
        sharded = shard(gm, count, split_points=split_points, model=model)
        if profile_device is not None:
            if profile_inputs is None:
                raise ValueError("profile_device needs profile_inputs (real tensors)")
            profile_shards(sharded, profile_inputs, device=profile_device)
        return sharded

    if auto:
        num_shards = max(natural_shard_count(gm), 2 * num_stages)
    result = assign_stages(make_shards(num_shards), num_stages, options, model)
    if auto and options.method == "cost" and _imbalance(result) > _REFINE_ABOVE:
        # Natural cuts are too coarse for this stage count: retry with finer shards, keep the better.
        finer = assign_stages(make_shards(_FINE_SHARDS_PER_STAGE * num_stages), num_stages, options, model)
        if max(finer.stage_costs) < max(result.stage_costs) * (1 - _REFINE_MIN_GAIN):
            logger.info(
                "finer shards improve the slowest stage from %.4g to %.4g s",
                max(result.stage_costs),
                max(finer.stage_costs),
            )
            result = finer
    return result


_REFINE_ABOVE = 1.05  # slowest/mean above which the automatic shard count is refined
_FINE_SHARDS_PER_STAGE = 24
_REFINE_MIN_GAIN = 0.02  # finer shards (larger boundaries) must lower the slowest stage by 2%


def _imbalance(part: Partition) -> float:
    costs = part.stage_costs
    mean = sum(costs) / len(costs)
    if mean <= 0:
        return 1.0
    bound = max(1.0, max(s.time_s for s in part.shards) / mean)
    return max(costs) / mean / bound
