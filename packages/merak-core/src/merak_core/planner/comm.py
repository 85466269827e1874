"""Communication costs: :class:`CommModel` (point-to-point and ring all-reduce) and :func:`measure_comm`."""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass, field
from typing import Any

import torch

from merak_core.planner.clock import now, timed

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
    allreduce_by_group: dict[int, list[tuple[float, float]]] = field(default_factory=dict)
    """Measured all-reduce times per group size: ``{n: [(bytes, seconds), ...]}`` at a few message
    sizes, timed with every group of that size reducing at once (as the DP or TP groups of a layout
    do). Between two sizes the time is interpolated linearly, below the smallest it is the
    smallest's, above the largest it grows with the last segment's slope. Group sizes not listed
    use the ring formula."""
    sync_wait_s: float = 0.0
    """Extra seconds every synchronisation (a TP all-reduce, a pipeline message a rank waits for, a
    per-step collective) costs while all ranks compute at once: on a host with fewer cores than
    ranks, the peer being waited for must first be scheduled. About 0 with a device per rank."""
    per_action_s: float = 0.0
    """The pipeline runtime's own host seconds per action (each compute action and each message it
    sends or receives; merak_pipe's ``CostModel.per_action``): measured by ``bench_pipe_runtime.py
    --section actions`` and by ``layout: auto`` (:func:`~merak_core.planner.action_cost.measure_action_cost`).
    0: left out (a cluster file states it as ``device.per_action_us``)."""
    split_backward_scale: float = 1.0
    """The runtime's split backward against a full one, ``(I + W) / B`` of the same stage: what ZB-H1
    and ZB-V pay for splitting each backward (merak_pipe's ``I`` and ``W`` are two autograd calls, and
    ``W`` builds a weight plan); the simulator's ``backward_input`` and ``backward_weight`` are each
    half of ``B`` times it. ``layout: auto`` measures it on one block of the job's model
    (:func:`~merak_core.planner.action_cost.measure_split_backward_scale`, [Note: split backward
    measurement] there); ``benchmarks/bench_virtual_stages.py`` (its I / W columns) on half a
    stage: 1.35-1.54 on this repository's 2-core CPU machine (docs/virtual_stages.md). 1 (the
    default): a split as cheap as a full backward."""

    def __post_init__(self) -> None:
        table: dict[int, list[tuple[float, float]]] = {}
        for n, points in dict(self.allreduce_by_group).items():  # JSON gives string keys and lists
            pairs = sorted((float(x), float(t)) for x, t in points)
            if int(n) < 2 or not pairs or any(not (x >= 0 and t >= 0) for x, t in pairs):
                raise ValueError(
                    f"CommModel.allreduce_by_group[{n!r}]={points!r}: expected a group size >= 2 and "
                    "a non-empty list of (bytes >= 0, seconds >= 0)"
                )
            table[int(n)] = pairs
        self.allreduce_by_group = table
        for name in ("p2p_latency_s", "allreduce_latency_s", "sync_wait_s", "per_action_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"CommModel.{name}={getattr(self, name)!r}: expected seconds >= 0")
        if not (self.split_backward_scale > 0 and math.isfinite(self.split_backward_scale)):
            raise ValueError(
                f"CommModel.split_backward_scale={self.split_backward_scale!r}: expected (I + W) / B, a finite "
                "factor > 0 (1: the split costs a full backward)"
            )
        for name in ("p2p_bandwidth", "allreduce_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(
                    f"CommModel.{name}={getattr(self, name)!r}: expected bytes/s > 0 (math.inf: free)"
                )

    def allreduce_s(self, nbytes: float, group_size: int) -> float:
        """All-reduce time of ``nbytes`` over ``group_size`` ranks; 0 for one rank.

        A measured group size (``allreduce_by_group``) interpolates its measured times; otherwise the ring formula: 2 (n - 1) latencies plus 2 (n - 1) / n of the bytes over one link.
        """
        if group_size <= 1 or nbytes <= 0:
            return 0.0
        n = group_size
        points = self.allreduce_by_group.get(n)
        if points:
            return _interpolate(points, nbytes)
        return 2 * (n - 1) * self.allreduce_latency_s + 2 * (n - 1) / n * nbytes / self.allreduce_bandwidth


def measure_comm(
    group: Any = None,
    *,
    small_bytes: int = 1024,
    large_bytes: int = 1 << 20,
    repeats: int = 5,
    device: torch.device | None = None,
) -> CommModel:
    """Measure a :class:`CommModel` with the real collectives of ``group`` (default: the world).

    Every rank of the group must call it. Point-to-point: ranks 0 and 1 of the group ping-pong a
    small and a large float32 message (one-way time = half the round trip); all-reduce: the whole
    group all-reduces both sizes. Latency and bandwidth are the intercept and slope of the two
    points (ring formula for the all-reduce). Every rank returns rank 0's numbers. A group of one
    rank returns the defaults. The messages live on ``device`` (default: the group's collective
    device, this rank's GPU under NCCL) and every time is taken after the device finished.
    """
    import torch.distributed as dist

    from merak_core.parallel.devices import collective_device

    if not 0 < small_bytes < large_bytes or repeats < 1:
        raise ValueError(
            f"measure_comm: small_bytes={small_bytes}, large_bytes={large_bytes}, repeats={repeats}; "
            "expected 0 < small_bytes < large_bytes and repeats >= 1"
        )
    n = dist.get_world_size(group)
    if n < 2:
        return CommModel()
    dev = device if device is not None else collective_device(group)
    rank = dist.get_rank(group)
    peer0, peer1 = (dist.get_global_rank(group, r) if group is not None else r for r in (0, 1))
    results = []
    for nbytes in (small_bytes, large_bytes):
        buf = torch.zeros(max(nbytes // 4, 1), device=dev)

        def ping(buf: torch.Tensor = buf) -> None:
            if rank == 0:
                dist.send(buf, peer1, group=group)
                dist.recv(buf, peer1, group=group)
            elif rank == 1:
                dist.recv(buf, peer0, group=group)
                dist.send(buf, peer0, group=group)

        one_way = timed(ping, repeats, dev) / 2
        dist.barrier(group=group)
        reduce_s = timed(lambda buf=buf: dist.all_reduce(buf, group=group), repeats, dev)
        results.append((one_way, reduce_s))
    (p_small, r_small), (p_large, r_large) = results
    delta = float(large_bytes - small_bytes)
    p_bw = delta / (p_large - p_small) if p_large > p_small else math.inf
    p_lat = max(p_small - small_bytes / p_bw, 0.0)
    ring = 2 * (n - 1) / n
    r_bw = ring * delta / (r_large - r_small) if r_large > r_small else math.inf
    r_lat = max(r_small - ring * small_bytes / r_bw, 0.0) / (2 * (n - 1))
    values = torch.tensor([p_lat, p_bw, r_lat, r_bw], dtype=torch.float64, device=dev)
    dist.broadcast(values, peer0, group=group)
    p_lat, p_bw, r_lat, r_bw = (float(v) for v in values)
    logger.info(
        "planner: measured p2p %.3g s + bytes / %.3g B/s; all-reduce step %.3g s, link %.3g B/s over %d ranks",
        p_lat,
        p_bw,
        r_lat,
        r_bw,
        n,
    )
    table = _allreduce_table(max(3 * repeats, 15), dev) if group is None else {}
    wait = _sync_wait(repeats, dev) if group is None else 0.0
    return CommModel(
        p2p_latency_s=p_lat,
        p2p_bandwidth=p_bw,
        allreduce_latency_s=r_lat,
        allreduce_bandwidth=r_bw,
        allreduce_by_group=table,
        sync_wait_s=wait,
    )


def _sync_wait(repeats: int, device: torch.device, *, iterations: int = 20, width: int = 192) -> float:
    """Extra seconds per synchronisation while every rank computes (see ``CommModel.sync_wait_s``).

    Ranks are paired (all pairs at once, an odd last rank pairs with itself); every rank runs
    ``iterations`` small matrix products, once alone and once with an 8-byte all-reduce in its
    pair after each product, as tensor-parallel layers do. The extra time per iteration, less the
    all-reduce's own time on an idle machine, is the wait for a peer that is not running. The
    median over ``repeats`` runs of the slowest rank.
    """
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    if world < 2:
        return 0.0
    pairs = [dist.new_group([b, b + 1]) if b + 1 < world else None for b in range(0, world, 2)]
    mine = pairs[rank // 2]
    a = torch.randn(width, width, device=device)
    flag = torch.zeros(2, device=device)

    def run(sync: bool) -> float:
        dist.barrier()
        start = now(device)
        for _ in range(iterations):
            a @ a
            if sync and mine is not None:
                dist.all_reduce(flag, group=mine)
        seconds = torch.tensor([(now(device) - start) / iterations], dtype=torch.float64, device=device)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        return float(seconds)

    run(True)
    plain = statistics.median(run(False) for _ in range(repeats))
    synced = statistics.median(run(True) for _ in range(repeats))
    dist.barrier()
    idle = torch.tensor(
        [_mean_call(lambda: dist.all_reduce(flag, group=mine), repeats, device) if mine is not None else 0.0],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(idle, op=dist.ReduceOp.MAX)
    for g in pairs:
        if g is not None:
            dist.destroy_process_group(g)
    return max(synced - plain - float(idle), 0.0)


def _interpolate(points: list[tuple[float, float]], nbytes: float) -> float:
    if nbytes <= points[0][0]:
        return points[0][1]
    for (x0, t0), (x1, t1) in zip(points, points[1:], strict=False):
        if nbytes <= x1:
            return t0 + (t1 - t0) * (nbytes - x0) / (x1 - x0) if x1 > x0 else t1
    if len(points) == 1:
        return points[0][1]
    (x0, t0), (x1, t1) = points[-2], points[-1]
    slope = max((t1 - t0) / (x1 - x0), 0.0) if x1 > x0 else 0.0
    return t1 + slope * (nbytes - x1)


ALLREDUCE_SIZES = (8, 4096, 65536, 1 << 20, 4 << 20)
"""Message sizes (bytes) at which :func:`measure_comm` times the all-reduce of each group size."""


def _mean_call(fn: Any, repeats: int, device: torch.device | None = None) -> float:
    """Mean seconds of one call after two warm-ups. The mean, not the median: on a host whose cores
    are shared, a collective's time is bimodal (fast, or one scheduler tick later), and a step
    pays the mean over its many calls."""
    for _ in range(2):
        fn()
    start = now(device)
    for _ in range(repeats):
        fn()
    return (now(device) - start) / repeats


def _allreduce_table(repeats: int, device: torch.device) -> dict[int, list[tuple[float, float]]]:
    """All-reduce time at :data:`ALLREDUCE_SIZES` for every group size n dividing the world (n >= 2).

    The world is cut into blocks of n consecutive ranks that all reduce at once, as a layout's DP
    or TP groups do. gloo changes algorithm with the message size, so the sizes are measured, not
    fitted by one line. A size's time is the mean call of the slowest rank.
    """
    import torch.distributed as dist

    world = dist.get_world_size()
    rank = dist.get_rank()
    table: dict[int, list[tuple[float, float]]] = {}
    for n in range(2, world + 1):
        if world % n:
            continue
        groups = [dist.new_group(list(range(b, b + n))) if n < world else None for b in range(0, world, n)]
        mine = groups[rank // n]
        points: list[tuple[float, float]] = []
        for nbytes in ALLREDUCE_SIZES:
            buf = torch.zeros(max(nbytes // 4, 1), device=device)
            dist.barrier()
            seconds = torch.tensor(
                [_mean_call(lambda buf=buf, g=mine: dist.all_reduce(buf, group=g), repeats, device)],
                dtype=torch.float64,
                device=device,
            )
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            # A larger message never costs less (measured dips are noise or an algorithm switch).
            points.append((float(nbytes), max(float(seconds), points[-1][1] if points else 0.0)))
        table[n] = points
        for g in groups:
            if g is not None:
                dist.destroy_process_group(g)
    return table
