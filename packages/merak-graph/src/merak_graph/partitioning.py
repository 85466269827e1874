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
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from .costs import CostModel, annotate_costs
from .empty import _copy_stash, is_meta_module, materialize
from .errors import InputMismatchError, PartitionError
from .profiling import profile_shards
from .sharding import BoundaryValue, Shard, ShardedGraph, natural_shard_count, shard
from .solver import (
    optimal_contiguous_partition,
    smallest_boundary_partition,
    stage_bounds_cost,
    uniform_partition,
)
from .stage import StageModule, retarget_devices
from .tracing import LeafSpec, normalize_inputs, trace

__all__ = ["PARAM_MEMORY_FACTOR", "Partition", "SharedParameter", "StageInfo", "partition", "partition_sharded",
           "partition_traced"]

logger = logging.getLogger(__name__)

METHODS = ("cost", "uniform", "parameters")

PARAM_MEMORY_FACTOR = 4.0
"""Default bytes held per parameter byte: the weight, its gradient and two Adam moments."""


@dataclass(frozen=True)
class SharedParameter:
    """One logical parameter held by several stages (e.g. tied input/output embeddings)."""

    name: str
    """The parameter's original name (its first name in ``model.named_parameters()``)."""
    stages: list[tuple[int, str]]
    """(stage_index, local name in that stage module) for every stage holding it."""


@dataclass(frozen=True)
class StageInfo:
    """Description of one stage: shard range, boundaries, estimates."""

    index: int
    shard_range: tuple[int, int]
    inputs: list[BoundaryValue]
    outputs: list[BoundaryValue]
    time_s: float
    flops: int
    param_bytes: int
    activation_bytes: int
    memory_bytes: float
    """param_bytes * param_memory_factor + activation_bytes * in-flight microbatches."""


