"""``layout: auto`` measures the runtime's split backward, ``(I + W) / B``, and plans with it (issue 31).

One process: :func:`~merak_core.planner.action_cost.measure_split_backward_scale` runs merak_pipe's
``I`` and ``W`` on the first block of a reference model (GPT, Llama) or, where the model has no
blocks, on its stand-in; it leaves the model's gradients and the random stream as they were; bad
arguments and bad given scales are refused by name. Two gloo ranks: ``auto_layout`` with a fixed
profile (the bubble dominates, a device per rank, as in ``tests/core/test_planner_virtual_stages.py``)
offers ZB-V at a given scale of 1 and interleaved 1F1B at 1.6; measured, rank 0 alone times it and
every rank plans with its number. No timing is asserted, only that the number is finite, positive
and the one the plan was made with.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
import torch
from torch import nn

from merak_core.config import TrainingArguments
from merak_core.planner.action_cost import check_split_backward_scale, measure_split_backward_scale
from merak_core.planner.profile import _find_layers
from tests.e2e._autoplan_support import bubble_args, bubble_profile, fixed_planning_inputs
from tests.e2e._trainer_support import TokenDataset
from tests.e2e.test_virtual_stages import build
from tests.support.dist import run_on_ranks


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_split_scale_is_measured_on_the_models_first_block_and_leaves_the_model_as_it_was(name: str):
    model = build(name, 2)
    ids = TokenDataset(4, model.config.vocab_size)[0]["input_ids"].unsqueeze(0).repeat(2, 1)
    calls = []
    handle = _find_layers(model)[0].register_forward_hook(lambda *_: calls.append(1))
    rng = torch.get_rng_state()
    try:
        scale = measure_split_backward_scale(model, ids, rounds=2, warmup=0)
    finally:
        handle.remove()
    assert math.isfinite(scale) and scale > 0
    # the first block ran (2 rounds x 2 sides + the first forward), the model's forward once, stopped there
    assert len(calls) == 5
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_model_without_blocks_is_measured_on_the_stand_in(caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.INFO, logger="merak_core.planner.action_cost"):
        scale = measure_split_backward_scale(nn.Linear(3, 3), torch.randn(2, 3), rounds=1, warmup=0)
    assert math.isfinite(scale) and scale > 0
    assert "stand-in block" in caplog.text and "no nn.ModuleList" in caplog.text
    assert math.isfinite(measure_split_backward_scale(rounds=1, warmup=0))  # no model: the stand-in


def test_bad_measurement_arguments_and_given_scales_are_refused_by_name():
    with pytest.raises(ValueError, match="rounds=0"):
        measure_split_backward_scale(rounds=0)
    for bad in (0.0, -1.4, math.nan, math.inf, True, "1.4"):
        with pytest.raises(ValueError, match=r"split_backward_scale=.*expected the runtime's \(I \+ W\) / B"):
            check_split_backward_scale("auto_layout", bad)
    assert check_split_backward_scale("auto_layout", 2) == 2.0
    from merak_core.autoplan.auto import auto_layout

    with pytest.raises(ValueError, match=r"auto_layout: split_backward_scale=0\.0"):  # before any collective
        auto_layout(
            TrainingArguments(layout="auto"), nn.Linear(2, 2), [torch.zeros(2)], split_backward_scale=0.0
        )


def _auto_body() -> dict[str, Any]:
    """``auto_layout`` three times on these ranks: the scale given as 1 and 1.6, then measured (spied)."""
    from merak_core.autoplan import auto

    # the bubble dominates, which two stages per rank shrink; ZB-V's split is then priced by the scale
    profile = bubble_profile()
    measured: list[float] = []
    real = auto.measure_split_backward_scale

    def spy(*a: Any, **k: Any) -> float:
        measured.append(real(*a, **k))
        return measured[-1]

    model = build("gpt", profile.num_layers)
    data = TokenDataset(16, model.config.vocab_size)
    out: dict[str, Any] = {}
    with fixed_planning_inputs(profile, measure_split_backward_scale=spy):
        for given in (1.0, 1.6, None):
            chosen = auto.auto_layout(
                bubble_args(), model, data, per_action_s=0.0, split_backward_scale=given
            )
            out[str(given)] = {
                "scale": chosen.context.comm.split_backward_scale,
                "plan": (chosen.chosen.schedule, chosen.chosen.pp, chosen.chosen.virtual_stages),
                "args": (chosen.args.schedule, chosen.args.virtual_stages),
            }
    out["measured_here"] = measured
    out["profile"] = profile
    return out


def test_auto_plans_with_the_split_scale_given_or_measured_on_rank_0():
    from merak_core.planner import CommModel, plan
    from merak_core.planner.choices import AUTO_VIRTUAL_STAGES

    r0, r1 = run_on_ranks(2, _auto_body)
    for key in ("1.0", "1.6", "None"):
        assert r0[key] == r1[key]  # one number, one plan on every rank
    assert r0["1.0"]["plan"] == ("zb_v", 2, 2) and r0["1.0"]["args"] == ("zb_v", 2)
    assert r0["1.6"]["scale"] == 1.6
    assert r0["1.6"]["plan"] == ("interleaved_1f1b", 2, 2) and r0["1.6"]["args"] == ("interleaved_1f1b", 2)
    # measured: on rank 0 only, once, and that number is what every rank planned with
    assert len(r0["measured_here"]) == 1 and r1["measured_here"] == []
    scale = r0["None"]["scale"]
    assert scale == r0["measured_here"][0] and math.isfinite(scale) and scale > 0
    best = plan(
        r0["profile"],
        world_size=2,
        memory_per_device=1.6e9,
        global_batch_size=4,
        comm=CommModel(per_action_s=0.0, split_backward_scale=scale),
        virtual_stages=AUTO_VIRTUAL_STAGES,
    )[0]
    assert r0["None"]["plan"] == (best.schedule, best.pp, best.virtual_stages)


def test_merak_plan_plans_with_the_split_backward_measured_or_given(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``merak plan`` priced the zero-bubble schedules with a split backward of 1 (what one backward
    costs); it now measures it on the profiled model, as ``layout: auto``'s rank 0 does, or takes
    ``--split-backward-scale``; ``--per-action-us`` gives the per-action cost it cannot measure alone."""
    from pathlib import Path

    import merak_core.planner as planner
    from merak_core.cli.main import main
    from merak_core.planner import action_cost

    demo = str(Path(__file__).resolve().parents[2] / "examples" / "addition" / "config.yaml")
    seen: list[Any] = []
    real_plan = planner.plan

    def spy(*a: Any, **kw: Any) -> Any:
        seen.append(kw["comm"])
        return real_plan(*a, **kw)

    measured: list[float] = []
    real_measure = action_cost.measure_split_backward_scale

    def measure(*a: Any, **kw: Any) -> float:
        measured.append(real_measure(*a, **kw))
        return measured[-1]

    monkeypatch.setattr(planner, "plan", spy)
    monkeypatch.setattr(action_cost, "measure_split_backward_scale", measure)
    base = ["plan", demo, "data.kwargs.train_size=64", "--world-size", "2", "--memory-per-device", "1GiB"]
    assert main([*base, "--top", "1"]) == 0
    assert len(measured) == 1 and math.isfinite(measured[0]) and measured[0] > 0
    assert seen[-1].split_backward_scale == measured[0] and seen[-1].per_action_s == 0.0
    assert f"split backward (I + W) / B = {measured[0]:.3g} (measured here" in capsys.readouterr().out
    assert main([*base, "--top", "1", "--split-backward-scale", "1.6", "--per-action-us", "150"]) == 0
    assert len(measured) == 1  # given: not measured again
    assert seen[-1].split_backward_scale == 1.6 and seen[-1].per_action_s == pytest.approx(150e-6)
    assert "= 1.6 (given), 150 us per action (given)" in capsys.readouterr().out
    assert main([*base, "--split-backward-scale", "0"]) == 2
    assert "--split-backward-scale: split_backward_scale=0.0; expected" in capsys.readouterr().err
    assert main([*base, "--per-action-us", "-1"]) == 2
    assert "--per-action-us=-1.0: expected the runtime's microseconds per action" in capsys.readouterr().err
    one = ["plan", demo, "data.kwargs.train_size=64", "--world-size", "1", "--memory-per-device", "1GiB"]
    assert main([*one, "--top", "1"]) == 0
    assert len(measured) == 1 and seen[-1].split_backward_scale == 1.0  # one rank: nothing to split
    assert "= 1 (one rank: no pipeline, not measured)" in capsys.readouterr().out
    cluster = ["plan", demo, "--cluster", "h100-sxm-8x", "--nodes", "1"]
    assert main([*cluster, "--split-backward-scale", "0"]) == 2  # a given value is refused, never ignored
    assert "--split-backward-scale with --cluster/--dry-run-ranks" in capsys.readouterr().err
    assert main(["plan", demo, "--cluster", "h100-sxm-8x", "--nodes", "1", "--per-action-us", "150"]) == 2
    assert (
        "--per-action-us with --cluster/--dry-run-ranks: the cluster file prices" in capsys.readouterr().err
    )
