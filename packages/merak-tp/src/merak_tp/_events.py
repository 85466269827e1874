"""Shared run-time state of sub-pipelined regions, and an optional event recorder.

``_RegionState`` is what a region (a module made of column layers, local
compute and one row layer) shares with the TP layers inside it while its
forward runs chunk by chunk: the mode the layers must run in and the pending
collective handles the region waits for. It lives on the region module, never
in a module-level global.

The recorder logs, in order, every collective launch, wait and compute step of
the TP layers (``record_overlap_events``); tests use it to show that chunk j's
collective is in flight while chunk j+1 computes. It is a ``ContextVar`` so
nothing is recorded (and nothing costs) outside the ``with`` block.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from torch.distributed import ProcessGroup

_RECORDER: contextvars.ContextVar[list[tuple[str, ...]] | None] = contextvars.ContextVar(
    "merak_tp_recorder", default=None
)


@contextlib.contextmanager
def record_overlap_events() -> Iterator[list[tuple[str, ...]]]:
    """Record ``(kind, phase, what, chunk)`` tuples of TP compute/launch/wait steps.

    ``kind`` is ``"compute"``, ``"launch"`` or ``"wait"``; ``phase`` is ``"fwd"``
    or ``"bwd"``; ``what`` names the layer or region; ``chunk`` is the
    sub-microbatch index as a string. Backward steps are recorded when
    ``backward()`` runs inside the ``with`` block.
    """
    events: list[tuple[str, ...]] = []
    token = _RECORDER.set(events)
    try:
        yield events
    finally:
        _RECORDER.reset(token)


def _record(kind: str, phase: str, what: str, chunk: int) -> None:
    events = _RECORDER.get()
    if events is not None:
        events.append((kind, phase, what, str(chunk)))


class _GroupRef:
    """Holds a process group; ``copy.deepcopy`` of a module shares it (a ProcessGroup cannot be copied)."""

    __slots__ = ("group",)

    def __init__(self, group: ProcessGroup | None) -> None:
        self.group = group

    def __deepcopy__(self, memo: dict[int, Any]) -> _GroupRef:
        return self

    def __copy__(self) -> _GroupRef:
        return self


@dataclass
class _RegionState:
    """Mode and pending work of one sub-pipelined / sequence-parallel region."""

    group_ref: _GroupRef
    chunks: int
    name: str = "region"
    sequence_parallel: bool = False
    sequence_dim: int = 1
    # An RNGTracker-like object with fork(name): the region's forward runs inside fork("tp").
    rng_tracker: Any = None
    # None until the first call has checked the region's shape (see overlap.py).
    deferrable: bool | None = None
    # "block": layers leave communication to the region; "probe": layers run on
    # their own but report what they did; "sp": sequence-parallel region; None: plain.
    mode: str | None = None
    chunk: int = 0
    pending_fwd: list[Any] = field(default_factory=list)
    pending_bwd: list[Any] = field(default_factory=list)
    calls: list[tuple[str, Any]] = field(default_factory=list)

    @property
    def group(self) -> ProcessGroup | None:
        return self.group_ref.group
