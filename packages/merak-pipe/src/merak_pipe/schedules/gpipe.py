"""GPipe: every stage runs all forwards, then all backwards (peak: M microbatches per stage)."""

from __future__ import annotations

from merak_pipe.ir import Action, RecomputePlan, Schedule
from merak_pipe.schedules._common import B, F, one_stage_per_rank

__all__ = ["gpipe"]


def gpipe(
    *,
    num_stages: int,
    num_microbatches: int,
    num_ranks: int | None = None,
    recompute: RecomputePlan | None = None,
) -> Schedule:
    """All forwards in microbatch order, then all backwards in microbatch order."""
    stage_to_rank = one_stage_per_rank("gpipe", num_stages, num_ranks)
    actions: dict[int, list[Action]] = {}
    for stage in range(num_stages):
        actions[stage] = [Action(stage, F, m) for m in range(num_microbatches)]
        actions[stage] += [Action(stage, B, m) for m in range(num_microbatches)]
    return Schedule("gpipe", num_stages, num_microbatches, stage_to_rank, actions, recompute=recompute)
