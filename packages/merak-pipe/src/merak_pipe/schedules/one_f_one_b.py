"""1F1B (PipeDream-flush): warm-up forwards, one-forward-one-backward, cool-down backwards.

Stage i holds at most min(S - i, M) microbatches of activations. With a recompute plan the
backward recomputes inside itself (no ``R`` actions; see [Note: recompute actions] in ir.py).
"""

from __future__ import annotations

from merak_pipe.ir import Action, RecomputePlan, Schedule
from merak_pipe.schedules._common import B, F, one_f_one_b_order, one_stage_per_rank

__all__ = ["one_f_one_b"]


def one_f_one_b(
    *,
    num_stages: int,
    num_microbatches: int,
    num_ranks: int | None = None,
    recompute: RecomputePlan | None = None,
) -> Schedule:
    """The 1F1B schedule, one stage per rank."""
    stage_to_rank = one_stage_per_rank("1f1b", num_stages, num_ranks)
    actions: dict[int, list[Action]] = {}
    for stage in range(num_stages):
        actions[stage] = [
            Action(stage, F if kind == "F" else B, m)
            for kind, m in one_f_one_b_order(stage, num_stages, num_microbatches)
        ]
    return Schedule("1f1b", num_stages, num_microbatches, stage_to_rank, actions, recompute=recompute)
