"""ZB-H1 (zero-bubble, "handcrafted 1"): 1F1B with the backward split into I and W.

Stage i runs the same min(S - 1 - i, M) warm-up forwards as 1F1B, then F, I, W per step, and
in the cool-down I then W. The input-gradient pass I is all the upstream stage waits for, so the
gradient wave travels at I's speed and the W passes fill what were 1F1B's cool-down bubbles.
A microbatch is released after its W, so stage i holds at most min(S - i, M) microbatches:
1F1B's memory (Qi et al., "Zero Bubble Pipeline Parallelism", 2023).
"""

from __future__ import annotations

from merak_pipe.ir import Action, RecomputePlan, Schedule
from merak_pipe.schedules._common import F, I, W, one_f_one_b_order, one_stage_per_rank

__all__ = ["zb_h1"]


def zb_h1(
    *,
    num_stages: int,
    num_microbatches: int,
    num_ranks: int | None = None,
    recompute: RecomputePlan | None = None,
) -> Schedule:
    """ZB-H1, one stage per rank."""
    stage_to_rank = one_stage_per_rank("zb-h1", num_stages, num_ranks)
    actions: dict[int, list[Action]] = {}
    for stage in range(num_stages):
        ops: list[Action] = []
        for kind, m in one_f_one_b_order(stage, num_stages, num_microbatches):
            if kind == "F":
                ops.append(Action(stage, F, m))
            else:
                ops.append(Action(stage, I, m))
                ops.append(Action(stage, W, m))
        actions[stage] = ops
    return Schedule("zb-h1", num_stages, num_microbatches, stage_to_rank, actions, recompute=recompute)
