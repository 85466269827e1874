"""One training step's numbers: built and reduced on the device, copied to the host once, read when needed.

A step ends with one all-reduce over all ranks (see [Note: step flags] in :mod:`merak_core.run.nonfinite`)
of ``[loss sum, non-finite count, stop count]``; this rank's gradient norm (already global) and the code of
its first non-finite gradient ride behind it. :class:`StepValues` starts one copy of that vector to the
host right after the all-reduce (on CUDA into pinned memory, ``non_blocking``: the host does not wait) and
reads it on first use: the loss, the norm and the flags are Python numbers only when someone asks, which
the trainer does on the steps it logs, saves or evaluates and, for the flags, one step later ([Note:
device-side skip]). Reading waits for the device to reach the end of that step (an event), nothing more.

Not done here: deciding what a non-finite step does (``engine.py``, ``nonfinite.py``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from merak_core.run import nonfinite

# Positions in the step vector: the reduced part first (nonfinite.LOSS, NONFINITE, STOP_REQUESTED).
NORM, FIRST_BAD = nonfinite.STEP_VECTOR_SIZE, nonfinite.STEP_VECTOR_SIZE + 1

__all__ = ["LateFlags", "StepResult", "StepValues", "TrainingStepError", "reduce_step_values"]


class StepValues:
    """A step's vector on the device and its host copy (started at construction, read on first use)."""

    def __init__(
        self, vector: torch.Tensor, *, loss_divisor: int, has_norm: bool, names: Sequence[str] = ()
    ) -> None:
        self.device_vector = vector
        """The step vector on the device (``[loss sum, non-finite, stop, norm, first bad]``, float64)."""
        self.loss_divisor, self.has_norm, self.names = loss_divisor, has_norm, list(names)
        self._event: torch.cuda.Event | None = None
        if vector.device.type == "cuda":
            self.host = torch.empty(vector.shape, dtype=vector.dtype, pin_memory=True)
            self.host.copy_(vector, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self.host = vector  # CPU: the vector is host memory already
        self._values: list[float] | None = None

    @property
    def is_read(self) -> bool:
        """The numbers are on the host already (reading them waits for nothing)."""
        return self._values is not None

    def read(self) -> list[float]:
        """The vector's numbers (waits for the device to finish the step on first use, then cached)."""
        if self._values is None:
            if self._event is not None:
                self._event.synchronize()
            self._values = self.host.tolist()
        return self._values

    def device_nonfinite(self) -> torch.Tensor:
        """1.0 where some rank's gradient or the loss is not finite, else 0.0: float32 0-d, on the device."""
        v = self.device_vector
        bad = (v[nonfinite.NONFINITE] > 0) | ~torch.isfinite(v[nonfinite.LOSS])
        return bad.to(torch.float32)

    @property
    def loss(self) -> float:
        """The global mean loss (see [Note: loss scaling] in ``engine.py``)."""
        return self.read()[nonfinite.LOSS] / self.loss_divisor

    @property
    def grad_norm(self) -> float | None:
        """The global gradient norm before clipping (None when not computed)."""
        return self.read()[NORM] if self.has_norm else None

    @property
    def nonfinite(self) -> bool:
        """Some rank saw a non-finite gradient, or the loss is not finite."""
        return self.read()[nonfinite.NONFINITE] > 0 or not math.isfinite(self.loss)

    @property
    def stop_requested(self) -> bool:
        """Some rank was asked to stop (a signal) before this step's all-reduce."""
        return self.read()[nonfinite.STOP_REQUESTED] > 0

    def first_bad(self) -> tuple[str, str] | None:
        """This rank's first non-finite gradient in the step (name, ``nan``/``inf``), when it was recorded."""
        return nonfinite.decode_first_nonfinite(self.read()[FIRST_BAD], self.names)


def reduce_step_values(
    loss: torch.Tensor | None,
    bad: torch.Tensor,
    stop: bool,
    *,
    add_loss: bool,
    norm: torch.Tensor | None,
    first_bad: torch.Tensor | None,
    device: torch.device,
    loss_divisor: int,
    names: Sequence[str] = (),
) -> StepValues:
    """The step's all-reduce (collective over all ranks), all on the device: no host read.

    ``add_loss``: this rank contributes the loss (the last stage's TP rank 0); ``bad``: this rank's
    non-finite flag (a 0-d tensor); ``stop``: this rank was asked to stop.
    """
    value = torch.zeros(nonfinite.STEP_VECTOR_SIZE, dtype=torch.float64, device=device)
    if loss is not None and add_loss:
        value[nonfinite.LOSS] += loss.detach().to(torch.float64).reshape(())
    value[nonfinite.NONFINITE] = bad.to(torch.float64).reshape(())
    if stop:
        value[nonfinite.STOP_REQUESTED] = 1.0
    dist.all_reduce(value)
    tail = torch.full((2,), -1.0, dtype=torch.float64, device=device)
    if norm is not None:
        tail[0] = norm.detach().to(torch.float64).reshape(())
    if first_bad is not None:
        tail[1] = first_bad
    return StepValues(
        torch.cat([value, tail]), loss_divisor=loss_divisor, has_norm=norm is not None, names=names
    )


class LateFlags:
    """The flags of [Note: device-side skip]: the optimizer's ``found_inf`` on the device, the step not read yet.

    ``target``: the optimizer that reads ``found_inf`` (:func:`merak_core.run.nonfinite.device_skip_target`);
    ``named``, ``layout``: for the error of a non-finite step.
    """

    def __init__(self, target: torch.optim.Optimizer, *, named: Sequence[Any], layout: Any) -> None:
        self.target, self.named, self.layout = target, named, layout
        self._found_inf: torch.Tensor | None = None
        self._unread: tuple[int, StepValues] | None = None

    def arm(self, values: StepValues) -> None:
        """Before the optimizer step: it drops the update if this step or one not read yet was not finite."""
        bad = values.device_nonfinite()
        self._found_inf = bad if self._found_inf is None else torch.maximum(self._found_inf, bad)
        setattr(self.target, "found_inf", self._found_inf)  # noqa: B010 - the attribute torch's step reads

    def swap(self, step: int, values: StepValues) -> tuple[int, StepValues] | None:
        """Keep step ``step`` as the one not read yet; the one kept before it."""
        previous, self._unread = self._unread, (step, values)
        return previous

    def take(self) -> tuple[int, StepValues] | None:
        """The step not read yet (None when none), forgotten here."""
        unread, self._unread = self._unread, None
        return unread

    def check(self, unread: tuple[int, StepValues] | None) -> bool:
        """Read ``unread``'s flags (waits for its host copy): ``NonFiniteError`` naming a non-finite step, with
        its first bad gradient as the device found it in that step; else whether a stop was agreed in it."""
        if unread is None:
            return False
        step, values = unread
        if values.nonfinite:
            raise nonfinite.nonfinite_error(step, values, self.named, self.layout, mine=values.first_bad())
        return values.stop_requested


class TrainingStepError(RuntimeError):
    """A collective of a training step failed or timed out; the message names the rank, step and group."""


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one optimizer step produced (the same ``loss``, ``skipped`` and ``stop_agreed`` on every rank).

    ``loss`` and ``grad_norm`` are read from the device on first use (one host transfer for both,
    :class:`merak_core.run.step_values.StepValues`): a caller that does not ask does not wait.
    """

    values: StepValues
    """The step's numbers on the device and their host copy."""
    pipeline_s: float
    """Seconds of this rank's pipeline part (forward and backward of every microbatch; on CUDA the time
    of the GPU work only with ``record_timing``, else of queuing it)."""
    skipped: bool = False
    """The loss or a gradient was not finite and the update was dropped (``nonfinite: skip``)."""
    stop_agreed: bool = False
    """Some rank got a stop signal: every rank stops after this step."""
    timings: tuple[Any, ...] = ()
    """The runner's per-action timings of this step (only with ``record_timing``)."""

    @property
    def loss(self) -> float:
        """The global mean loss of the step (see [Note: loss scaling])."""
        return self.values.loss

    @property
    def grad_norm(self) -> float | None:
        """The global gradient norm before clipping (None when ``max_grad_norm`` is 0)."""
        return self.values.grad_norm
