"""The search with virtual stages (no processes): v = 2 where it is predicted faster, never where the
layers do not divide into pp * v equal stages, priced and fitted per pipeline rank.

The profile makes the pipeline bubble dominate (four equal layers whose weights fit a device only
when split in two, one head so tp stays 1), which is where two stages per rank pay; a large
point-to-point latency (v = 2 doubles the messages) is where they do not.
"""

from __future__ import annotations

import dataclasses

import pytest

from merak_core.config.layout_choice import LayoutChoice
from merak_core.planner import CommModel, ModelProfile, plan, predict
from merak_core.planner.choices import AUTO_VIRTUAL_STAGES, VIRTUAL_STAGE_SCHEDULES, searched_virtual_stages
from merak_core.planner.memory import MEMORY_MARGIN
from merak_core.planner.search import virtual_stage_counts

MEMORY = 1.6e9  # the four layers' state (4 x 1e8 x 4 bytes per parameter byte) does not fit: no dp=2


def _profile(num_layers: int = 4) -> ModelProfile:
    return ModelProfile(
        layer_forward_s=[1e-2] * num_layers,
        layer_backward_s=[2e-2] * num_layers,
        layer_activation_bytes=[1e7] * num_layers,
        layer_param_bytes=[4e8 / num_layers] * num_layers,
        boundary_bytes=1e3,
        num_heads=1,
    )


def _plan(profile: ModelProfile, **kw: object) -> list:
    args = dict(world_size=2, memory_per_device=MEMORY, global_batch_size=4, comm=CommModel())
    args.update(kw)
    return plan(profile, virtual_stages=AUTO_VIRTUAL_STAGES, **args)  # type: ignore[arg-type]


def test_two_stages_per_rank_win_where_the_bubble_dominates_and_match_predict():
    cands = _plan(_profile())
    best = cands[0]
    assert (best.layout, best.virtual_stages) == (
        "dp1-tp1-pp2",
        2,
    ) and best.schedule in VIRTUAL_STAGE_SCHEDULES
    one = min((c for c in cands if c.virtual_stages == 1), key=lambda c: c.step_time_s)
    assert best.step_time_s < one.step_time_s  # a predicted gain over every one-stage-per-rank choice
    assert best.training_fields()["virtual_stages"] == 2 and "v=2" in best.schedule_label
    # four stages, two per rank: per-stage rows for the plan check, per-rank peaks for the memory bound
    assert len(best.stage_layers) == len(best.peak_memory_bytes) == len(best.stage_forward_s) == 4
    assert len(best.device_peak_bytes) == 2 and max(best.device_peak_bytes) <= MEMORY
    again = predict(
        _profile(),
        LayoutChoice(
            dp=1,
            tp=1,
            pp=2,
            schedule=best.schedule,
            num_microbatches=best.num_microbatches,
            micro_batch_size=best.micro_batch_size,
            virtual_stages=2,
        ),
        comm=CommModel(),
        memory_per_device=MEMORY,
    )
    assert again.step_time_s == pytest.approx(best.step_time_s, rel=1e-12)
    assert again.device_peak_bytes == pytest.approx(best.device_peak_bytes, rel=1e-12)
    # without virtual_stages the search is what it was: one stage per rank only
    default = plan(_profile(), world_size=2, memory_per_device=MEMORY, global_batch_size=4, comm=CommModel())
    assert {c.virtual_stages for c in default} == {1}
    assert [dataclasses.astuple(c) for c in default] == [
        dataclasses.astuple(c) for c in cands if c.virtual_stages == 1
    ]


def test_one_stage_per_rank_wins_when_messages_are_expensive():
    best = _plan(_profile(), comm=CommModel(p2p_latency_s=0.05))[0]
    assert best.virtual_stages == 1


def test_layout_auto_searches_virtual_stages_only_with_a_device_per_rank():
    # [Note: virtual stages on shared cores]: measured slower there than the simulator predicts
    assert searched_virtual_stages(None) == AUTO_VIRTUAL_STAGES == (1, 2)
    assert searched_virtual_stages(2.0) == (1,)


def test_layers_that_do_not_divide_into_pp_times_v_stages_are_not_tried():
    assert virtual_stage_counts(4, 2, AUTO_VIRTUAL_STAGES) == [1, 2]
    assert virtual_stage_counts(6, 2, AUTO_VIRTUAL_STAGES) == [1]  # 6 layers, 4 stages: uneven
    assert virtual_stage_counts(6, 3, AUTO_VIRTUAL_STAGES) == [1, 2]
    assert virtual_stage_counts(8, 1, AUTO_VIRTUAL_STAGES) == [1]  # no pipeline, no virtual stages
    for layers in (5, 6):  # pp * v = 4 <= layers, but not a divisor
        assert {c.virtual_stages for c in _plan(_profile(layers))} == {1}
    three = _plan(_profile(6), world_size=3, global_batch_size=6)
    assert {(c.pp, c.virtual_stages) for c in three} >= {(3, 2)}


def test_a_virtual_stage_plan_that_does_not_fit_its_ranks_memory_is_dropped():
    cands = _plan(_profile(), recompute_modes=("none",))
    v2 = sorted((c for c in cands if c.virtual_stages == 2), key=lambda c: max(c.device_peak_bytes))
    smallest, largest = max(v2[0].device_peak_bytes), max(v2[-1].device_peak_bytes)
    assert smallest < largest
    # the planner keeps peaks up to memory_per_device less its margin ([Note: memory margin])
    tighter = _plan(
        _profile(), recompute_modes=("none",), memory_per_device=(largest - 1) / (1 - MEMORY_MARGIN)
    )
    kept = {(c.schedule, c.num_microbatches) for c in tighter if c.virtual_stages == 2}
    assert (v2[0].schedule, v2[0].num_microbatches) in kept
    assert (v2[-1].schedule, v2[-1].num_microbatches) not in kept
    assert all(max(c.device_peak_bytes) <= largest - 1 for c in tighter)


def test_one_stage_per_rank_wins_when_the_runtime_is_expensive_per_action():
    """Two stages per rank run twice the compute actions and messages: a runtime that costs enough per
    action (CommModel.per_action_s, priced by merak_pipe's simulator) loses their smaller bubble."""
    assert _plan(_profile())[0].virtual_stages == 2
    best = _plan(_profile(), comm=CommModel(per_action_s=1e-2))[0]
    assert best.virtual_stages == 1
    with pytest.raises(ValueError, match="per_action_s"):
        CommModel(per_action_s=-1.0)


def test_split_backward_schedules_lose_when_the_split_costs_what_it_measures():
    """ZB-V (and ZB-H1) split every backward into I and W: priced as one B (split_backward_scale 1) they win
    here; at the (I + W) / B measured on the CPU machine (1.37-1.56, docs/virtual_stages.md) the planner
    offers the unsplit interleaved 1F1B instead, and no split schedule ranks above it."""
    from merak_pipe import schedule_info

    assert _plan(_profile())[0].schedule == "zb_v"
    cands = _plan(_profile(), comm=CommModel(split_backward_scale=1.4))
    assert (cands[0].schedule, cands[0].virtual_stages) == ("interleaved_1f1b", 2)
    one = [c for c in cands if c.virtual_stages == 1]
    assert not schedule_info(one[0].schedule).split_backward  # zb_h1 no longer the best one-stage plan
    with pytest.raises(ValueError, match="split_backward_scale"):
        CommModel(split_backward_scale=0.0)
