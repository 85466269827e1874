"""The state of one pipeline round (a ``step`` or an ``evaluate``), and how a batch is cut into microbatches.

:class:`_Round` holds everything the runner keeps for one round; the runner makes a new one per
round, so nothing leaks from one round into the next. This module does no communication.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from merak_pipe.ir import Action


def _as_call(value: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Boundary value -> (args, kwargs) of the stage call (see merak_pipe.stage)."""
    if isinstance(value, tuple):
        return value, {}
    if isinstance(value, dict):
        return (), dict(value)
    return (value,), {}


def _split_batch(value: Any, num_microbatches: int, what: str) -> list[Any]:
    """Split every tensor of ``value`` into ``num_microbatches`` equal chunks along dim 0."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            raise ValueError(f"{what} holds a 0-d tensor; every tensor must have a batch dim 0 to split")
        size = value.size(0)
        if size < num_microbatches:
            raise ValueError(
                f"{what} has batch size {size}, fewer than the schedule's {num_microbatches} microbatches; "
                "pass a larger batch or build the schedule with fewer microbatches"
            )
        if size % num_microbatches:
            raise ValueError(
                f"{what} has batch size {size}, not divisible into {num_microbatches} microbatches; "
                f"pass a batch size that is a multiple of {num_microbatches}"
            )
        return list(value.split(size // num_microbatches))
    if isinstance(value, (tuple, list)):
        parts = [_split_batch(v, num_microbatches, f"{what}[{i}]") for i, v in enumerate(value)]
        return (
            [type(value)(p[m] for p in parts) for m in range(num_microbatches)]
            if parts
            else [type(value)() for _ in range(num_microbatches)]
        )
    if isinstance(value, dict):
        split = {k: _split_batch(v, num_microbatches, f"{what}[{k!r}]") for k, v in value.items()}
        return [{k: s[m] for k, s in split.items()} for m in range(num_microbatches)]
    return [value] * num_microbatches


def _concat(values: list[Any]) -> Any:
    first = values[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(values, dim=0)
    if isinstance(first, (tuple, list)):
        return type(first)(_concat([v[i] for v in values]) for i in range(len(first)))
    if isinstance(first, dict):
        joined = {k: _concat([v[k] for v in values]) for k in first}
        return joined if type(first) is dict else _same_kind(first, joined)
    return first


def _same_kind(like: dict[Any, Any], values: dict[Any, Any]) -> dict[Any, Any]:
    """``values`` in a mapping of ``like``'s class (a transformers ``ModelOutput`` stays one, so the
    outputs of an evaluation read as each microbatch's did); a plain dict when that class takes no keywords."""
    try:
        return type(like)(**values)
    except TypeError:
        return values


@dataclass
class _Round:
    """Everything one ``step`` or ``evaluate`` call holds; a new one for each call."""

    index: int
    """0, 1, ... over the runner's life (the ``step`` of its action timings)."""
    training: bool
    inputs: list[Any] = field(default_factory=list)
    """Per microbatch: the inputs of stage 0 (on the rank that holds it)."""
    labels: list[Any] = field(default_factory=list)
    """Per microbatch: the labels of the last stage (on the rank that holds it)."""
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: dict[int, Any] = field(default_factory=dict)
    """The last stage's outputs (evaluation only)."""
    fwd_local: dict[tuple[int, int], Any] = field(default_factory=dict)
    """(stage, microbatch) -> its input, handed over by the previous stage on this rank."""
    bwd_local: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    """(stage, microbatch) -> its output gradients, handed back by the next stage on this rank."""
    marks: list[tuple[Action, Any, Any, Any, float]] = field(default_factory=list)
    """Per action: (action, start, ready, end, implicit recompute seconds), with ``record_timing``."""
    held: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    """(stage, microbatch) -> the receive buffers it consumed, not yet handed back to the transport
    ([Note: buffer lifetime] in ``_p2p_books.py``)."""

    def loss(self, num_microbatches: int, reduction: str) -> torch.Tensor | None:
        """The round's loss from its microbatches' losses: their sum, divided by ``num_microbatches``
        for ``"mean"``; None where no loss was computed (no labels, or not the last stage)."""
        if not self.losses:
            return None
        total = torch.stack([self.losses[m] for m in sorted(self.losses)]).sum()
        return total / num_microbatches if reduction == "mean" else total
