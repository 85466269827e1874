"""The line ``layout: auto`` logs when the plan ranks first the pure DP x TP layout its probe measured slowest.

``slowest_probe_note`` compares the probes by time per sample (a probe step of dp ranks takes dp
microbatches); the 2-rank run that logs it is ``tests/e2e/test_autoplan_switch.py``.
"""

from __future__ import annotations

import pytest

from merak_core.autoplan.probe import slowest_probe_note
from merak_core.planner import Candidate


def _candidate(dp: int, tp: int, pp: int = 1) -> Candidate:
    return Candidate(
        dp=dp,
        tp=tp,
        pp=pp,
        schedule="1f1b",
        num_microbatches=2,
        micro_batch_size=4,
        recompute="none",
        recompute_fractions=(0.0,) * pp,
        stage_layers=(1,) * pp,
        step_time_s=1.0,
        pipeline_s=1.0,
        dp_allreduce_s=0.0,
        peak_memory_bytes=(1.0,) * pp,
    )


def test_the_line_names_the_measured_times_and_the_fastest_layout() -> None:
    # 4 ranks, microbatch 4: dp4-tp1 takes 16 samples a step, dp2-tp2 8, dp1-tp4 4.
    measured = {1: (0.016, 16), 2: (0.032, 8), 4: (0.012, 4)}
    assert slowest_probe_note(_candidate(2, 2), measured) == (
        "layout auto: the plan ranks dp2-tp2-pp1 first, but its probe measured that layout slowest: 32 ms per "
        "step of 8 samples (4 ms per sample; dp4-tp1 1 ms, dp1-tp4 3 ms per sample); the cost model and this "
        "machine disagree here: to train the measured fastest, set layout: manual with training.dp=4 "
        "training.tp=1 training.pp=1"
    )


@pytest.mark.parametrize(
    ("chosen", "measured"),
    [
        # the slowest step, but not the slowest per sample (it took twice the samples)
        (_candidate(4, 1), {1: (0.030, 16), 2: (0.020, 8)}),
        # measured faster than another
        (_candidate(2, 2), {1: (0.040, 16), 2: (0.010, 8)}),
        # a pipeline layout was not probed
        (_candidate(2, 1, 2), {1: (0.010, 16), 2: (0.040, 8)}),
        # one probe: nothing to compare
        (_candidate(4, 1), {1: (0.040, 16)}),
        # all equal per sample
        (_candidate(2, 2), {1: (0.020, 16), 2: (0.010, 8)}),
    ],
)
def test_no_line_when_the_first_layout_was_not_measured_slowest(chosen: Candidate, measured: dict) -> None:
    assert slowest_probe_note(chosen, measured) is None
