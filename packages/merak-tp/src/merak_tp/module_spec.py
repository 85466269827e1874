"""Typed record of what merak-tp made of a module: a region, a sequence boundary, sharded experts.

[Note: module specs] ``make_region``, ``make_sequence_scatter`` / ``make_sequence_gather`` and
``shard_experts`` give a module a subclass of its class (so its forward gains the TP behaviour)
that needs a little data per module: the TP group, the sequence dim, the region's run-time state.
That data is one frozen :class:`ModuleSpec` per module, read with :func:`get_module_spec` and
written with :func:`set_module_spec`. It lives in a registry keyed weakly by the module, never in
the module's own attributes: nothing is written into a user's module. ``copy.deepcopy`` of a
module made by merak-tp copies its spec (:func:`deepcopy_module`, used by the classes'
``__deepcopy__``); a pickled module does not carry it.

The parallel layers (``ColumnParallelLinear``...) are merak-tp's own classes: their options are
declared attributes, and their shard metadata is each parameter's ``ShardSpec``.
"""

from __future__ import annotations

import copy
import dataclasses
import weakref
from dataclasses import dataclass
from typing import Any, Literal

from torch import nn
from torch.distributed import ProcessGroup

from merak_tp._events import _GroupRef, _RegionState
from merak_tp.shard_spec import get_shard_spec, has_shard_spec, set_shard_spec

__all__ = ["ModuleSpec", "SequenceBoundary", "deepcopy_module", "get_module_spec", "set_module_spec"]


@dataclass(frozen=True)
class SequenceBoundary:
    """The module's first input enters (scatter) or leaves (gather) sequence parallelism on entry."""

    group_ref: _GroupRef
    sequence_dim: int
    kind: Literal["scatter", "gather"]
    """``scatter``: split along the sequence; ``gather``: all-gathered, full sequence from here on."""

    @property
    def group(self) -> ProcessGroup | None:
        return self.group_ref.group


@dataclass(frozen=True)
class ModuleSpec:
    """What merak-tp made of one module (see [Note: module specs]); every field None: nothing."""

    region: _RegionState | None = None
    """A TP region (``make_region``): its options and run-time state, shared with its layers."""
    sequence: SequenceBoundary | None = None
    """A sequence-parallel boundary (``make_sequence_scatter`` / ``make_sequence_gather``)."""
    experts_group: _GroupRef | None = None
    """Sharded experts (``shard_experts``) over this TP group."""

    def replace(self, **changes: Any) -> ModuleSpec:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    @property
    def empty(self) -> bool:
        return self.region is None and self.sequence is None and self.experts_group is None


_SPECS: weakref.WeakKeyDictionary[nn.Module, ModuleSpec] = weakref.WeakKeyDictionary()


def get_module_spec(module: nn.Module) -> ModuleSpec:
    """The module's :class:`ModuleSpec` (an empty one for a module merak-tp did not change)."""
    return _SPECS.get(module, _EMPTY)


def set_module_spec(module: nn.Module, spec: ModuleSpec) -> None:
    """Record ``spec`` for ``module`` (an empty spec removes the record)."""
    if spec.empty:
        _SPECS.pop(module, None)
    else:
        _SPECS[module] = spec


def deepcopy_module(module: Any, memo: dict[int, Any]) -> Any:
    """``copy.deepcopy`` of a module merak-tp changed, keeping what the copy would lose.

    The module's attributes are copied through ``memo`` (shared objects stay shared: a region's
    state with its layers, tied parameters), its :class:`ModuleSpec` is copied the same way, and the
    ``ShardSpec`` of each of its own parameters is set again (``nn.Parameter``'s deepcopy drops
    Python attributes).
    """
    cls: Any = type(module)
    result = cls.__new__(cls)
    memo[id(module)] = result
    for key, value in module.__dict__.items():
        object.__setattr__(result, key, copy.deepcopy(value, memo))
    for name, param in module.__dict__.get("_parameters", {}).items():
        new = result._parameters.get(name)
        if param is not None and new is not None and has_shard_spec(param):
            set_shard_spec(new, get_shard_spec(param))
    spec = _SPECS.get(module)
    if spec is not None:
        _SPECS[result] = copy.deepcopy(spec, memo)
    return result


_EMPTY = ModuleSpec()