@dataclass
class Partition:
    """The result of ``partition``: stage modules plus everything needed to run and place them."""

    stages: list[StageModule]
    stage_info: list[StageInfo]
    shared_parameters: list[SharedParameter]
    sharded: ShardedGraph
    bounds: list[int]
    method: str
    input_names: list[str]
    model: nn.Module | None = None
    _names: list[dict[str, str]] = field(default_factory=list)
    _buffer_names: list[dict[str, str]] = field(default_factory=list)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def shards(self) -> list[Shard]:
        return self.sharded.shards

    @property
    def graph_module(self) -> fx.GraphModule:
        return self.sharded.graph_module

    @property
    def stage_costs(self) -> list[float]:
        return [s.time_s for s in self.stage_info]

    @property
    def stage_memory(self) -> list[float]:
        return [s.memory_bytes for s in self.stage_info]

    @property
    def boundaries(self) -> list[list[BoundaryValue]]:
        """boundaries[i]: the values stage i sends to stage i+1 (i < num_stages - 1)."""
        return [s.outputs for s in self.stage_info[:-1]]

    def stage_parameter_names(self, stage_index: int) -> dict[str, str]:
        """{local name in ``stages[stage_index]``: original parameter name}, one entry per tensor."""
        return dict(self._names[stage_index])

    def stage_buffer_names(self, stage_index: int) -> dict[str, str]:
        """{local name in ``stages[stage_index]``: original buffer/constant name}."""
        return dict(self._buffer_names[stage_index])

    def run(self, *inputs: Any) -> Any:
        """Run all stages in sequence in this process (for checks and tests)."""
        if len(inputs) != len(self.input_names):
            raise InputMismatchError(
                f"the partitioned model takes {len(self.input_names)} inputs {self.input_names}, got {len(inputs)}"
            )
        values: Any = inputs
        for i, stage in enumerate(self.stages):
            values = stage(*values)
            if i < len(self.stages) - 1 and not isinstance(values, tuple):
                values = (values,)
        return values

    def build_stage(
        self,
        stage_index: int,
        *,
        device: torch.device | str,
        init_fn: Callable[[nn.Module], Any] | None = None,
        state_dict: Mapping[str, torch.Tensor] | None = None,
        safetensors_path: str | None = None,
    ) -> StageModule:
        """A fresh copy of one stage with real tensors on ``device``; other stages allocate nothing.

        Tensors come from ``state_dict`` / ``safetensors_path`` by original name (only this stage's
        keys are read); the rest are initialised by their owning modules' ``reset_parameters`` or
        ``init_fn(module)``, buffers computed by constructors under ``empty_init`` are restored.
        Tied parameters inside the stage stay tied.
        """
        if not 0 <= stage_index < self.num_stages:
            raise ValueError(f"stage_index={stage_index} is out of range for {self.num_stages} stages")
        device = torch.device(device)
        stage = copy.deepcopy(self.stages[stage_index])
        names = {**self._buffer_names[stage_index], **self._names[stage_index]}
        # Every local name (ties included) -> original name.
        full_map = _all_local_names(stage, self.stages[stage_index], names)
        retarget_devices(stage, device)
        if not is_meta_module(stage):
            stage.to(device)
            if state_dict is not None or safetensors_path is not None:
                _load_into(stage, full_map, state_dict, safetensors_path)
            return stage
        values: dict[str, torch.Tensor] = {}
        needed = sorted(set(full_map.values()))
        if state_dict is not None:
            values.update({k: state_dict[k] for k in needed if k in state_dict})
        available: set[str] = set(values)
        if safetensors_path is not None:
            from .empty import _SafetensorsReader

            keys = _SafetensorsReader(safetensors_path, device).keys
            available |= {k for k in needed if k in keys}
        missing = [k for k in needed if k not in available]
        if missing:
            values.update(self._initial_values(missing, device, init_fn))
        materialize(stage, device=device, state_dict=values, safetensors_path=safetensors_path,
                    name_map=full_map, strict=True)
        return stage

    def _initial_values(
        self, names: list[str], device: torch.device, init_fn: Callable[[nn.Module], Any] | None
    ) -> dict[str, torch.Tensor]:
        """Initialise tensors by running their owning modules' initialisers on a materialised copy."""
        if self.model is None:
            raise ValueError("this partition has no model reference: pass state_dict or safetensors_path")
        by_owner: dict[str, list[str]] = {}
        for name in names:
            owner, _, _leaf = name.rpartition(".")
            by_owner.setdefault(owner, []).append(name)
        out: dict[str, torch.Tensor] = {}
        for owner_name, members in by_owner.items():
            try:
                original = self.model.get_submodule(owner_name) if owner_name else self.model
            except AttributeError:
                original = None
            if original is None or owner_name == "" and len(list(original.children())) > 0:
                # A root-level tensor (or a graph constant): copy just that tensor.
                for name in members:
                    tensor = _get_tensor(self.graph_module, self.model, name)
                    if tensor.is_meta:
                        from .empty import stashed_buffer_value

                        value = stashed_buffer_value(self.model, name) if "." not in name else None
                        if value is None:
                            raise ValueError(
                                f"tensor {name!r} is on the meta device and has no initialiser: pass it in "
                                "state_dict / safetensors_path"
                            )
                        out[name] = value.to(device)
                    else:
                        out[name] = tensor.detach().to(device)
                continue
            clone = _shallow_owner_copy(original)
            materialize(clone, device=device, init_fn=init_fn)
            local = {**dict(clone.named_parameters(recurse=False)), **dict(clone.named_buffers(recurse=False))}
            for name in members:
                out[name] = local[name.rpartition(".")[2]].detach()
        return out

    def summary(self) -> str:
        """A table of stages: shards, time, flops, parameter and memory estimates, boundary."""
        lines = [f"{'stage':>5} {'shards':>9} {'time_ms':>9} {'GFLOP':>10} {'params_MiB':>11} "
                 f"{'mem_MiB':>10}  outputs"]
        for s in self.stage_info:
            outs = ", ".join(f"{b.name}{list(b.shape)}" for b in s.outputs)
            lines.append(
                f"{s.index:>5} {s.shard_range[0]:>4}-{s.shard_range[1] - 1:<4} {s.time_s * 1e3:>9.3f} "
                f"{s.flops / 1e9:>10.3f} {s.param_bytes / 2**20:>11.2f} {s.memory_bytes / 2**20:>10.2f}  {outs}"
            )
        return "\n".join(lines)


def _get_tensor(gm: fx.GraphModule, model: nn.Module | None, name: str) -> torch.Tensor:
    for source in (model, gm):
        if source is None:
            continue
        try:
            *prefix, last = name.split(".")
            owner = source.get_submodule(".".join(prefix)) if prefix else source
            value = getattr(owner, last)
            if isinstance(value, torch.Tensor):
                return value
        except AttributeError:
            continue
    raise KeyError(name)


