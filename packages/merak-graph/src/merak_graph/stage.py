"""The stage module: an ``nn.Sequential`` of shards run as a chain of tuples.

A shard's forward takes its boundary values as positional arguments and returns
a tuple, which is unpacked as the next shard's positional arguments; the last
shard of the last stage returns the model's output as the model returns it.
The pipeline runtime may also iterate the shards itself (e.g. to checkpoint a
fraction of them).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch import nn

from merak_graph.errors import InputMismatchError

__all__ = ["StageModule", "retarget_devices"]


class StageModule(nn.Sequential):
    """Shards of one pipeline stage; ``forward(*boundary_values)``.

    ``input_specs`` (name, shape, dtype per input) are checked on every call: the count and
    dtypes always, the shapes when ``strict_shapes`` (graphs from torch.export are specialised
    to the traced shapes).
    """

    def __init__(
        self,
        *shards: nn.Module,
        input_names: list[str] | None = None,
        input_specs: list[Any] | None = None,
        strict_shapes: bool = False,
    ) -> None:
        super().__init__(*shards)
        self.input_names = list(input_names or [])
        self.input_specs = list(input_specs or [])
        self.strict_shapes = strict_shapes

    def forward(self, *args: Any) -> Any:
        if self.input_names and len(args) != len(self.input_names):
            raise InputMismatchError(
                f"this stage takes {len(self.input_names)} inputs {self.input_names} but got {len(args)}: "
                "pass the previous stage's outputs (or, for stage 0, the model inputs in input_names order)"
            )
        for spec, value in zip(self.input_specs, args, strict=False):
            if not isinstance(value, torch.Tensor):
                continue
            if spec.dtype is not None and value.dtype != spec.dtype:
                raise InputMismatchError(
                    f"input {spec.name!r} has dtype {value.dtype} but was traced with {spec.dtype}: "
                    "pass inputs of the traced dtype, or trace again with such example inputs"
                )
            if self.strict_shapes and tuple(value.shape) != tuple(spec.shape):
                raise InputMismatchError(
                    f"input {spec.name!r} has shape {tuple(value.shape)} but the graph was traced (torch.export, "
                    f"shapes specialised) with {tuple(spec.shape)}: trace with example inputs of the microbatch "
                    "shape you run, or use trace_method='fx'"
                )
        values: Any = args
        for shard in self:
            values = shard(*values)
        return values


def retarget_devices(module: nn.Module, device: torch.device | str) -> int:
    """Rewrite constant ``device=`` arguments baked into graphs (e.g. by export on meta) to ``device``.

    Returns how many nodes were changed. Tracing records the device of tensor factories such
    as ``arange`` as a constant; a stage built for another device must create them there.
    """
    target = torch.device(device)
    changed = 0
    for sub in module.modules():
        if not isinstance(sub, fx.GraphModule):
            continue
        dirty = False

        def swap(value: Any) -> Any:
            if isinstance(value, torch.device) and value != target:
                return target
            return value

        for node in sub.graph.nodes:
            if node.op != "call_function" and node.op != "call_method":
                continue
            dev = node.kwargs.get("device")
            if isinstance(dev, str):
                node.update_kwarg("device", torch.device(dev))
            new_args = fx.node.map_aggregate(node.args, swap)
            new_kwargs = fx.node.map_aggregate(node.kwargs, swap)
            if new_args != node.args or new_kwargs != node.kwargs:
                node.args = new_args
                node.kwargs = new_kwargs
                dirty = True
                changed += 1
        if dirty:
            sub.recompile()
    return changed
