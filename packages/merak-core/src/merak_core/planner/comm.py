"""Communication costs: :class:`CommModel` (point-to-point and ring all-reduce) and :func:`measure_comm`."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
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
    allreduce_by_group: dict[int, tuple[float, float]] = field(default_factory=dict)
    """Measured all-reduce costs per group size: ``{n: (fixed seconds, seconds per byte)}``, timed
    with every group of that size reducing at once (as the DP or TP groups of a layout do). Sizes
    not listed use the ring formula."""

    def __post_init__(self) -> None:
        table = {}
        for n, pair in dict(self.allreduce_by_group).items():  # JSON gives string keys and lists
            fixed, per_byte = (float(v) for v in pair)
            if int(n) < 2 or not fixed >= 0 or not per_byte >= 0:
                raise ValueError(f"CommModel.allreduce_by_group[{n!r}]={pair!r}: expected a group size >= 2 and "
                                 "(fixed seconds >= 0, seconds per byte >= 0)")
            table[int(n)] = (fixed, per_byte)
        self.allreduce_by_group = table
        for name in ("p2p_latency_s", "allreduce_latency_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"CommModel.{name}={getattr(self, name)!r}: expected seconds >= 0")
        for name in ("p2p_bandwidth", "allreduce_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"CommModel.{name}={getattr(self, name)!r}: expected bytes/s > 0 (math.inf: free)")

    def allreduce_s(self, nbytes: float, group_size: int) -> float:
        """All-reduce time of ``nbytes`` over ``group_size`` ranks; 0 for one rank.

        A measured group size (``allreduce_by_group``) uses its fixed cost plus its per-byte cost;
        otherwise the ring formula: 2 (n - 1) latencies plus 2 (n - 1) / n of the bytes over one link.
        """
        if group_size <= 1 or nbytes <= 0:
            return 0.0
        n = group_size
        if n in self.allreduce_by_group:
            fixed, per_byte = self.allreduce_by_group[n]
            return fixed + per_byte * nbytes
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
    table = _allreduce_table(small_bytes, large_bytes, repeats) if group is None else {}
    return CommModel(p2p_latency_s=p_lat, p2p_bandwidth=p_bw, allreduce_latency_s=r_lat, allreduce_bandwidth=r_bw,
                     allreduce_by_group=table)


def _allreduce_table(small_bytes: int, large_bytes: int, repeats: int) -> dict[int, tuple[float, float]]:
    """Fixed and per-byte all-reduce cost for every group size n dividing the world (n >= 2).

    The world is cut into blocks of n consecutive ranks that all reduce at once, as a layout's DP
    or TP groups do; a size's time is the slowest rank's.
    """
    import torch.distributed as dist

    world = dist.get_world_size()
    rank = dist.get_rank()
    table: dict[int, tuple[float, float]] = {}
    for n in range(2, world + 1):
        if world % n:
            continue
        groups = [dist.new_group(list(range(b, b + n))) if n < world else None for b in range(0, world, n)]
        mine = groups[rank // n]
        times = []
        for nbytes in (small_bytes, large_bytes):
            buf = torch.zeros(max(nbytes // 4, 1))
            dist.barrier()
            seconds = torch.tensor([_timed(lambda buf=buf, g=mine: dist.all_reduce(buf, group=g), repeats)],
                                   dtype=torch.float64)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            times.append(float(seconds))
        per_byte = max((times[1] - times[0]) / (large_bytes - small_bytes), 0.0)
        table[n] = (max(times[0] - per_byte * small_bytes, 0.0), per_byte)
        for g in groups:
            if g is not None:
                dist.destroy_process_group(g)
    return table