def _shallow_owner_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` with its own tensors copied (meta) and its children dropped."""
    clone = copy.copy(module)
    clone._parameters = {k: (None if v is None else nn.Parameter(v.detach().clone(), v.requires_grad))
                         for k, v in module._parameters.items()}
    clone._buffers = {k: (None if v is None else v.detach().clone()) for k, v in module._buffers.items()}
    clone._modules = {}
    _copy_stash(module, clone)
    return clone


def _all_local_names(copied: nn.Module, original: nn.Module, canonical: Mapping[str, str]) -> dict[str, str]:
    """Map every local tensor name in ``copied`` (including tied duplicates) to its original name."""
    by_id: dict[int, str] = {}
    for name, t in [*original.named_parameters(remove_duplicate=False), *original.named_buffers(remove_duplicate=False)]:
        if name in canonical:
            by_id[id(t)] = canonical[name]
    out: dict[str, str] = {}
    for name, t in [*original.named_parameters(remove_duplicate=False), *original.named_buffers(remove_duplicate=False)]:
        if id(t) in by_id:
            out[name] = by_id[id(t)]
    del copied
    return out


def _load_into(stage: nn.Module, full_map: Mapping[str, str], state_dict: Mapping[str, torch.Tensor] | None,
               safetensors_path: str | None) -> None:
    reader = None
    if safetensors_path is not None:
        from .empty import _SafetensorsReader

        reader = _SafetensorsReader(safetensors_path, torch.device("cpu"))
    with torch.no_grad():
        for local, t in [*stage.named_parameters(), *stage.named_buffers()]:
            key = full_map.get(local, local)
            value = state_dict.get(key) if state_dict is not None else None
            if value is None and reader is not None:
                value = reader.get(key)
            if value is not None:
                t.copy_(value)


def _canonical_names(model: nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        names.setdefault(id(t), name)
    return names


def _in_flight(num_stages: int, schedule: str | Sequence[float] | None) -> list[float]:
    if schedule is None or schedule == "none":
        return [1.0] * num_stages
    if schedule == "1f1b":
        return [float(num_stages - i) for i in range(num_stages)]
    if isinstance(schedule, str):
        raise ValueError(f"in_flight={schedule!r} must be None, 'none', '1f1b' or a list with one number per stage")
    values = [float(x) for x in schedule]
    if len(values) != num_stages:
        raise ValueError(f"in_flight has {len(values)} entries, expected {num_stages} (one per stage)")
    return values


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
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not one of {METHODS}")
    if num_stages < 1:
        raise ValueError(f"num_stages={num_stages} must be >= 1")
    if balance_tolerance < 0:
        raise ValueError(f"balance_tolerance={balance_tolerance} must be >= 0 (0 keeps the exact optimum)")
    shards = sharded.shards
    if len(shards) < num_stages:
        raise PartitionError(
            f"the graph was cut into only {len(shards)} shards ({sharded.valid_positions} valid cut positions) "
            f"but num_stages={num_stages}: use at most {len(shards)} stages, give more split_points, or fewer "
            "leaf_modules so the graph has more places to cut"
        )
    flight = _in_flight(num_stages, in_flight)
    pm = [s.param_bytes * param_memory_factor for s in shards]
    am = [float(s.activation_bytes) for s in shards]
    if method == "uniform":
        bounds = uniform_partition(len(shards), num_stages)
    else:
        costs = [s.time_s for s in shards] if method == "cost" else [float(s.param_bytes) for s in shards]
        bounds = optimal_contiguous_partition(
            costs, num_stages, param_memory=pm, activation_memory=am, in_flight=flight, memory_limit=memory_limit,
        )
        # Among (near-)optimal assignments, prefer the smallest stage-to-stage boundaries (p2p volume).
        slowest = max(stage_bounds_cost(costs, bounds))
        cut_bytes = [float(sum(b.nbytes for b in s.outputs)) for s in shards]
        better = smallest_boundary_partition(
            costs, num_stages, cut_bytes, slowest * (1.0 + balance_tolerance) + 1e-12 * abs(slowest),
            param_memory=pm, activation_memory=am, in_flight=flight, memory_limit=memory_limit,
        )
        if better is not None:
            bounds = better
    if memory_limit is not None:
        for i in range(num_stages):
            mem = sum(pm[bounds[i]:bounds[i + 1]]) + flight[i] * sum(am[bounds[i]:bounds[i + 1]])
            if mem > memory_limit:
                raise PartitionError(
                    f"method={method!r} puts {mem:.4g} bytes on stage {i}, over memory_limit={memory_limit:.4g}: "
                    "use method='cost', raise memory_limit or add stages"
                )

    canonical = _canonical_names(model) if model is not None else {}
    stages: list[StageModule] = []
    infos: list[StageInfo] = []
    names: list[dict[str, str]] = []
    buffer_names: list[dict[str, str]] = []
    holders: dict[int, list[tuple[int, str]]] = {}
    param_ids: set[int] = set()
    for i in range(num_stages):
        lo, hi = bounds[i], bounds[i + 1]
        group = shards[lo:hi]
        stage = StageModule(
            *[s.module for s in group], input_names=[b.name for b in group[0].inputs], input_specs=group[0].inputs,
            strict_shapes=sharded.graph_module.meta.get("merak_trace_method") == "export",
        )
        stages.append(stage)
        pnames: dict[str, str] = {}
        for local, t in stage.named_parameters():
            original = canonical.get(id(t), local.split(".", 1)[1])
            pnames[local] = original
            holders.setdefault(id(t), []).append((i, local))
            param_ids.add(id(t))
        bnames = {local: canonical.get(id(t), local.split(".", 1)[1]) for local, t in stage.named_buffers()}
        names.append(pnames)
        buffer_names.append(bnames)
        seen: set[int] = set()
        pbytes = 0
        for tensor in [*stage.parameters(), *stage.buffers()]:
            if id(tensor) not in seen:
                seen.add(id(tensor))
                pbytes += tensor.numel() * tensor.element_size()
        abytes = sum(s.activation_bytes for s in group)
        infos.append(StageInfo(
            index=i, shard_range=(lo, hi), inputs=group[0].inputs, outputs=group[-1].outputs,
            time_s=float(sum(stage_bounds_cost([s.time_s for s in shards], [lo, hi]))),
            flops=sum(s.flops for s in group), param_bytes=pbytes, activation_bytes=abytes,
            memory_bytes=pbytes * param_memory_factor + flight[i] * abytes,
        ))
    shared = []
    for places in holders.values():
        if len({stage for stage, _ in places}) > 1:
            shared.append(SharedParameter(name=names[places[0][0]][places[0][1]], stages=places))
    shared.sort(key=lambda s: s.name)
    logger.info("partitioned into %d stages (%s): stage times %s", num_stages, method,
                [f"{x.time_s:.3g}" for x in infos])
    return Partition(stages=stages, stage_info=infos, shared_parameters=shared, sharded=sharded, bounds=bounds,
                     method=method, input_names=list(sharded.input_names), model=model,
                     _names=names, _buffer_names=buffer_names)


def partition(
    model: nn.Module,
    num_stages: int,
    *,
    example_inputs: Sequence[Any] | Mapping[str, Any] | torch.Tensor | None = None,
    input_names: Sequence[str] | None = None,
    method: str = "cost",
    memory_limit: float | None = None,
    leaf_modules: Sequence[LeafSpec] = (),
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
    ``split_points`` (module names) override the automatic cuts. Among assignments whose slowest
    stage is within ``balance_tolerance`` (relative) of the optimum, the one with the smallest
    stage-to-stage boundary is returned (0: only exact optima). With ``profile_device``, shard
    costs are measured on that device (one shard materialised at a time) instead of estimated.
    """
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not one of {METHODS}")
    if num_stages < 1:
        raise ValueError(f"num_stages={num_stages} must be >= 1")
    if example_inputs is None:
        raise InputMismatchError("partition needs example_inputs (meta tensors are fine) to know the shapes")
    names, values, _ = normalize_inputs(model, example_inputs, input_names)
    assert values is not None
    gm = trace(model, example_inputs=example_inputs, input_names=input_names, leaf_modules=leaf_modules,
               method=trace_method, static_kwargs=static_kwargs)
    annotate_costs(gm, values, cost_model=cost_model)
    return partition_traced(gm, num_stages, model=model, num_shards=num_shards, split_points=split_points,
                            method=method, memory_limit=memory_limit, param_memory_factor=param_memory_factor,
                            in_flight=in_flight, balance_tolerance=balance_tolerance,
                            profile_device=profile_device, profile_inputs=_real_inputs(values, profile_device))


def _real_inputs(values: Sequence[Any], device: torch.device | str | None) -> list[Any] | None:
    """Example inputs usable for profiling: meta tensors become zeros (ints) or normal noise (floats)."""
    if device is None:
        return None
    out: list[Any] = []
    for v in values:
        if isinstance(v, torch.Tensor) and v.is_meta:
            v = torch.randn(v.shape, dtype=v.dtype) if v.is_floating_point() else torch.zeros(v.shape, dtype=v.dtype)
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
    kwargs: dict[str, Any] = dict(method=method, memory_limit=memory_limit, param_memory_factor=param_memory_factor,
                                  in_flight=in_flight, model=model, balance_tolerance=balance_tolerance)
    result = partition_sharded(make_shards(num_shards), num_stages, **kwargs)
    if auto and method == "cost" and _imbalance(result) > _REFINE_ABOVE:
        # Natural cuts are too coarse for this stage count: retry with finer shards, keep the better.
        finer = partition_sharded(make_shards(_FINE_SHARDS_PER_STAGE * num_stages), num_stages, **kwargs)
        if max(finer.stage_costs) < max(result.stage_costs) * (1 - _REFINE_MIN_GAIN):
            logger.info("finer shards improve the slowest stage from %.4g to %.4g s",
                        max(result.stage_costs), max(finer.stage_costs))
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
