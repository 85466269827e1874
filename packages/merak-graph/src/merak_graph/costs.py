"""Cost annotation of a traced graph without running the real model.

``annotate_costs(gm, example_inputs)`` interprets the graph once, on meta
tensors when the model lives on the meta device (so a 405B-parameter model
costs nothing to annotate) or on the given values otherwise, and stores on each
node ``node.meta["merak_cost"]`` a ``NodeCost``: forward flops counted by
torch's flop formulas, bytes of the node's tensor outputs (activation memory),
bytes of parameters it reads, and an estimated forward+backward time from a
simple roofline ``CostModel``. ``node.meta["merak_value"]`` holds a
``ValueSpec`` (shape and dtype, or the Python type of a non-tensor value).

Measured times replace estimates with ``profile_shard_costs`` (see sharding).
Not done: per-operator kernel time tables; communication costs are left to the
pipeline simulator.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from merak_graph._compat import FlopCountingMode, meta_collectives, tree_flatten

__all__ = ["CostModel", "NodeCost", "ValueSpec", "annotate_costs", "graph_cost_summary"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Roofline constants that turn flops and bytes into an estimated time."""

    flops_per_s: float = 100e12
    """Sustained matmul throughput of one device, in flop/s."""
    bytes_per_s: float = 1.5e12
    """Sustained memory bandwidth of one device, in bytes/s (memory-bound ops)."""
    backward_factor: float = 2.0
    """Backward cost as a multiple of forward cost (2 for matmul-dominated models)."""

    def __post_init__(self) -> None:
        for field in ("flops_per_s", "bytes_per_s"):
            value = getattr(self, field)
            if not value > 0:
                raise ValueError(f"CostModel.{field}={value} must be > 0: give a device's throughput")
        if self.backward_factor < 0:
            raise ValueError(f"CostModel.backward_factor={self.backward_factor} must be >= 0 (typically 2)")

    def time(self, flops: float, bytes_moved: float) -> float:
        """Estimated forward+backward seconds of an op with this many flops and bytes."""
        return (1.0 + self.backward_factor) * max(flops / self.flops_per_s, bytes_moved / self.bytes_per_s)


@dataclass(frozen=True)
class ValueSpec:
    """What a node produces: a tensor's shape and dtype, or a non-tensor value's type."""

    is_tensor: bool
    shape: tuple[int, ...] = ()
    dtype: torch.dtype | None = None
    python_type: str = ""

    @property
    def nbytes(self) -> int:
        if not self.is_tensor or self.dtype is None:
            return 0
        n = 1
        for d in self.shape:
            n *= int(d)
        return (
            n * (torch.finfo(self.dtype).bits if self.dtype.is_floating_point else _int_bits(self.dtype)) // 8
        )


def _int_bits(dtype: torch.dtype) -> int:
    if dtype == torch.bool:
        return 8
    try:
        return torch.iinfo(dtype).bits
    except TypeError:
        return 32


@dataclass(frozen=True)
class NodeCost:
    """Estimated cost of one graph node."""

    flops: int
    """Forward flops."""
    output_bytes: int
    """Bytes of the tensors the node produces (activation memory if saved)."""
    param_bytes: int
    """Bytes of parameters/buffers the node reads directly (get_attr) or owns (call_module)."""
    time_s: float
    """Estimated forward+backward time."""


# Ops that return a view or metadata: no data moves, so they cost no time.
_FREE_OPS = {
    "view",
    "_unsafe_view",
    "reshape",
    "transpose",
    "permute",
    "unsqueeze",
    "squeeze",
    "expand",
    "narrow",
    "t",
    "getitem",
    "getattr",
    "size",
    "dim",
    "select",
    "slice",
    "as_strided",
    "alias",
    "detach",
    "split",
    "chunk",
    "unbind",
    "flatten",
    "unflatten",
    "view_as",
    "expand_as",
    "split_with_sizes",
    "sym_size",
    "numel",
}


def _op_name(n: fx.Node) -> str:
    target = n.target
    if isinstance(target, str):
        return target
    packet = getattr(target, "overloadpacket", None)
    if packet is not None:
        return str(getattr(packet, "__name__", ""))
    return str(getattr(target, "__name__", ""))


