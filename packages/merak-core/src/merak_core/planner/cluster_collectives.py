"""Collectives and groups on a :class:`ClusterSpec`: ring formulas, the first TP / DP group of a
layout, the link between pipeline stages, sub-pipelined TP's exposed communication and ZeRO-3's
all-gathers (see [Note: cluster model terms] in :mod:`.cluster_cost`).

Ranks are numbered TP fastest, then DP, then PP ([Note: rank order]). Deliberately not modelled:
contention between rings that share a link, algorithms other than ring and tree.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from merak_core.planner.cluster import ClusterSpec

__all__ = [
    "dp_ranks",
    "p2p_link",
    "ring_allreduce_s",
    "ring_s",
    "small_allreduce_s",
    "exposed_tp_s",
    "tp_ranks",
    "zero3_gathers_s",
]


def ring_s(nbytes: float, ranks: Sequence[int], cluster: ClusterSpec, passes: int) -> float:
    """A ring collective over ``ranks`` of ``nbytes`` in all: ``passes`` = 2 for an all-reduce, 1 for a
    reduce-scatter or an all-gather (each pass: n - 1 steps of latency + bytes / n)."""
    n = len(ranks)
    if n <= 1 or nbytes <= 0:
        return 0.0
    bandwidth, latency = cluster.link(list(ranks))
    return passes * ((n - 1) * latency + (n - 1) / n * nbytes / bandwidth)


def ring_allreduce_s(nbytes: float, ranks: Sequence[int], cluster: ClusterSpec) -> float:
    """A ring all-reduce of ``nbytes`` over ``ranks``: 2 (n - 1) latencies + 2 (n - 1) / n x bytes / bandwidth."""
    return ring_s(nbytes, ranks, cluster, 2)


def zero3_gathers_s(
    numel: float, weight_bytes: float, cluster: ClusterSpec, *, dp: int, tp: int, backward_too: bool
) -> tuple[float, float]:
    """(forward, backward) seconds of ZeRO-3's all-gathers of one stage's parameters per microbatch."""
    one = ring_s(numel * weight_bytes, dp_ranks(dp, tp), cluster, 1)
    return one, (one if backward_too else 0.0)


def tp_ranks(dp: int, tp: int) -> list[int]:
    """The first TP group under [Note: rank order] (TP fastest)."""
    del dp
    return list(range(tp))


def dp_ranks(dp: int, tp: int) -> list[int]:
    """The first DP group (same pp and tp coordinates)."""
    return [d * tp for d in range(dp)]


def p2p_link(dp: int, tp: int, pp: int, cluster: ClusterSpec) -> tuple[float, float]:
    """(latency, bandwidth) of the slowest link between neighbouring stages of one pipeline."""
    if pp < 2:
        return 0.0, math.inf
    stride = dp * tp
    worst = max(range(pp - 1), key=lambda s: cluster.node_of(s * stride) != cluster.node_of((s + 1) * stride))
    bandwidth, latency = cluster.link([worst * stride, (worst + 1) * stride])
    return latency, bandwidth


def exposed_tp_s(comm: float, compute: float, overlap: bool, chunks: int) -> float:
    """TP communication left on the critical path when ``chunks`` sub-microbatches overlap it with ``compute``."""
    if not overlap or chunks < 2 or comm <= 0:
        return comm
    return max(comm / chunks, comm - compute * (chunks - 1) / chunks)


def small_allreduce_s(ranks: Sequence[int], cluster: ClusterSpec) -> float:
    """A few bytes all-reduced over ``ranks``: latency only, over a tree (2 log2 n hops), as
    collective libraries do for tiny messages (a ring would pay 2 (n - 1))."""
    n = len(ranks)
    if n <= 1:
        return 0.0
    return 2 * math.ceil(math.log2(n)) * cluster.link(list(ranks))[1]
