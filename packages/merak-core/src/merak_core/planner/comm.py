"""Communication costs: :class:`CommModel` (point-to-point and ring all-reduce) and :func:`measure_comm`."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from merak_core.planner.profile import _timed

logger = logging.getLogger(__name__)

__all__ = ["CommModel", "measure_comm"]


@dataclass(kw_only=True)
class CommModel:
    """Communication costs: point-to-point and ring all-reduce (defaults are assumptions, not measured)."""

    p2p_latency_s: float = 50e-6
    """Latency of one point-to-point message, seconds."""
    p2p_bandwidth: float = 2e9
    """Point-to-point bytes per second."""
    allreduce_latency_s: float = 50e-6
    """Latency of one ring step of an all-reduce, seconds."""
    allreduce_bandwidth: float = 2e9
    """Bytes per second of one ring link."""

    def __post_init__(self) -> None:
        for name in ("p2p_latency_s", "allreduce_latency_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"CommModel.{name}={getattr(self, name)!r}: expected seconds >= 0")
        for name in ("p2p_bandwidth", "allreduce_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"CommModel.{name}={getattr(self, name)!r}: expected bytes/s > 0 (math.inf: free)")

    def allreduce_s(self, nbytes: float, group_size: int) -> float:
        """Ring all-reduce time: 2 (n - 1) latencies plus 2 (n - 1) / n of the bytes over one link; 0 for n = 1."""
        if group_size <= 1 or nbytes <= 0:
            return 0.0
        n = group_size
        return 2 * (n - 1) * self.allreduce_latency_s + 2 * (n - 1) / n * nbytes / self.allreduce_bandwidth


def measure_comm(group: Any = None, *, small_bytes: int = 1024, large_bytes: int = 1 << 20,
                 repeats: int = 5) -> CommModel:
    """Measure a :class:`CommModel` with the real collectives of ``group`` (default: the world).

    Every rank of the group must call it. Point-to-point: ranks 0 and 1 of the group ping-pong a
    small and a large float32 message (one-way time = half the round trip); all-reduce: the whole
    group all-reduces both sizes. Latency and bandwidth are the intercept and slope of the two
    points (ring formula for the all-reduce). Every rank returns rank 0's numbers. A group of one
    rank returns the defaults.
    """
    import torch.distributed as dist

    if not 0 < small_bytes < large_bytes or repeats < 1:
        raise ValueError(f"measure_comm: small_bytes={small_bytes}, large_bytes={large_bytes}, repeats={repeats}; "
                         "expected 0 < small_bytes < large_bytes and repeats >= 1")
    n = dist.get_world_size(group)
    if n < 2:
        return CommModel()
    rank = dist.get_rank(group)
    peer0, peer1 = (dist.get_global_rank(group, r) if group is not None else r for r in (0, 1))
    results = []
    for nbytes in (small_bytes, large_bytes):
        buf = torch.zeros(max(nbytes // 4, 1))

        def ping(buf: torch.Tensor = buf) -> None:
            if rank == 0:
                dist.send(buf, peer1, group=group)
                dist.recv(buf, peer1, group=group)
            elif rank == 1:
                dist.recv(buf, peer0, group=group)
                dist.send(buf, peer0, group=group)

        one_way = _timed(ping, repeats) / 2
        dist.barrier(group=group)
        reduce_s = _timed(lambda buf=buf: dist.all_reduce(buf, group=group), repeats)
        results.append((one_way, reduce_s))
    (p_small, r_small), (p_large, r_large) = results
    delta = float(large_bytes - small_bytes)
    p_bw = delta / (p_large - p_small) if p_large > p_small else math.inf
    p_lat = max(p_small - small_bytes / p_bw, 0.0)
    ring = 2 * (n - 1) / n
    r_bw = ring * delta / (r_large - r_small) if r_large > r_small else math.inf
    r_lat = max(r_small - ring * small_bytes / r_bw, 0.0) / (2 * (n - 1))
    values = torch.tensor([p_lat, p_bw, r_lat, r_bw], dtype=torch.float64)
    dist.broadcast(values, peer0, group=group)
    p_lat, p_bw, r_lat, r_bw = (float(v) for v in values)
    logger.info("planner: measured p2p %.3g s + bytes / %.3g B/s; all-reduce step %.3g s, link %.3g B/s over %d ranks",
                p_lat, p_bw, r_lat, r_bw, n)
    return CommModel(p2p_latency_s=p_lat, p2p_bandwidth=p_bw, allreduce_latency_s=r_lat, allreduce_bandwidth=r_bw)
