"""The ``actions`` section of ``bench_pipe_runtime.py``: the runtime's fixed cost per action.

Every registered schedule runs on tiny stages (one 16-wide linear layer each, so compute is
negligible); the step time with the profile off, divided by the busiest rank's number of actions
(compute and send/recv of the lowered schedule), is the fixed cost per action. Steps run inside
``runner.profiling()`` then split a span's host time per kind into Python, waiting and torch ops
([Note: profile cost] in ``merak_pipe/action_profile.py``: the profiled steps include the
profiler's own cost, the fixed cost per action does not).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def timed(step: Callable[[], None]) -> float:
    """One step's time: the slowest rank's, after a barrier."""
    dist.barrier()
    start = time.perf_counter()
    step()
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


TINY = 16
_KINDS = ("forward", "backward", "backward_input", "backward_weight", "send", "recv", "release", "control")


def _tiny_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def actions_section(
    world: int, name: str, microbatches: int, warmup: int, rounds: int
) -> dict[str, Any] | None:
    from merak_pipe.runner import PipelineRunner
    from merak_pipe.schedules import build_schedule
    from merak_pipe.schedules.registry import schedule_info
    from merak_pipe.stage import PipelineStage

    rank = dist.get_rank()
    num_stages = world * (schedule_info(name).stages_per_rank or 2)
    schedule = build_schedule(name, num_stages=num_stages, num_microbatches=microbatches, num_ranks=world)
    torch.manual_seed(0)
    stages = [
        PipelineStage(nn.Linear(TINY, TINY), stage_index=s, num_stages=num_stages)
        for s in schedule.stages_of(rank)
    ]
    runner = PipelineRunner(stages, schedule, loss_fn=_tiny_loss)
    x, y = torch.randn(microbatches, TINY), torch.randn(microbatches, TINY)

    def step() -> None:
        runner.step(x if runner.holds_first_stage else None, y if runner.holds_last_stage else None)

    for _ in range(warmup):
        step()
    step_s = statistics.median(timed(step) for _ in range(rounds))
    with runner.profiling() as profile:
        for _ in range(rounds):
            dist.barrier()
            step()
    from merak_pipe.action_profile import gather_spans

    spans = gather_spans(profile.spans)
    if rank != 0:
        return None
    lowered = runner.schedule
    per_rank = max(len(lowered.actions[r]) for r in range(world))
    summary = profile.summary(spans)
    by_kind: dict[str, list[Any]] = {}
    for span in spans:
        by_kind.setdefault(span.category, []).append(span)
    # Medians per span: a span that the loaded machine descheduled should not set the row.
    kinds = {
        kind: tuple(statistics.median(getattr(s, f) for s in group) for f in ("host_s", "python_s", "wait_s"))
        for kind, group in by_kind.items()
    }
    return {
        "stages": num_stages,
        "actions": per_rank,
        "step_s": step_s,
        "per_action_s": step_s / per_rank,
        "kinds": kinds,
        "python_share": sum(r["python_s"] for r in summary.values())
        / sum(r["host_s"] for r in summary.values()),
        "wait_share": sum(r["wait_s"] for r in summary.values()) / sum(r["host_s"] for r in summary.values()),
        "profiled_step_s": sum(r["host_s"] for r in summary.values()) / (rounds * world),
    }


def print_actions(run_world: Callable[..., list[Any]], worlds: list[int], warmup: int, rounds: int) -> None:
    from merak_pipe.schedules.registry import schedule_infos

    print(f"\n## fixed cost per action: tiny stages (Linear {TINY}x{TINY}), 8 microbatches of 1 row")
    print(
        "| schedule | ranks | stages | actions (busiest rank) | step (median, s) | per action (us) "
        "| profiled step (mean per rank, s) |"
    )
    print("|---|---|---|---|---|---|---|")
    breakdown = []
    for world in worlds:
        for info in schedule_infos():
            res = run_world(world, actions_section, world, info.name, 8, warmup, rounds)[0]
            print(
                f"| {info.name} | {world} | {res['stages']} | {res['actions']} | {res['step_s']:.4f} "
                f"| {1e6 * res['per_action_s']:.0f} | {res['profiled_step_s']:.4f} |",
                flush=True,
            )
            breakdown.append((info.name, world, res))
    print("\n## per-kind host time per span, profiled (median us: host / of it Python / of it waiting)")
    print("| schedule | ranks | " + " | ".join(_KINDS) + " | Python share | wait share |")
    print("|---|---|" + "---|" * len(_KINDS) + "---|---|")
    for name, world, res in breakdown:
        cells = [
            "-"
            if k not in res["kinds"]
            else "{:.0f} / {:.0f} / {:.0f}".format(*(1e6 * v for v in res["kinds"][k]))
            for k in _KINDS
        ]
        print(
            f"| {name} | {world} | " + " | ".join(cells) + f" | {100 * res['python_share']:.0f}% "
            f"| {100 * res['wait_share']:.0f}% |",
            flush=True,
        )
