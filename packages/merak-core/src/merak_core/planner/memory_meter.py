"""Measured per-stage memory on any device: the bytes autograd saves and the state a rank holds.

:class:`SavedActivationMeter` counts the bytes of the tensors autograd saves for backward, per
stage, with ``torch.autograd.graph.saved_tensors_hooks`` (one count per storage, parameters
excluded; a tensor stops counting when autograd drops it); :func:`measure_held_bytes` the parameter,
gradient and optimizer-state bytes a rank holds (a DTensor counts its local shard); on CUDA,
:func:`cuda_peak_bytes` reads the allocator's peak for the whole rank instead.

Not done here: predictions (:mod:`merak_core.planner.memory`, which re-exports these names) and
running a step (:mod:`merak_core.planner.memory_check`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

__all__ = ["SavedActivationMeter", "cuda_peak_bytes", "measure_held_bytes"]


class _Saved:
    """What the pack hook gives autograd: the tensor, and a release of its count when autograd drops it."""

    __slots__ = ("meter", "stage", "key", "tensor", "__weakref__")

    def __init__(self, meter: SavedActivationMeter, stage: int, key: int, tensor: torch.Tensor) -> None:
        self.meter, self.stage, self.key, self.tensor = meter, stage, key, tensor

    def __del__(self) -> None:
        self.meter._release(self.stage, self.key)


class SavedActivationMeter:
    """Counts the bytes autograd saves for backward, per stage: live now and the peak so far.

    ``stage_modules`` maps a stage index to its module; an ``nn.Sequential`` stage is run unit by
    unit by merak-pipe, so every unit gets a forward pre-hook that makes its stage the current one
    (the loss, computed after the last unit, counts on the last stage). A storage saved twice counts
    once; parameters (and views of them) are not activations and do not count. Use as a context
    manager around the step; tensors saved inside a stage's checkpointed segment are dropped by that
    segment's own hook and never reach this one, a recompute's saved tensors do.
    """

    def __init__(
        self, stage_modules: Mapping[int, nn.Module], *, on_access: Callable[[], None] | None = None
    ) -> None:
        if not stage_modules:
            raise ValueError("SavedActivationMeter needs at least one stage module")
        self.stage_modules = dict(stage_modules)
        self._param_keys = {_storage_key(p) for m in self.stage_modules.values() for p in m.parameters()}
        self._unit_param_keys: set[int] = set()
        """The running unit's parameters as registered now: under ZeRO-2/3 (FSDP2) the gathered ones."""
        self._current = min(self.stage_modules)
        self._counts: dict[int, dict[int, list[int]]] = {
            s: {} for s in self.stage_modules
        }  # key -> [refs, bytes]
        self.live = dict.fromkeys(self.stage_modules, 0)
        self.peak = dict.fromkeys(self.stage_modules, 0)
        self.rank_peak = 0
        self._handles: list[Any] = []
        self._open: Any = None
        self._on_access = on_access
        """Called when a unit starts its forward and when backward reads a saved tensor (the moments
        FSDP2 holds a unit's gathered parameters): :func:`merak_core.planner.memory_check.measure_step`
        samples the gathered bytes there."""

    def _enter_stage(self, stage: int) -> Any:
        def hook(module: nn.Module, _args: Any) -> None:
            self._current = stage
            # Runs after FSDP2's pre-forward hook (registered earlier), which swapped in the gathered
            # parameters: autograd saving them is not an activation either.
            self._unit_param_keys = {_storage_key(p) for p in module.parameters()}
            if self._on_access is not None:
                self._on_access()

        return hook

    def _pack(self, tensor: torch.Tensor) -> Any:
        key = _storage_key(tensor)
        if (
            key in self._param_keys
            or key in self._unit_param_keys
            or tensor.device.type == "meta"
            or isinstance(tensor, nn.Parameter)
            or isinstance(tensor._base, nn.Parameter)
        ):
            return tensor
        stage = self._current
        entry = self._counts[stage].get(key)
        if entry is None:
            nbytes = tensor.untyped_storage().nbytes()
            self._counts[stage][key] = [1, nbytes]
            self.live[stage] += nbytes
            self.peak[stage] = max(self.peak[stage], self.live[stage])
            self.rank_peak = max(self.rank_peak, sum(self.live.values()))
        else:
            entry[0] += 1
        # Held detached: a saved output that kept its grad_fn would close a cycle through autograd's
        # graph (node -> saved value -> tensor -> node) that Python's GC cannot see, and a graph kept
        # for a split backward (retain_graph) would then never be freed.
        return _Saved(self, stage, key, tensor.detach())

    def _unpack(self, packed: Any) -> torch.Tensor:
        if self._on_access is not None:
            self._on_access()
        return packed.tensor if isinstance(packed, _Saved) else packed

    def _release(self, stage: int, key: int) -> None:
        entry = self._counts[stage].get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.live[stage] -= entry[1]
            del self._counts[stage][key]

    def start(self) -> None:
        """Begin counting (as entering :meth:`measuring`); :meth:`stop` ends it. For callers that see the
        step's start and end in two places (the plan check)."""
        self._open = self.measuring()
        self._open.__enter__()

    def stop(self) -> None:
        opened, self._open = self._open, None
        if opened is not None:
            opened.__exit__(None, None, None)

    @contextmanager
    def measuring(self) -> Iterator[SavedActivationMeter]:
        """Count inside this context (hooks on the stage units and the saved-tensor hooks)."""
        for stage, module in self.stage_modules.items():
            units = list(module) if isinstance(module, nn.Sequential) and len(module) else [module]
            for unit in units:
                self._handles.append(unit.register_forward_pre_hook(self._enter_stage(stage)))
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self
        finally:
            for handle in self._handles:
                handle.remove()
            self._handles.clear()


