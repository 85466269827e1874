"""The result of partitioning: stage modules, per-stage estimates, shared parameters, name maps.

A :class:`Partition` is built by ``merak_graph.partition`` (and its two lower-level entry
points); ``Partition.build_stage(i, device=...)`` materialises one stage alone for a model built
under ``empty_init()``; ``Partition.keeping_only(stages)`` is the partition a process holds once it
has built its own stages. A partition is never changed in place (a frozen dataclass). This module
does no partitioning itself (``_assign.py`` does).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from merak_graph.empty import _copy_stash, _keep_grad_hooks, is_meta_module, materialize
from merak_graph.errors import InputMismatchError
from merak_graph.sharding import BoundaryValue, Shard, ShardedGraph, _attribute_candidates
from merak_graph.stage import StageModule, retarget_devices

__all__ = ["Partition", "SharedParameter", "StageInfo"]


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


@dataclass(frozen=True)
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

    def keeping_only(self, kept: Mapping[int, nn.Module]) -> Partition:
        """A partition holding only ``kept`` (stage index -> the module that now runs that stage).

        Every other stage becomes an empty ``StageModule`` and the model reference is dropped, so the
        new partition keeps none of their tensors alive: what a process holds once it has built its
        own stages (pipeline ranks). Names, estimates and shared parameters are unchanged; this
        partition is left as it is.
        """
        bad = sorted(i for i in kept if not 0 <= i < self.num_stages)
        if bad:
            raise ValueError(f"stage indices {bad} are out of range for {self.num_stages} stages")
        stages: list[Any] = [kept.get(i, StageModule()) for i in range(self.num_stages)]
        return dataclasses.replace(self, stages=stages, model=None)

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
        memo: dict[int, Any] = {}
        stage = copy.deepcopy(self.stages[stage_index], memo)
        for p in self.stages[stage_index].parameters():
            if id(p) in memo:  # a copied parameter runs its original's gradient hooks
                _keep_grad_hooks(p, memo[id(p)])
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
            from merak_graph.empty import _SafetensorsReader

            keys = _SafetensorsReader(safetensors_path, device).keys
            available |= {k for k in needed if k in keys}
        missing = [k for k in needed if k not in available]
        if missing:
            values.update(self._initial_values(missing, device, init_fn))
        materialize(
            stage,
            device=device,
            state_dict=values,
            safetensors_path=safetensors_path,
            name_map=full_map,
            strict=True,
        )
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
                        from merak_graph.empty import stashed_buffer_value

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
            local = {
                **dict(clone.named_parameters(recurse=False)),
                **dict(clone.named_buffers(recurse=False)),
            }
            for name in members:
                out[name] = local[name.rpartition(".")[2]].detach()
        return out

    def summary(self) -> str:
        """A table of stages: shards, time, flops, parameter and memory estimates, boundary."""
        lines = [
            f"{'stage':>5} {'shards':>9} {'time_ms':>9} {'GFLOP':>10} {'params_MiB':>11} "
            f"{'mem_MiB':>10}  outputs"
        ]
        for s in self.stage_info:
            outs = ", ".join(f"{b.name}{list(b.shape)}" for b in s.outputs)
            lines.append(
                f"{s.index:>5} {s.shard_range[0]:>4}-{s.shard_range[1] - 1:<4} {s.time_s * 1e3:>9.3f} "
                f"{s.flops / 1e9:>10.3f} {s.param_bytes / 2**20:>11.2f} {s.memory_bytes / 2**20:>10.2f}  {outs}"
            )
        return "\n".join(lines)


def _get_tensor(gm: fx.GraphModule, model: nn.Module | None, name: str) -> torch.Tensor:
    for value, _, _ in _attribute_candidates(gm, model, name):
        if isinstance(value, torch.Tensor):
            return value
    raise KeyError(name)


def _shallow_owner_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` with its own tensors copied (meta) and its children dropped."""
    clone = copy.copy(module)
    clone._parameters = {
        k: (None if v is None else nn.Parameter(v.detach().clone(), v.requires_grad))
        for k, v in module._parameters.items()
    }
    clone._buffers = {k: (None if v is None else v.detach().clone()) for k, v in module._buffers.items()}
    clone._modules = {}
    _copy_stash(module, clone)
    return clone


def _all_local_names(copied: nn.Module, original: nn.Module, canonical: Mapping[str, str]) -> dict[str, str]:
    """Map every local tensor name in ``copied`` (including tied duplicates) to its original name."""
    by_id: dict[int, str] = {}
    for name, t in [
        *original.named_parameters(remove_duplicate=False),
        *original.named_buffers(remove_duplicate=False),
    ]:
        if name in canonical:
            by_id[id(t)] = canonical[name]
    out: dict[str, str] = {}
    for name, t in [
        *original.named_parameters(remove_duplicate=False),
        *original.named_buffers(remove_duplicate=False),
    ]:
        if id(t) in by_id:
            out[name] = by_id[id(t)]
    del copied
    return out


def _load_into(
    stage: nn.Module,
    full_map: Mapping[str, str],
    state_dict: Mapping[str, torch.Tensor] | None,
    safetensors_path: str | None,
) -> None:
    reader = None
    if safetensors_path is not None:
        from merak_graph.empty import _SafetensorsReader

        reader = _SafetensorsReader(safetensors_path, torch.device("cpu"))
    with torch.no_grad():
        for local, t in [*stage.named_parameters(), *stage.named_buffers()]:
            key = full_map.get(local, local)
            value = state_dict.get(key) if state_dict is not None else None
            if value is None and reader is not None:
                value = reader.get(key)
            if value is not None:
                t.copy_(value)
