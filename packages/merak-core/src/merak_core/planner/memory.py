"""Per-stage peak memory: predicted from a profile and a schedule, and measured from a run.

A stage's peak is what its rank holds for it at the step's worst moment: parameters, gradients and
optimizer states (each under the ZeRO stage in use, see :func:`model_state_bytes`) plus the peak of
the activations autograd keeps for backward, with the schedule's microbatches in flight and the
stage's recomputation (the simulator's memory model, :func:`merak_pipe.simulate`: a recomputing
stage keeps its input and a ``1 - f`` share per microbatch and re-creates ``f`` for one microbatch
at a time). :func:`predict_stage_memory` computes it from a :class:`ModelProfile` for a layout;
the planner uses the same terms to reject what does not fit ``memory_per_device``.

Measured (:class:`SavedActivationMeter`, :func:`measure_held_bytes`): on any device, the bytes of
the tensors autograd saves, counted per stage with ``torch.autograd.graph.saved_tensors_hooks``
(one count per storage, parameters excluded; a tensor stops counting when autograd drops it), plus
the parameter, gradient and optimizer-state bytes the rank holds after a step. On CUDA,
:func:`cuda_peak_bytes` reads the allocator's peak for the whole rank instead (several stages of
one rank are not told apart there).

[Note: peak as a sum] The predicted and the measured peak are both the held state plus the
activation peak. Gradients only appear with the first backward, when activations start to be
freed, so the true simultaneous peak (the allocator's) can be lower than this sum; never higher,
except for the allocator's fragmentation and workspaces, which neither count.

Not done here: temporaries inside one operator (matmul workspaces, the logits' softmax), memory
of communication buffers, and CPU offload.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from merak_core.planner.profile import ModelProfile
from merak_pipe import schedule_info

__all__ = [
    "ZERO_STAGES",
    "SavedActivationMeter",
    "StageMemory",
    "compare_stage_memory",
    "cuda_peak_bytes",
    "measure_held_bytes",
    "model_state_bytes",
    "predict_stage_memory",
    "relative_errors",
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


def model_state_bytes(
    param_bytes: float,
    *,
    zero_stage: int,
    dp: int,
    optimizer_state_factor: float = 2.0,
    largest_unit_bytes: float = 0.0,
) -> tuple[float, float, float]:
    """(parameter, gradient, optimizer-state) bytes a rank holds for ``param_bytes`` of its stage at the peak.

    ``optimizer_state_factor``: optimizer-state bytes per parameter byte (2 for Adam's moments in the
    parameter dtype). ZeRO-1 shards the optimizer states over ``dp``; ZeRO-2 and ZeRO-3 (FSDP2, see
    :mod:`merak_core.fsdp`) also keep parameters and gradients sharded between steps, but within a
    step they hold the accumulated gradients unsharded until the one reduce-scatter after the last
    backward ([Note: one gradient sync per step] there); ZeRO-2 keeps each unit's parameters gathered
    from its first forward to that reduce-scatter, ZeRO-3 gathers one unit (``largest_unit_bytes``)
    at a time on top of its shards.
    """
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage={zero_stage!r}; expected one of {ZERO_STAGES}")
    if not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp={dp!r}; expected an int >= 1")
    p = float(param_bytes)
    optimizer = p * optimizer_state_factor / (dp if zero_stage >= 1 else 1)
    if zero_stage <= 1 or dp == 1:
        return p, p, optimizer
    shard = p / dp
    if zero_stage == 2:
        return shard + p, p, optimizer
    return shard + min(float(largest_unit_bytes), p), p, optimizer


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
    costs = CostModel(forward=1.0, backward=2.0, recompute=1.0, activation_bytes=acts, input_bytes=boundary)
    peaks = simulate(sched, costs).peak_memory
    out = []
    for s, r in enumerate(ranges):
        params = sum(profile.layer_param_bytes[i] for i in r)
        first_and_last = 0 in r and profile.num_layers - 1 in r
        if first_and_last:
            params -= profile.shared_param_bytes
        elif _holds_other_copy(s, placement, ranges, profile.num_layers):
            params -= profile.shared_param_bytes  # the rank's other stage holds the one local copy
        unit = max((profile.layer_param_bytes[i] for i in r), default=0.0) / tp
        p, g, o = model_state_bytes(
            params / tp,
            zero_stage=zero_stage,
            dp=dp,
            optimizer_state_factor=optimizer_state_factor,
            largest_unit_bytes=unit,
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


# ---------------------------------------------------------------------------------------------- measured


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

    def __init__(self, stage_modules: Mapping[int, nn.Module]) -> None:
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

    def _enter_stage(self, stage: int) -> Any:
        def hook(module: nn.Module, _args: Any) -> None:
            self._current = stage
            # Runs after FSDP2's pre-forward hook (registered earlier), which swapped in the gathered
            # parameters: autograd saving them is not an activation either.
            self._unit_param_keys = {_storage_key(p) for p in module.parameters()}

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

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
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
