"""One pipeline stage: a module, its place in the pipeline, and per-microbatch autograd state.

A :class:`PipelineStage` runs the compute actions of a schedule for one stage: forward
(``F``), full backward (``B``), input-gradient backward (``I``), weight-gradient backward
(``W``) and recompute (``R``). It knows nothing about communication: the runner
(``merak_pipe.runner``) hands it boundary values and takes its outputs and input gradients.

Calling convention of a stage module: the boundary values arrive as positional arguments
(a dict boundary as keyword arguments); the module returns a tensor, a tuple or a dict.
An ``nn.Sequential`` stage is a chain of *units* (a unit's tuple output is unpacked as the
next unit's positional arguments, a dict output as keyword arguments); any other module is
one unit.

[Note: recompute segments]
With a recompute fraction ``f`` the first ``k = round(f * num_units)`` units form the
*checkpointed segment*: the forward runs them keeping only the stage input and the RNG state
(grad mode stays on so outputs know whether they require grad, but a saved-tensor hook drops
everything the graph would save); their outputs become fresh leaves (the *mid leaves*) that
feed the remaining units, run normally (the *kept segment*). Before the backward needs them, the
checkpointed units are run again with grad enabled and the saved RNG state (an explicit
``R`` action, or implicitly at the start of ``B``/``I``), so dropout draws the same masks.
The backward then runs in two parts: kept segment (outputs -> mid leaves, parameters), then
checkpointed segment (recomputed outputs -> stage inputs, parameters). The global RNG stream
is not advanced by a recompute, so a run with recompute draws exactly what a run without does.

The split of ``B`` into ``I`` and ``W`` is [Note: split backward] in ``_split_backward.py``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from merak_pipe._split_backward import _backward, _grad, _WeightPlan
from merak_pipe.comm import flatten_boundary, unflatten_boundary

__all__ = ["PipelineStage"]

logger = logging.getLogger(__name__)


def _drop_saved(_tensor: torch.Tensor) -> None:
    return None


def _no_unpack(_packed: None) -> torch.Tensor:
    raise RuntimeError("internal error: the checkpointed forward's graph was used for a backward")


def _call_unit(unit: nn.Module, value: Any) -> Any:
    if isinstance(value, tuple):
        return unit(*value)
    if isinstance(value, dict):
        return unit(**value)
    return unit(value)


def _run_units(units: Sequence[nn.Module], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    value: Any = units[0](*args, **kwargs)
    for unit in units[1:]:
        value = _call_unit(unit, value)
    return value


def _run_units_on(units: Sequence[nn.Module], value: Any) -> Any:
    for unit in units:
        value = _call_unit(unit, value)
    return value


@dataclass
class _RngState:
    cpu: torch.Tensor
    device: torch.device
    accel: torch.Tensor | None


def _save_rng(device: torch.device) -> _RngState:
    accel = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return _RngState(torch.get_rng_state(), device, accel)


@contextlib.contextmanager
def _restored_rng(state: _RngState) -> Iterator[None]:
    devices = [state.device] if state.accel is not None else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(state.cpu)
        if state.accel is not None:
            torch.cuda.set_rng_state(state.accel, state.device)
        yield


@dataclass
class _Checkpoint:
    """What the checkpointed segment keeps (see [Note: recompute segments])."""

    rng: _RngState
    num_units: int
    mid_spec: Any
    mid_leaves: list[torch.Tensor]
    recomputed: list[torch.Tensor] | None = None
    mid_grads: list[torch.Tensor | None] | None = None


@dataclass
class _MicrobatchState:
    """Autograd state of one microbatch between its forward and its (weight) backward."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    input_leaves: list[torch.Tensor]
    outputs: list[torch.Tensor] = field(default_factory=list)
    loss: torch.Tensor | None = None
    checkpoint: _Checkpoint | None = None
    output_grads: list[torch.Tensor] | None = None
    input_done: bool = False
    weight_plans: list[_WeightPlan] = field(default_factory=list)


