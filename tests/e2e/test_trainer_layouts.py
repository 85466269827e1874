"""Every 3D layout trains exactly like one process: same losses, same parameters after 3 steps."""

from __future__ import annotations

import pytest

from tests.e2e._trainer_support import reference_training, train_on_ranks
from tests.support.compare import assert_tensors_close
from tests.support.dist import run_on_ranks

LAYOUTS = [
    (1, 1, 2),
    (1, 2, 1),
    (2, 1, 1),
    (2, 2, 1),
    (2, 1, 2),
    (1, 2, 2),
    (2, 2, 2),
    (1, 1, 4),
    (1, 4, 1),
    (4, 1, 1),
]


def _check(name: str, dp: int, tp: int, pp: int, **extra) -> None:
    kwargs = {"dp": dp, "tp": tp, "pp": pp, "gradient_accumulation_steps": max(2, pp), **extra}
    results = run_on_ranks(dp * tp * pp, train_on_ranks, name, kwargs)
    ref_losses, ref_state = reference_training(name, kwargs, dp)
    losses, state = results[0]
    for rank, (other, _) in enumerate(results):
        assert other == pytest.approx(losses, rel=1e-12), f"rank {rank} reports other losses"
    assert losses == pytest.approx(ref_losses, rel=1e-9, abs=1e-12)
    assert sorted(state) == sorted(ref_state)
    for key, ref in ref_state.items():
        assert_tensors_close(
            state[key], ref, name=f"{name} {dp}x{tp}x{pp} param {key}", rtol=1e-8, atol=1e-10
        )


@pytest.mark.parametrize("zero", [0, 1], ids=["zero0", "zero1"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda t: f"dp{t[0]}_tp{t[1]}_pp{t[2]}")
@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_layout_matches_single_process(name: str, layout: tuple[int, int, int], zero: int) -> None:
    dp, tp, pp = layout
    if zero and dp == 1:
        pytest.skip("ZeRO-1 shards over DP: needs dp > 1")
    _check(name, dp, tp, pp, zero_stage=zero)


@pytest.mark.parametrize(
    ("schedule", "recompute"),
    [
        ("gpipe", "full"),
        ("1f1b", "none"),
        ("1f1b", "uniform:0.5"),
        ("zb_h1", "full"),
        ("shifted_critical_path", "full"),
        ("shifted_critical_path", "none"),
    ],
)
def test_schedules_and_recompute_match_single_process(schedule: str, recompute: str) -> None:
    """The Trainer's schedule and recomputation choices change speed and memory, never the math."""
    _check("gpt", 2, 1, 2, schedule=schedule, recompute=recompute, gradient_accumulation_steps=4)


def test_stage_aware_recompute_under_a_memory_budget_matches_single_process() -> None:
    _check(
        "llama",
        1,
        2,
        2,
        schedule="shifted_critical_path",
        recompute="stage_aware",
        memory_budget="64MiB",
        gradient_accumulation_steps=4,
    )
