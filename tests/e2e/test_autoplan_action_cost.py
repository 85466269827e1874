"""``layout: auto`` on 2 gloo ranks prices the pipeline runtime's own cost per action.

Measured (nothing injected): the same positive, finite seconds per action reach the plan's
``CommModel`` on every rank. Injected (a fixed profile, a device per rank, the default ``CommModel``,
as in ``test_autoplan_switch.py``, so that the plan, not this machine's load, decides): free actions
let the search choose two stages per rank; an expensive runtime per action makes it stop offering them.
"""

from __future__ import annotations

import math
from typing import Any

from tests.e2e._trainer_support import TokenDataset
from tests.support.dist import run_on_ranks


def _auto_body(per_action_s: float | None) -> dict[str, Any]:
    from merak_core.autoplan import auto
    from merak_core.config import TrainingArguments
    from merak_core.planner import CommModel, ModelProfile
    from tests.e2e.test_virtual_stages import build

    # four equal layers whose weights fit a device only split in two, one head: the pipeline's
    # bubble dominates, which two stages per rank shrink (tests/core/test_planner_virtual_stages.py)
    profile = ModelProfile(
        layer_forward_s=[1e-2] * 4,
        layer_backward_s=[2e-2] * 4,
        layer_activation_bytes=[1e7] * 4,
        layer_param_bytes=[1e8] * 4,
        boundary_bytes=1e3,
        num_heads=1,
    )
    saved = auto.profile_for_plan, auto._cpu_compute_slots, auto.measure_comm
    auto.profile_for_plan = lambda *a, **k: profile
    auto._cpu_compute_slots = lambda *a, **k: None  # a device per rank: virtual stages are searched
    auto.measure_comm = lambda *a, **k: CommModel()
    try:
        args = TrainingArguments(
            layout="auto",
            per_device_train_batch_size=2,
            gradient_accumulation_steps=1,
            memory_per_device=int(1.6e9),
            plan_probe_tp=False,
            plan_check_steps=0,
            max_steps=1,
        )
        model = build("gpt", profile.num_layers)
        chosen = auto.auto_layout(
            args, model, TokenDataset(16, model.config.vocab_size), per_action_s=per_action_s
        )
    finally:
        auto.profile_for_plan, auto._cpu_compute_slots, auto.measure_comm = saved
    return {
        "per_action_s": chosen.context.comm.per_action_s,
        "layout": (chosen.chosen.dp, chosen.chosen.tp, chosen.chosen.pp, chosen.chosen.virtual_stages),
        "args": (chosen.args.pp, chosen.args.virtual_stages),
    }


def test_auto_measures_the_runtime_cost_per_action_and_plans_with_it():
    results = run_on_ranks(2, _auto_body, None)
    measured = results[0]["per_action_s"]
    assert all(r == results[0] for r in results)  # one number, one plan on every rank
    assert 0 < measured < 1 and math.isfinite(measured)  # seconds per action of a tiny 1F1B step


def test_an_expensive_runtime_per_action_makes_auto_stop_offering_virtual_stages():
    free = run_on_ranks(2, _auto_body, 0.0)
    assert all(r == free[0] for r in free)
    assert free[0]["layout"] == (1, 1, 2, 2) and free[0]["args"] == (2, 2)  # two stages per rank win
    costly = run_on_ranks(2, _auto_body, 1e-2)
    assert all(r == costly[0] for r in costly)
    assert costly[0]["per_action_s"] == 1e-2
    assert costly[0]["layout"][3] == 1 and costly[0]["args"][1] == 1  # one stage per rank