def _spec(value: Any) -> ValueSpec:
    if isinstance(value, torch.Tensor):
        return ValueSpec(True, tuple(int(d) for d in value.shape), value.dtype)
    return ValueSpec(False, python_type=type(value).__name__)


class _CostInterpreter(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, cost_model: CostModel, to_meta: bool) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.cost_model = cost_model
        self.to_meta = to_meta
        self.seen_params: set[int] = set()

    def run_node(self, n: fx.Node) -> Any:
        mode = FlopCountingMode()
        try:
            with mode:
                out = super().run_node(n)
        except Exception as exc:
            raise RuntimeError(
                f"cost annotation failed at node {n.name!r} ({n.op} {n.target}): {type(exc).__name__}: {exc}. "
                "A module whose forward cannot run on meta tensors needs real example inputs and weights."
            ) from exc
        leaves, _ = tree_flatten(out)
        out_bytes = sum(_spec(x).nbytes for x in leaves if isinstance(x, torch.Tensor))
        param_bytes = 0
        if n.op == "get_attr" and isinstance(out, torch.Tensor):
            param_bytes = 0 if id(out) in self.seen_params else _spec(out).nbytes
            self.seen_params.add(id(out))
            out_bytes = 0
        elif n.op == "call_module":
            mod = self.module.get_submodule(str(n.target))
            for t in [*mod.parameters(), *mod.buffers()]:
                if id(t) not in self.seen_params:
                    param_bytes += _spec(t).nbytes
                    self.seen_params.add(id(t))
        in_bytes = 0
        for arg in n.all_input_nodes:
            spec = arg.meta.get("merak_value")
            if isinstance(spec, ValueSpec):
                in_bytes += spec.nbytes
        flops = mode.flops
        free = n.op in ("placeholder", "get_attr", "output") or (
            n.op in ("call_function", "call_method") and flops == 0 and _op_name(n) in _FREE_OPS
        )
        time_s = 0.0 if free else self.cost_model.time(flops, in_bytes + out_bytes + param_bytes)
        n.meta["merak_value"] = (
            _spec(out)
            if not isinstance(out, (tuple, list))
            else ValueSpec(False, python_type=type(out).__name__)
        )
        n.meta["merak_cost"] = NodeCost(flops, out_bytes, param_bytes, time_s)
        return out


def annotate_costs(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    cost_model: CostModel | None = None,
) -> fx.GraphModule:
    """Annotate every node of ``gm`` with ``merak_value`` and ``merak_cost`` (in place; returns gm).

    When any parameter of ``gm`` is on the meta device, tensor inputs are moved to
    meta and nothing real is computed; otherwise the graph runs once on the given
    values without autograd.
    """
    cost_model = cost_model or CostModel()
    to_meta = any(t.is_meta for t in gm.parameters()) or any(t.is_meta for t in gm.buffers())
    names = gm.meta.get("merak_input_names")
    if names is not None and len(example_inputs) != len(names):
        from merak_graph.errors import InputMismatchError

        raise InputMismatchError(
            f"{len(example_inputs)} example inputs given but the traced graph takes {len(names)}: {names}"
        )
    values = [x.to("meta") if to_meta and isinstance(x, torch.Tensor) else x for x in example_inputs]
    with torch.no_grad(), meta_collectives():
        _CostInterpreter(gm, cost_model, to_meta).run(*values)
    gm.meta["merak_cost_model"] = dataclasses.asdict(cost_model)
    return gm


def graph_cost_summary(gm: fx.GraphModule) -> dict[str, float]:
    """Totals over an annotated graph: flops, time, parameter and activation bytes."""
    total = {"flops": 0.0, "time_s": 0.0, "param_bytes": 0.0, "activation_bytes": 0.0}
    for n in gm.graph.nodes:
        c = n.meta.get("merak_cost")
        if isinstance(c, NodeCost):
            total["flops"] += c.flops
            total["time_s"] += c.time_s
            total["param_bytes"] += c.param_bytes
            total["activation_bytes"] += c.output_bytes
    return total
