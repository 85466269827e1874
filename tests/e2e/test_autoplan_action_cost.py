"""``layout: auto`` on 2 gloo ranks prices the pipeline runtime's own cost per action.

Measured (nothing injected): the same positive, finite seconds per action reach the plan's
``CommModel`` on every rank. Injected (a fixed profile, a device per rank, the default ``CommModel``,
as in ``test_autoplan_switch.py``, so that the plan, not this machine's load, decides): free actions
let the search choose two stages per rank; an expensive runtime per action makes it stop offering them.
"""

from __future__ import annotations

import math
from typing import Any

from tests.e2e._autoplan_support import bubble_args, bubble_profile, fixed_planning_inputs
from tests.e2e._trainer_support import TokenDataset
from tests.support.dist import run_on_ranks


def _auto_body(per_action_s: float | None) -> dict[str, Any]:
    from tests.e2e.test_virtual_stages import build

    profile = bubble_profile()
    with fixed_planning_inputs(profile) as auto:
        model = build("gpt", profile.num_layers)
        chosen = auto.auto_layout(
            bubble_args(), model, TokenDataset(16, model.config.vocab_size), per_action_s=per_action_s
        )
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
