"""Merak's shifted-critical-path schedule: 1F1B with recomputation moved off the critical path.

Starting from 1F1B with activation checkpointing (Lai et al., 2022):

(a) the last stage runs each backward right after its forward, so it keeps its activations and
    never recomputes (its recompute fraction is forced to 0);
(b) a stage that recomputes runs an explicit ``R`` action for microbatch k right before it would
    start waiting for k's gradient (after its last forward in steady state, right after the
    previous backward in the cool-down), so the recompute overlaps the wait instead of
    following the gradient's arrival;
(c) stages that recompute everything keep only their stage inputs, so they can afford a deeper
    warm-up: by default stage i runs ``2 * (S - 1 - i)`` warm-up forwards instead of 1F1B's
    ``S - 1 - i``, which feeds the last stage earlier and fills the wait for the first gradient.
    ``extra_warmup`` overrides this (an int for every stage, or one int per stage).

Stages with a fraction strictly between 0 and 1 keep 1F1B's warm-up by default (their kept
activations grow with the warm-up depth).

[Note: warm-up depths] Stage i's warm-up (its forwards before its first backward) needs that
many forwards from stage i - 1, which runs only its own warm-up (plus one steady-state forward)
before it waits for its first gradient: a stage never warms up deeper than the stage before it,
or the two deadlock. Under NCCL's rules (one in-order stream per rank, a send completing with its
receive) a middle stage that runs far ahead of the next one can also block the gradient its
predecessor waits for. So the default depths are cut to the family that validates for every plan
(checked for every plan of up to 7 stages, see the tests): each stage at least 1 and at most 2
forwards deeper than the next, as in 1F1B (1) and full recomputation (2). A plan where a later
stage recomputes everything and an earlier one does not (``(0, 1, 0, 0)``) thus gives the later
stage less extra warm-up. An explicit ``extra_warmup`` is kept as given, except that a stage
deeper than the one before it is refused.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from merak_pipe.ir import Action, RecomputePlan, Schedule
from merak_pipe.schedules._common import B, F, R, one_stage_per_rank

__all__ = ["shifted_critical_path"]

logger = logging.getLogger(__name__)


def _extras(num_stages: int, plan: RecomputePlan, extra_warmup: int | Sequence[int] | None) -> list[int]:
    if extra_warmup is None:
        return [
            (num_stages - 1 - i) if plan[i] >= 1.0 and i < num_stages - 1 else 0 for i in range(num_stages)
        ]
    if isinstance(extra_warmup, int):
        values = [extra_warmup] * num_stages
    else:
        values = [int(e) for e in extra_warmup]
    if len(values) != num_stages or any(e < 0 for e in values):
        raise ValueError(
            f"extra_warmup={extra_warmup!r}: expected an int >= 0 or {num_stages} ints >= 0 (one per stage)"
        )
    values[-1] = 0
    return values


def _default_depths(num_stages: int, extras: list[int]) -> list[int]:
    """Warm-up depths (before the cap at M) cut to the family of [Note: warm-up depths]."""
    S = num_stages
    depths = [S - 1 - stage + extras[stage] for stage in range(S)]
    for stage in range(1, S):
        depths[stage] = min(depths[stage], depths[stage - 1] - 1)
    for stage in range(S - 2, -1, -1):
        depths[stage] = min(depths[stage], depths[stage + 1] + 2)
    return depths


def _checked_depths(num_stages: int, num_microbatches: int, extras: list[int]) -> list[int]:
    """Explicit extra warm-ups as depths; refuses a stage deeper than the one before it."""
    S, M = num_stages, num_microbatches
    depths = [S - 1 - stage + extras[stage] for stage in range(S)]
    for stage in range(1, S):
        here, before = min(depths[stage], M), min(depths[stage - 1], M)
        if here > before:
            raise ValueError(
                f"extra_warmup={extras}: stage {stage} would warm up with {here} forwards, more than the "
                f"{before} of stage {stage - 1}, which cannot feed them before it waits for its first "
                f"gradient (a deadlock, see [Note: warm-up depths]); give stage {stage} at most "
                f"{depths[stage - 1] - (S - 1 - stage)} extra warm-up forwards"
            )
    return depths


def shifted_critical_path(
    *,
    num_stages: int,
    num_microbatches: int,
    num_ranks: int | None = None,
    recompute: RecomputePlan | None = None,
    extra_warmup: int | Sequence[int] | None = None,
) -> Schedule:
    """The shifted-critical-path schedule, one stage per rank.

    ``recompute`` defaults to full recomputation on every stage but the last; whatever plan is
    given, the last stage's fraction is set to 0.
    """
    stage_to_rank = one_stage_per_rank("shifted-critical-path", num_stages, num_ranks)
    S, M = num_stages, num_microbatches
    if recompute is None:
        recompute = RecomputePlan.full(S)
    if recompute[S - 1] != 0.0:
        logger.debug("shifted-critical-path: last stage recompute fraction %s set to 0", recompute[S - 1])
        recompute = RecomputePlan((*recompute.fractions[:-1], 0.0))
    requested = _extras(S, recompute, extra_warmup)
    depths = _default_depths(S, requested) if extra_warmup is None else _checked_depths(S, M, requested)
    extras = [d - (S - 1 - stage) for stage, d in enumerate(depths)]
    actions: dict[int, list[Action]] = {}
    for stage in range(S):
        uses_r = recompute[stage] > 0.0
        warmup = min(depths[stage], M)
        ops = [Action(stage, F, m) for m in range(warmup)]
        for k in range(M):
            if warmup + k < M:
                ops.append(Action(stage, F, warmup + k))
            if uses_r:
                ops.append(Action(stage, R, k))
            ops.append(Action(stage, B, k))
        actions[stage] = ops
    return Schedule(
        "shifted-critical-path",
        S,
        M,
        stage_to_rank,
        actions,
        recompute=recompute,
        options={"extra_warmup": tuple(extras)},
    )
