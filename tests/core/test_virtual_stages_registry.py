"""The virtual-stage check reads merak-pipe's schedule registry: a newly registered schedule is known to it.

Pure: no process group. ``check_virtual_stages`` keeps no table of schedules and their stage counts;
a schedule registered with ``stages_per_rank=3`` is accepted at v=3, refused elsewhere with the count
it needs, and offered as the fix for a one-stage schedule asked to run three stages per rank.
"""

from __future__ import annotations

import pytest

from merak_core.parallel.virtual_stages import check_virtual_stages, stage_placement
from merak_pipe import register_schedule, schedule_info
from merak_pipe.schedules import _REGISTRY


@pytest.fixture
def three_per_rank():  # type: ignore[no-untyped-def]
    # Reuses interleaved 1F1B's generator: it places v = num_stages / num_ranks stages round-robin.
    info = register_schedule(
        "three-per-rank", schedule_info("interleaved_1f1b").generator, key="three_per_rank", stages_per_rank=3
    )
    try:
        yield info
    finally:
        _REGISTRY.pop("three-per-rank", None)


def test_the_registry_says_how_many_stages_a_schedule_places(three_per_rank) -> None:  # type: ignore[no-untyped-def]
    assert three_per_rank.runs_stages_per_rank(3) and not three_per_rank.runs_stages_per_rank(2)
    assert schedule_info("interleaved_1f1b").runs_stages_per_rank(5)
    check_virtual_stages("three_per_rank", 2, 3)
    with pytest.raises(
        ValueError, match=r"runs 3 stage\(s\) per pipeline rank but virtual_stages=2: set virtual_stages=3"
    ):
        check_virtual_stages("three_per_rank", 2, 2)
    with pytest.raises(
        ValueError, match="use schedule interleaved_1f1b or three_per_rank .they run 3 stages"
    ):
        check_virtual_stages("1f1b", 2, 3)
    assert stage_placement("three_per_rank", 2, 3) == (0, 1, 0, 1, 0, 1)
