"""The schedule registry: every spelling finds its schedule, and the capabilities match what it builds."""

from __future__ import annotations

import pytest

from merak_pipe import build_schedule, register_schedule, schedule_info, schedule_infos
from merak_pipe.schedules import _REGISTRY


def _kinds(name: str, **options: object) -> tuple[set[str], int]:
    s = build_schedule(name, num_stages=4, num_microbatches=4, **options)
    kinds = {str(getattr(a.kind, "value", a.kind)) for acts in s.actions.values() for a in acts}
    return kinds, s.num_stages // len(set(s.stage_to_rank))


@pytest.mark.parametrize("info", schedule_infos(), ids=lambda i: i.name)
def test_capabilities_match_the_built_schedule(info) -> None:  # type: ignore[no-untyped-def]
    options = {"virtual_stages": 2} if info.stages_per_rank is None else {}
    kinds, per_rank = _kinds(info.name, **options)
    assert info.split_backward == bool(kinds & {"I", "W"}), kinds
    assert per_rank == (info.stages_per_rank or 2)
    for spelling in info.spellings:  # the key (job files) and the name (merak-pipe) build the same schedule
        assert schedule_info(spelling) is info
        assert _kinds(spelling, **options) == (kinds, per_rank)


def test_built_in_keys_and_unknown_names() -> None:
    assert {i.key for i in schedule_infos()} >= {
        "gpipe",
        "1f1b",
        "zb_h1",
        "shifted_critical_path",
        "interleaved_1f1b",
        "zb_v",
    }
    with pytest.raises(ValueError, match=r"unknown schedule 'shifted critical path'.*register_schedule"):
        schedule_info("shifted critical path")


def test_a_spelling_taken_by_another_schedule_is_refused_unless_overwritten() -> None:
    gen = schedule_info("1f1b").generator
    with pytest.raises(ValueError, match=r"already registered as \['zb-h1'\]"):
        register_schedule("my-1f1b", gen, aliases=("zb_h1",))
    try:
        info = register_schedule("my-1f1b", gen, key="my_1f1b", aliases=("mine",))
        assert schedule_info("mine") is info and schedule_info("my_1f1b").name == "my-1f1b"
        replaced = register_schedule("my-other", gen, aliases=("mine",), overwrite=True)
        assert schedule_info("mine") is replaced and "my-1f1b" not in _REGISTRY
    finally:
        _REGISTRY.pop("my-1f1b", None)
        _REGISTRY.pop("my-other", None)