def _storage_key(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    try:
        return int(local.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return id(local)


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return int(local.numel() * local.element_size())


def _optimizer_states(optimizer: Any) -> Mapping[Any, Any]:
    inner = getattr(optimizer, "inner", None)  # ZeRO-1 wraps the optimizer of the owned shard
    return (inner if inner is not None else optimizer).state


def measure_held_bytes(
    stage_modules: Mapping[int, nn.Module], optimizer: Any = None
) -> dict[int, tuple[int, int, int]]:
    """Per stage: (parameter, gradient, optimizer-state) bytes held now, each storage once.

    A parameter held by two stages of the rank (one object) counts on the lower stage. Call it
    after a step (before gradients are cleared). DTensor (FSDP2) parameters count their local shard.
    """
    states = _optimizer_states(optimizer) if optimizer is not None else {}
    seen: set[int] = set()
    out: dict[int, tuple[int, int, int]] = {}
    for stage in sorted(stage_modules):
        p_bytes = g_bytes = o_bytes = 0
        for p in stage_modules[stage].parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            p_bytes += _local_bytes(p)
            if p.grad is not None:
                g_bytes += _local_bytes(p.grad)
            for value in states.get(p, {}).values():
                if isinstance(value, torch.Tensor):
                    o_bytes += _local_bytes(value)
        out[stage] = (p_bytes, g_bytes, o_bytes)
    return out


@contextmanager
def cuda_peak_bytes(device: torch.device) -> Iterator[dict[str, int]]:
    """On CUDA: the allocator's peak over the context, above what was allocated at its start.

    Yields a dict filled on exit with ``peak_bytes`` (``torch.cuda.max_memory_allocated`` after
    ``reset_peak_memory_stats``) and ``start_bytes``.
    """
    if device.type != "cuda":
        raise ValueError(
            f"cuda_peak_bytes measures a CUDA device; got {device} (use SavedActivationMeter on CPU)"
        )
    result: dict[str, int] = {}
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    result["start_bytes"] = torch.cuda.memory_allocated(device)
    try:
        yield result
    finally:
        torch.cuda.synchronize(device)
        result["peak_bytes"] = torch.cuda.max_memory_allocated(device)
