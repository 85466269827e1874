"""ZB-V: the V placement, validation (also under NCCL's rules), 1F1B's memory per rank, and a
shorter simulated makespan than 1F1B and interleaved-1F1B on the same work."""

from __future__ import annotations

import pytest

from merak_pipe import CostModel, build_schedule, lower, simulate, validate
from merak_pipe.ir import ActionKind
from merak_pipe.nccl_check import check_nccl


def _peak_live_per_rank(schedule) -> list[int]:
    """The most microbatch-stages a rank holds at once (forward done, weight gradient not)."""
    peaks = []
    for rank in range(schedule.num_ranks):
        live = peak = 0
        for a in schedule.actions[rank]:
            if a.kind is ActionKind.FORWARD:
                live += 1
                peak = max(peak, live)
            elif a.kind is ActionKind.BACKWARD_WEIGHT:
                live -= 1
        peaks.append(peak)
    return peaks


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("micro", [1, 2, 5, 8, 16])
def test_zbv_validates_and_keeps_1f1b_memory(ranks: int, micro: int) -> None:
    schedule = build_schedule("zb-v", num_stages=2 * ranks, num_microbatches=micro)
    assert schedule.stage_to_rank == tuple(min(s, 2 * ranks - 1 - s) for s in range(2 * ranks))
    lowered = validate(lower(schedule), channel_order=True)
    check_nccl(lowered)
    kinds = {(a.stage, a.kind, a.microbatch) for r in range(ranks) for a in schedule.actions[r]}
    assert len(kinds) == 3 * 2 * ranks * micro  # every F, I and W exactly once
    # 1F1B's first stage holds min(P, M) microbatches of the rank's layers = 2 * min(P, M) half-stages.
    assert max(_peak_live_per_rank(schedule)) <= 2 * min(ranks, micro)


@pytest.mark.parametrize("ranks", [2, 4])
def test_zbv_is_shorter_than_1f1b_and_interleaved(ranks: int) -> None:
    micro = 8
    half = CostModel(forward=1.0, backward=2.0, backward_input=1.0, backward_weight=1.0)
    zbv = simulate(build_schedule("zb-v", num_stages=2 * ranks, num_microbatches=micro), half).makespan
    inter = simulate(
        build_schedule("interleaved-1f1b", num_stages=2 * ranks, num_ranks=ranks, num_microbatches=micro),
        half,
    ).makespan
    one = simulate(
        build_schedule("1f1b", num_stages=ranks, num_microbatches=micro), CostModel(forward=2.0, backward=4.0)
    ).makespan
    assert zbv < inter < one


def test_zbv_refuses_other_counts() -> None:
    with pytest.raises(ValueError, match="even num_stages"):
        build_schedule("zb-v", num_stages=3, num_microbatches=4)
    with pytest.raises(ValueError, match="exactly 2 stages per rank"):
        build_schedule("zb-v", num_stages=6, num_microbatches=4, virtual_stages=3)
    with pytest.raises(ValueError, match="2 \\* num_ranks"):
        build_schedule("zb-v", num_stages=4, num_ranks=4, num_microbatches=4)
