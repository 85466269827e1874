"""The schedule IR: action strings, Schedule checks, the per-rank table."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from merak_pipe import Action, ActionKind, RecomputePlan, Schedule, format_table

kinds = st.sampled_from(list(ActionKind))


@given(stage=st.integers(0, 999), kind=kinds, microbatch=st.integers(0, 9999))
def test_action_string_round_trips(stage: int, kind: ActionKind, microbatch: int) -> None:
    a = Action(stage, kind, microbatch)
    text = str(a)
    assert text == f"{stage}{kind.value}{microbatch}"
    assert Action.parse(text) == a
    assert Action.parse(f"  {text} ") == a


@settings(deadline=None)
@given(stage=st.integers(0, 99), kind=kinds, microbatch=st.integers(0, 999))
def test_action_strings_parse_in_torch_the_same_way(stage: int, kind: ActionKind, microbatch: int) -> None:
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    if kind in (ActionKind.RECOMPUTE, ActionKind.SEND_T, ActionKind.RECV_T):
        return  # torch has no recompute action (see csv_io) and no decode token messages
    t = schedules._Action.from_str(str(Action(stage, kind, microbatch)))
    assert (t.stage_index, t.computation_type.value, t.microbatch_index) == (stage, kind.value, microbatch)


@pytest.mark.parametrize("text", ["", "F0", "1X2", "1F", "-1F0", "1SEND0", "1 F 0", "1f0"])
def test_bad_action_strings_are_rejected_with_the_expected_form(text: str) -> None:
    with pytest.raises(ValueError, match="<stage><kind><microbatch>"):
        Action.parse(text)


def test_action_kinds_classify() -> None:
    assert {k for k in ActionKind if k.is_compute} == {
        ActionKind.FORWARD,
        ActionKind.FULL_BACKWARD,
        ActionKind.BACKWARD_INPUT,
        ActionKind.BACKWARD_WEIGHT,
        ActionKind.RECOMPUTE,
    }
    assert {k for k in ActionKind if k.is_backward} == {ActionKind.FULL_BACKWARD, ActionKind.BACKWARD_INPUT}
    assert Action(0, "F", 1).kind is ActionKind.FORWARD  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=">= 0"):
        Action(-1, ActionKind.FORWARD, 0)


def _tiny() -> Schedule:
    return Schedule(
        "tiny",
        num_stages=4,
        num_microbatches=1,
        stage_to_rank=(0, 1, 0, 1),
        actions={
            0: [Action(0, ActionKind.FORWARD, 0), Action(2, ActionKind.FORWARD, 0)],
            1: [Action(1, ActionKind.FORWARD, 0)],
        },
    )


def test_schedule_helpers() -> None:
    s = _tiny()
    assert s.num_ranks == 2
    assert s.stages_of(0) == (0, 2)
    assert s.stages_of(1) == (1, 3)
    assert s.rank_of(3) == 1
    assert not s.has_recompute_actions
    assert [str(a) for _, a in s] == ["0F0", "2F0", "1F0"]


def test_schedule_rejects_inconsistent_fields() -> None:
    with pytest.raises(ValueError, match="one rank per stage"):
        Schedule("x", 3, 1, (0, 1), {})
    with pytest.raises(ValueError, match="every rank"):
        Schedule("x", 2, 1, (0, 2), {})
    with pytest.raises(ValueError, match="hold no stage"):
        Schedule("x", 2, 1, (0, 1), {5: []})
    with pytest.raises(ValueError, match="recompute plan has 3 stages"):
        Schedule("x", 2, 1, (0, 1), {}, recompute=RecomputePlan.full(3))


def test_table_has_one_column_per_rank_and_marks_the_bad_step() -> None:
    s = _tiny()
    lines = format_table(s, mark=(0, 1)).splitlines()
    assert "rank 0" in lines[1] and "rank 1" in lines[1]
    assert lines[3].split("|")[1].strip() == "0F0"
    assert lines[3].split("|")[2].strip() == "1F0"
    assert lines[4].split("|")[1].strip() == ">>2F0<<"
    assert ">>" not in str(s)
