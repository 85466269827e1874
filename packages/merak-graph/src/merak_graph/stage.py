"""The stage module: an ``nn.Sequential`` of shards run as a chain of tuples.

A shard's forward takes its boundary values as positional arguments and returns
a tuple, which is unpacked as the next shard's positional arguments; the last
shard of the last stage returns the model's output as the model returns it.
The pipeline runtime may also iterate the shards itself (e.g. to checkpoint a
fraction of them).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .errors import InputMismatchError

__all__ = ["StageModule"]


class StageModule(nn.Sequential):
    """Shards of one pipeline stage; ``forward(*boundary_values)``."""

    def __init__(self, *shards: nn.Module, input_names: list[str] | None = None) -> None:
        super().__init__(*shards)
        self.input_names = list(input_names or [])

    def forward(self, *args: Any) -> Any:
        if self.input_names and len(args) != len(self.input_names):
            raise InputMismatchError(
                f"this stage takes {len(self.input_names)} inputs {self.input_names} but got {len(args)}: "
                "pass the previous stage's outputs (or, for stage 0, the model inputs in input_names order)"
            )
        values: Any = args
        for shard in self:
            values = shard(*values)
        return values
