"""Composing a model writes no ``_merak_*`` attribute into the user's modules (merak-tp's ``ModuleSpec``)."""

from __future__ import annotations

import merak_tp
from tests.support.dist import run_on_ranks
from tests.support.models import REFERENCE_MODELS, build_reference
from tests.tp.test_module_spec import loose_attributes


def compose_body() -> tuple[list[str], int, int]:
    """GPT composed at tp=2 with sequence parallelism and overlap, one step: (attributes, regions, boundaries)."""
    import merak_core
    from merak_core.parallel.compose import build_parallel_model

    layout = merak_core.init(dp=1, tp=2, pp=1)
    (ids,) = REFERENCE_MODELS["gpt"].make_inputs(4, 8, 0)
    pm = build_parallel_model(
        build_reference("gpt"),
        layout,
        example_inputs={"input_ids": ids[:2]},
        sequence_parallel=True,
        overlap_chunks=2,
    )
    for _ in range(2):  # the regions' probe, then sub-pipelined
        pm.module(ids).sum().backward()
    modules = list(pm.module.modules())
    regions = sum(isinstance(m, merak_tp.TPRegion) for m in modules)
    boundaries = sum(isinstance(m, merak_tp.SequenceScatter) for m in modules)
    return loose_attributes(pm.module), regions, boundaries


def test_no_merak_attribute_on_user_modules_after_composing_at_tp2_with_sequence_parallelism() -> None:
    attributes, regions, boundaries = run_on_ranks(2, compose_body)[0]
    assert attributes == [], attributes
    assert regions >= 4 and boundaries >= 1, (regions, boundaries)
