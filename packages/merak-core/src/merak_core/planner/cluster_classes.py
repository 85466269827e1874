"""Per-operator-class rates of the cluster model: element-wise operators priced at their class's measured rate.

[Note: operator class rates] The roofline prices every memory-bound operator at one bandwidth, the
cluster file's ``device.memory_bandwidth_gb_s`` (on the CPU file a large element-wise add). Operators
that do more per byte than an add run slower than that: GELU evaluates erf (and its derivative in the
backward), a layer norm reads its input twice and reduces, a fused attention kernel at a short sequence
does far less per second than a GEMM. A cluster file may therefore state, per class, the rate at which
that class's nodes move the bytes merak-graph counts for them (inputs + outputs + parameters, forward;
the backward is priced ``backward_factor`` times that, as every node is), ``device.op_class_gb_s``:

- ``activation``: GELU, SiLU, ReLU, tanh, sigmoid and their modules;
- ``norm``: layer norm, RMS norm, group and batch norm and their modules;
- ``softmax``: softmax and log-softmax;
- ``attention``: ``scaled_dot_product_attention`` (its bytes are q, k, v and the output: the rate holds at
  the probed sequence length only, and the node is priced at ``max`` of that and its FLOPs at the GEMM rate).

A class without a rate, and every other operator, keeps the roofline at ``memory_bandwidth``.
``bench_cluster_plan.py steps`` measures the rates as it measures the add: forward and backward of one
operator of the class on a tensor of the demo's shapes, its counted bytes x (1 + backward factor) over
its CPU time. Shipped GPU files leave them out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["OP_CLASSES", "op_class", "reprice_classes"]

OP_CLASSES: dict[str, frozenset[str]] = {
    "activation": frozenset(
        {
            "gelu",
            "silu",
            "relu",
            "tanh",
            "sigmoid",
            "GELU",
            "SiLU",
            "ReLU",
            "Tanh",
            "Sigmoid",
            "NewGELUActivation",
        }
    ),
    "norm": frozenset(
        {
            "layer_norm",
            "rms_norm",
            "group_norm",
            "batch_norm",
            "LayerNorm",
            "RMSNorm",
            "GroupNorm",
            "BatchNorm1d",
            "LlamaRMSNorm",
        }
    ),
    "softmax": frozenset({"softmax", "log_softmax", "Softmax", "LogSoftmax"}),
    "attention": frozenset({"scaled_dot_product_attention"}),
}
"""Class -> the operator names (functions, methods, aten packets) and module class names it holds."""


def op_class(node: Any, gm: Any) -> str | None:
    """The class of an fx ``node`` of ``gm`` (:data:`OP_CLASSES`), None for every other operator."""
    from merak_graph.costs import _op_name

    if node.op == "call_module":
        name = type(gm.get_submodule(str(node.target))).__name__
    elif node.op in ("call_function", "call_method"):
        name = _op_name(node)
    else:
        return None
    return next((cls for cls, names in OP_CLASSES.items() if name in names), None)


def _node_bytes(node: Any) -> float:
    """The bytes merak-graph's roofline counted for ``node``: its inputs, outputs and parameters."""
    from merak_graph.costs import ValueSpec

    cost = node.meta["merak_cost"]
    inputs = sum(
        spec.nbytes for a in node.all_input_nodes if isinstance(spec := a.meta.get("merak_value"), ValueSpec)
    )
    return float(inputs + cost.output_bytes + cost.param_bytes)


def reprice_classes(gm: Any, rates: Mapping[str, float], *, flops_per_s: float) -> dict[str, int]:
    """Re-price, in place, every node of an annotated ``gm`` whose class has a rate in ``rates`` (bytes/s):
    ``(1 + backward factor) x max(flops / flops_per_s, bytes / rate)`` ([Note: operator class rates]).
    Returns how many nodes of each class were re-priced."""
    unknown = set(rates) - set(OP_CLASSES)
    if unknown:
        raise ValueError(
            f"operator class rates {sorted(unknown)}: expected classes among {sorted(OP_CLASSES)}"
        )
    bad = {k: v for k, v in rates.items() if not v > 0}
    if bad:
        raise ValueError(f"operator class rates {bad}: expected bytes/s > 0")
    factor = 1.0 + float(gm.meta.get("merak_cost_model", {}).get("backward_factor", 2.0))
    counts: dict[str, int] = {}
    for node in gm.graph.nodes:
        cost = node.meta.get("merak_cost")
        if cost is None or cost.time_s == 0:
            continue  # free ops (views) stay free
        cls = op_class(node, gm)
        if cls is None or cls not in rates:
            continue
        time_s = factor * max(cost.flops / flops_per_s, _node_bytes(node) / rates[cls])
        node.meta["merak_cost"] = dataclasses.replace(cost, time_s=time_s)
        counts[cls] = counts.get(cls, 0) + 1
    return counts
