"""The cluster model's per-operator-class rates ([Note: operator class rates]; pure, synthetic, no timing)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn

from merak_core.planner.cluster import ClusterSpec, load_cluster, shipped_clusters
from merak_core.planner.cluster_classes import op_class, reprice_classes
from merak_core.planner.cluster_cost import trace_for_cluster


class _Block(nn.Module):
    """One of each class: a norm, a GEMM, an activation, an add, a softmax, an attention."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.up = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.up(self.norm(x))) + x
        q = h.view(2, 4, 2, 8).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        return torch.softmax(a.transpose(1, 2).reshape(2, 4, 16), dim=-1)


def _annotated(rate_cls: dict[str, float] | None = None):
    import merak_graph as mg

    model, x = _Block(), torch.randn(2, 4, 16)
    gm = mg.trace(model, example_inputs=(x,), method="fx")
    mg.annotate_costs(gm, [x], cost_model=mg.CostModel(flops_per_s=1e12, bytes_per_s=1e10))
    return gm


def test_every_class_is_found_and_others_are_not():
    gm = _annotated()
    classes = {n.name: op_class(n, gm) for n in gm.graph.nodes}
    assert classes["norm"] == "norm" and classes["gelu"] == "activation"
    assert classes["softmax"] == "softmax" and classes["scaled_dot_product_attention"] == "attention"
    assert classes["up"] is None and classes["add"] is None and classes["x"] is None


def test_reprice_prices_a_class_at_its_rate_and_leaves_the_rest():
    """A class with a rate: 3 x max(flops / F, counted bytes / rate); nodes of other classes and
    views keep merak-graph's roofline; a class without a rate keeps it too."""
    gm = _annotated()
    before = {n.name: n.meta["merak_cost"].time_s for n in gm.graph.nodes if "merak_cost" in n.meta}
    counts = reprice_classes(gm, {"activation": 1e8, "norm": 2e8}, flops_per_s=1e12)
    assert counts == {"activation": 1, "norm": 1}
    nodes = {n.name: n for n in gm.graph.nodes}
    gelu_bytes = 2 * 2 * 4 * 16 * 4  # its input and output, fp32
    assert nodes["gelu"].meta["merak_cost"].time_s == pytest.approx(3 * gelu_bytes / 1e8, rel=1e-12)
    norm_bytes = 2 * 2 * 4 * 16 * 4 + 2 * 16 * 4  # input, output, weight and bias
    assert nodes["norm"].meta["merak_cost"].time_s == pytest.approx(3 * norm_bytes / 2e8, rel=1e-12)
    for name in ("up", "add", "softmax", "scaled_dot_product_attention", "view", "transpose"):
        assert nodes[name].meta["merak_cost"].time_s == before[name]


def test_reprice_refuses_unknown_classes_and_bad_rates():
    gm = _annotated()
    with pytest.raises(ValueError, match="'gemm'.*expected classes among"):
        reprice_classes(gm, {"gemm": 1e9}, flops_per_s=1e12)
    with pytest.raises(ValueError, match="expected bytes/s > 0"):
        reprice_classes(gm, {"norm": 0.0}, flops_per_s=1e12)


def test_trace_for_cluster_uses_the_cluster_class_rates():
    """The whole chain's time grows by exactly the re-priced nodes' difference; without rates it is unchanged."""
    base = load_cluster("h100-sxm-8x")
    model, x = _Block(), torch.randn(2, 4, 16)
    plain = trace_for_cluster(model, (x,), base, dtype="fp32", num_shards=1)
    slow = dataclasses.replace(base, op_class_bandwidth={"activation": 1e8})
    priced = trace_for_cluster(model, (x,), slow, dtype="fp32", num_shards=1)
    gelu_bytes = 2 * 2 * 4 * 16 * 4
    old_gelu = 3 * gelu_bytes / (base.memory_bandwidth * base.memory_efficiency)
    extra = 3 * gelu_bytes / 1e8 - old_gelu
    assert priced.shards[0].time_s - plain.shards[0].time_s == pytest.approx(extra, rel=1e-6)


def test_cluster_file_op_class_rates_are_read_and_checked():
    raw = yaml.safe_load(shipped_clusters()["h100-sxm-8x"].read_text())
    assert ClusterSpec.from_dict(raw).op_class_bandwidth == {}
    raw["device"]["op_class_gb_s"] = {"activation": 4.0, "attention": 0.5}
    assert ClusterSpec.from_dict(raw).op_class_bandwidth == {"activation": 4e9, "attention": 5e8}
    for bad, match in (
        ({"gemm": 1.0}, "unknown key 'device.op_class_gb_s.gemm'"),
        ({"norm": 0.0}, "device.op_class_gb_s.norm=0.0 must be > 0"),
        ({"norm": "fast"}, "device.op_class_gb_s.norm='fast' must be a float"),
        (3.0, "device.op_class_gb_s must be a mapping"),
    ):
        raw["device"]["op_class_gb_s"] = bad
        with pytest.raises(ValueError, match=match):
            ClusterSpec.from_dict(raw)
    with pytest.raises(ValueError, match="op_class_bandwidth"):
        dataclasses.replace(load_cluster("h100-sxm-8x"), op_class_bandwidth={"softmax": -1.0})