class PipelineStage:
    """Stage ``stage_index`` of ``num_stages``: a module plus the autograd bookkeeping per microbatch.

    Args:
        module: the stage's module (already on ``device``); an ``nn.Sequential`` is a chain of units.
        stage_index: this stage's index, 0-based.
        num_stages: the number of stages of the whole pipeline.
        group: the pipeline process group (``None``: the default group).
        device: the device the stage computes on (``"cpu"``, ``"cuda:0"``, ...).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        stage_index: int,
        num_stages: int,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"PipelineStage needs an nn.Module, got {type(module).__name__}")
        if num_stages < 1:
            raise ValueError(f"num_stages={num_stages}; expected >= 1")
        if not 0 <= stage_index < num_stages:
            raise ValueError(
                f"stage_index={stage_index} is outside 0..{num_stages - 1}; pass a 0-based index below num_stages"
            )
        self.module = module
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group = group
        self.device = torch.device(device)
        self.units: list[nn.Module] = list(module) if isinstance(module, nn.Sequential) else [module]
        if not self.units:
            raise ValueError(
                f"stage {stage_index}: the nn.Sequential is empty; give the stage at least one module"
            )
        self._states: dict[int, _MicrobatchState] = {}
        self.recompute_seconds = 0.0
        """Total seconds spent in recomputation (explicit R or inside B/I); read by the runner's timing."""

    # ------------------------------------------------------------------ properties

    @property
    def is_first(self) -> bool:
        """True for stage 0 (it reads the user's inputs)."""
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        """True for the last stage (it computes the loss)."""
        return self.stage_index == self.num_stages - 1

    @property
    def num_units(self) -> int:
        """Units of this stage (the granularity of recomputation)."""
        return len(self.units)

    def checkpointed_units(self, fraction: float) -> int:
        """How many leading units a recompute fraction checkpoints."""
        return min(self.num_units, max(0, round(fraction * self.num_units)))

    def parameters(self) -> list[nn.Parameter]:
        """The trainable parameters of this stage."""
        return [p for p in self.module.parameters() if p.requires_grad]

    def __repr__(self) -> str:
        return (
            f"PipelineStage(stage_index={self.stage_index}, num_stages={self.num_stages}, "
            f"units={self.num_units}, device={self.device})"
        )

    # ------------------------------------------------------------------ bookkeeping

    def clear(self) -> None:
        """Drop every microbatch state (end of a step, or after a failure)."""
        self._states.clear()

    def holds(self, microbatch: int) -> bool:
        """True while ``microbatch`` has autograd state here (from its F to its B, or to its W)."""
        return microbatch in self._states

    def pending_microbatches(self) -> list[int]:
        """Microbatches whose backward has not finished yet."""
        return sorted(self._states)

    def _state(self, microbatch: int, action: str) -> _MicrobatchState:
        state = self._states.get(microbatch)
        if state is None:
            raise RuntimeError(
                f"stage {self.stage_index}: action {self.stage_index}{action}{microbatch} found no forward "
                f"state for microbatch {microbatch}; the schedule runs {action} before F (or twice)"
            )
        return state

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        microbatch: int,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        recompute_fraction: float = 0.0,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        labels: Any = None,
        loss_scale: float = 1.0,
        training: bool = True,
    ) -> tuple[Any, torch.Tensor | None]:
        """Run the forward of ``microbatch``; return (output value, unscaled loss or None).

        ``args``/``kwargs`` are the stage inputs (received leaves on later stages). With
        ``training`` the autograd state is kept for the backward; otherwise nothing is kept.
        On the last stage with ``loss_fn``, the loss of the output against ``labels`` is
        computed and ``loss * loss_scale`` is what the backward differentiates.
        """
        if not training:
            with torch.no_grad():
                out = _run_units(self.units, args, kwargs)
                loss = loss_fn(out, labels) if (loss_fn is not None and self.is_last) else None
            return out, (loss.detach() if loss is not None else None)
        if microbatch in self._states:
            raise RuntimeError(
                f"stage {self.stage_index}: forward of microbatch {microbatch} ran twice in one step "
                "without a backward in between; check the schedule"
            )
        leaves = [t for t in _tensors_of(args, kwargs) if t.requires_grad]
        state = _MicrobatchState(args=args, kwargs=kwargs, input_leaves=leaves)
        k = self.checkpointed_units(recompute_fraction)
        with torch.enable_grad():
            if k > 0:
                rng = _save_rng(self.device)
                # Grad mode on, so the outputs know whether they require grad, but every tensor the
                # graph would save is dropped at once: the graph is detached right below.
                with torch.autograd.graph.saved_tensors_hooks(_drop_saved, _no_unpack):
                    mid = _run_units(self.units[:k], args, kwargs)
                mid_spec, mid_tensors = flatten_boundary(mid)
                mid_leaves = [t.detach().requires_grad_(t.requires_grad) for t in mid_tensors]
                state.checkpoint = _Checkpoint(rng=rng, num_units=k, mid_spec=mid_spec, mid_leaves=mid_leaves)
                out = _run_units_on(self.units[k:], unflatten_boundary(mid_spec, mid_leaves))
            else:
                out = _run_units(self.units, args, kwargs)
            loss = None
            if loss_fn is not None and self.is_last:
                loss = loss_fn(out, labels)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise ValueError(
                        f"loss_fn returned {type(loss).__name__} "
                        f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}; "
                        "expected a scalar tensor (reduce the loss inside loss_fn)"
                    )
                state.loss = loss * loss_scale if loss_scale != 1.0 else loss
        _, out_tensors = flatten_boundary(out)
        state.outputs = [t for t in out_tensors if t.requires_grad]
        self._states[microbatch] = state
        return out, (loss.detach() if loss is not None else None)

    # ------------------------------------------------------------------ recompute

    def recompute(self, microbatch: int) -> None:
        """Run the checkpointed units of ``microbatch`` again, with grad (the ``R`` action)."""
        state = self._state(microbatch, "R")
        ckpt = state.checkpoint
        if ckpt is None or ckpt.recomputed is not None:
            return  # nothing checkpointed on this stage (fraction 0) or already recomputed
        k = ckpt.num_units
        start = time.perf_counter()
        with torch.enable_grad(), _restored_rng(ckpt.rng):
            mid = _run_units(self.units[:k], state.args, state.kwargs)
        self.recompute_seconds += time.perf_counter() - start
        _, tensors = flatten_boundary(mid)
        if len(tensors) != len(ckpt.mid_leaves):
            raise RuntimeError(
                f"stage {self.stage_index} microbatch {microbatch}: the recomputed forward returned "
                f"{len(tensors)} tensors, the first forward {len(ckpt.mid_leaves)}; the checkpointed units "
                "must be deterministic in structure"
            )
        ckpt.recomputed = tensors

    # ------------------------------------------------------------------ backward

    def _kept_roots(
        self,
        state: _MicrobatchState,
        output_grads: Sequence[torch.Tensor] | None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        if self.is_last and state.loss is not None:
            return [state.loss], None
        if output_grads is None:
            raise RuntimeError(f"stage {self.stage_index}: backward needs output gradients")
        if len(output_grads) != len(state.outputs):
            raise RuntimeError(
                f"stage {self.stage_index}: received {len(output_grads)} output gradients for "
                f"{len(state.outputs)} outputs that require grad"
            )
        return state.outputs, list(output_grads)

    def _ckpt_roots(
        self, microbatch: int, ckpt: _Checkpoint, mid_grads: Sequence[torch.Tensor | None]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if ckpt.recomputed is None:
            self.recompute(microbatch)
        assert ckpt.recomputed is not None
        roots, grads = [], []
        for out, grad in zip(ckpt.recomputed, mid_grads, strict=True):
            if grad is not None and out.requires_grad:
                roots.append(out)
                grads.append(grad)
        return roots, grads

    def backward(self, microbatch: int, output_grads: Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
        """Full backward (``B``): accumulate parameter grads, return the input gradients.

        Returns one gradient per stage input that requires grad (zeros where unused), in the
        flattened order of the inputs.
        """
        state = self._state(microbatch, "B")
        roots, grads = self._kept_roots(state, output_grads)
        _backward(roots, grads, inputs=None)
        ckpt = state.checkpoint
        if ckpt is not None:
            mid_grads = [leaf.grad for leaf in ckpt.mid_leaves]
            roots, grads = self._ckpt_roots(microbatch, ckpt, mid_grads)
            _backward(roots, grads, inputs=None)
        input_grads = [
            leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in state.input_leaves
        ]
        del self._states[microbatch]
        return input_grads

    def backward_input(
        self, microbatch: int, output_grads: Sequence[torch.Tensor] | None
    ) -> list[torch.Tensor]:
        """Input-gradient backward (``I``): gradients of the stage inputs only; graph kept for ``W``.

        See [Note: split backward]: the gradients entering the nodes where parameter-only branches
        leave the input path are captured on the way, so ``W`` only runs those branches.
        """
        state = self._state(microbatch, "I")
        params = self.parameters()
        roots, grads = self._kept_roots(state, output_grads)
        ckpt = state.checkpoint
        if ckpt is not None:
            mid_needed = [leaf for leaf in ckpt.mid_leaves if leaf.requires_grad]
            plan = _WeightPlan(roots, grads, mid_needed, params)
            mid_grads_req = plan.run_input(lambda: _grad(roots, grads, mid_needed))
            state.weight_plans.append(plan)
            it = iter(mid_grads_req)
            ckpt.mid_grads = [next(it) if leaf.requires_grad else None for leaf in ckpt.mid_leaves]
            roots, grads = self._ckpt_roots(microbatch, ckpt, ckpt.mid_grads)
        plan = _WeightPlan(roots, grads, state.input_leaves, params)
        leaves = state.input_leaves
        input_grads = plan.run_input(lambda: _grad(roots, grads, leaves)) if leaves else []
        state.weight_plans.append(plan)
        state.input_done = True
        return [
            g if g is not None else torch.zeros_like(leaf)
            for g, leaf in zip(input_grads, state.input_leaves, strict=True)
        ]

    def backward_weight(self, microbatch: int) -> None:
        """Weight-gradient backward (``W``): accumulate parameter grads and free the graph."""
        state = self._state(microbatch, "W")
        if not state.input_done:
            raise RuntimeError(
                f"stage {self.stage_index}: action {self.stage_index}W{microbatch} runs before "
                f"{self.stage_index}I{microbatch}; the schedule must run I before W"
            )
        for plan in state.weight_plans:
            plan.run_weight()
        del self._states[microbatch]


def _tensors_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    _, tensors = flatten_boundary((args, kwargs))
    return tensors
