"""The pipeline runtime's own cost per action: :func:`measure_action_cost` (collective), :func:`busiest_actions`.

[Note: per-action measurement]
merak_pipe's runner spends host time on every action of a step besides the math (issuing a send or a
receive, waking up when one arrives, the bookkeeping around a forward or a backward). ``layout: auto``
measures it on the ranks it has, as ``bench_pipe_runtime.py --section actions`` does: every rank
holds one stage of a plain 1F1B pipeline over the whole world whose stage is a tiny linear layer (its
compute is negligible), the step time (the slowest rank's, the median of a few steps) divided by the
busiest rank's number of lowered actions is the seconds per action. It is the planner's
``CommModel.per_action_s`` (priced by merak_pipe's simulator) and what a cluster file's
``device.per_action_us`` states for other machines. The same number on every rank (every step's time
is the slowest rank's).
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
from torch import nn

from merak_core.planner.clock import now

__all__ = ["action_probe", "busiest_actions", "measure_action_cost", "runtime_actions_s"]

_WIDTH = 16


def busiest_actions(schedule: Any) -> int:
    """The most lowered actions (compute, send, receive and the runtime's own) any rank runs in a step."""
    from merak_pipe import lower

    lowered = schedule if schedule.lowered else lower(schedule)
    return max(len(lowered.actions[r]) for r in range(lowered.num_ranks))


def _tiny_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def measure_action_cost(
    *, microbatches: int = 4, rounds: int = 5, warmup: int = 2, device: torch.device | None = None
) -> float:
    """Seconds the pipeline runtime spends per action on this machine (collective; [Note: per-action measurement]).

    Every rank of the default group must call it; one rank (no pipeline) returns 0. A few tens of
    milliseconds on two CPU ranks. The random stream is left as it was.
    """
    import torch.distributed as dist

    from merak_core.parallel.devices import collective_device

    if microbatches < 1 or rounds < 1 or warmup < 0:
        raise ValueError(
            f"measure_action_cost: microbatches={microbatches}, rounds={rounds}, warmup={warmup}; expected "
            "microbatches >= 1, rounds >= 1, warmup >= 0"
        )
    if dist.get_world_size() < 2:
        return 0.0
    dev = device if device is not None else collective_device()
    run_step, actions = action_probe(microbatches, dev)

    def step() -> float:
        dist.barrier()
        start = now(dev)
        run_step()
        elapsed = torch.tensor([now(dev) - start], dtype=torch.float64, device=dev)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's: the same on every rank
        return float(elapsed)

    for _ in range(warmup):
        step()
    step_s = statistics.median(step() for _ in range(rounds))
    return step_s / actions


def action_probe(microbatches: int, device: torch.device) -> tuple[Any, int]:
    """The probe of [Note: per-action measurement] on this rank (collective: every rank of the default
    group): a function that runs one step of it, and the busiest rank's number of lowered actions.
    For a caller that times the step its own way (``bench_cluster_plan.py steps``: CPU time)."""
    import torch.distributed as dist

    from merak_pipe import PipelineRunner, PipelineStage, build_schedule

    world, rank = dist.get_world_size(), dist.get_rank()
    schedule = build_schedule("1f1b", num_stages=world, num_microbatches=microbatches)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        layer = nn.Linear(_WIDTH, _WIDTH).to(device)
        x = torch.randn(microbatches, _WIDTH, device=device)
        y = torch.randn(microbatches, _WIDTH, device=device)
    runner = PipelineRunner(
        [PipelineStage(layer, stage_index=rank, num_stages=world, device=device)],
        schedule,
        loss_fn=_tiny_loss,
    )

    def run_step() -> None:
        runner.step(x if runner.holds_first_stage else None, y if runner.holds_last_stage else None)

    return run_step, busiest_actions(runner.schedule)


def runtime_actions_s(per_action_s: float, schedule: Any) -> float:
    """The runtime's own seconds in a step of ``schedule``: ``per_action_s`` x :func:`busiest_actions`.

    The cluster model adds it to a pipelined step (``ClusterSpec.per_action_s``); the inverse of the
    measurement ([Note: per-action measurement]). 0 for one pipeline rank (no pipeline runtime) or
    a zero cost (then the schedule is not lowered).
    """
    if per_action_s == 0.0 or schedule.num_ranks < 2:
        return 0.0
    return per_action_s * busiest_actions(schedule)
