"""How much slower a model runs with every rank computing at once: :func:`measure_contention` (collective).

CPU ranks on one host share its cores; ``world_size / measure_contention(...)`` is the planner's
``compute_slots`` for the real model.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping

import torch
from torch import nn

from merak_core.planner.clock import forward_backward, now

__all__ = ["measure_contention"]


def measure_contention(
    model: nn.Module,
    sample: torch.Tensor | Mapping[str, torch.Tensor],
    *,
    seconds: float = 0.5,
    rounds: int = 3,
) -> float:
    """How much slower the model's forward and backward run when every rank runs it at once (collective).

    Rank 0 runs ``model(sample)`` forward and backward alone for ``seconds`` (the others wait),
    then every rank runs it for three times as long at the same time (rank 0 counts only the steps
    of the middle third, when all ranks are surely running); the result is rank 0's median step
    together over its median step alone (later steps only), the median over ``rounds`` such pairs
    (the ratio is noisy on shared cores): 1 when each rank has a core or a device
    of its own, about ranks / cores or more when processes share cores. It is the same on every
    rank. ``world_size / measure_contention(...)`` is the planner's ``compute_slots`` for the real
    model (small operators share cores worse than large ones). Gradients and the random stream are
    left as they were.
    """
    import torch.distributed as dist

    if not seconds > 0 or rounds < 1:
        raise ValueError(
            f"measure_contention: seconds={seconds!r}, rounds={rounds!r}; expected seconds > 0 and "
            "rounds >= 1"
        )
    from merak_core.parallel.devices import collective_device

    first = sample if isinstance(sample, torch.Tensor) else next(iter(sample.values()))
    dev = first.device

    def step() -> None:
        forward_backward(model, sample)

    def per_step(duration: float, window: tuple[float, float]) -> float:
        """Median seconds of the steps that ran entirely inside ``window`` (fractions of ``duration``)."""
        start = now(dev)
        begin, end = start + window[0] * duration, start + window[1] * duration
        inside: list[float] = []
        while (before := now(dev)) < start + duration:
            step()
            after = now(dev)
            if before >= begin and after <= end:
                inside.append(after - before)
        return statistics.median(inside) if inside else now(dev) - start

    with torch.random.fork_rng(devices=[first.device] if first.device.type == "cuda" else []):
        try:
            step()  # warm-up
            ratios = []
            for _ in range(rounds):
                dist.barrier()
                alone = per_step(seconds, (0.2, 1.0)) if dist.get_rank() == 0 else 0.0
                dist.barrier()
                together = per_step(seconds * 3, (0.33, 0.67))
                ratios.append(together / alone if alone > 0 else 1.0)
        finally:
            model.zero_grad(set_to_none=True)
    ratio = torch.tensor([statistics.median(ratios)], dtype=torch.float64, device=collective_device())
    dist.broadcast(ratio, 0)
    return min(max(float(ratio), 1.0), float(dist.get_world_size()))
