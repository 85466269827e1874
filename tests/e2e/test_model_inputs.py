"""The fixes the model-input errors suggest work (their refusals are rows of test_bad_input.py).

An untraceable module kept whole in one stage with ``tp_plan: {layers: {}, trace_leaves: [...]}``
trains at pp=2 as one process does (same losses); a failed trace prints nothing of torch.export's
partial graph ([Note: quiet export] in merak_graph.tracing) and the error names the module.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import merak_graph
from tests.e2e import _bad_input_model_cases as cases
from tests.support.dist import run_on_ranks


def test_the_suggested_trace_leaves_train_like_one_process(tmp_path: Path) -> None:
    reference = run_on_ranks(1, cases.gated_first_losses, str(tmp_path / "one"), 1)[0]
    piped = run_on_ranks(2, cases.gated_first_losses, str(tmp_path / "two"), 2)[0]
    assert piped == pytest.approx(reference, rel=1e-12, abs=0.0)


def test_a_failed_trace_prints_nothing_and_names_the_module(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(merak_graph.TraceError) as info:
        merak_graph.trace(cases.Gated(), example_inputs=(torch.randn(2, 4),))
    out, err = capfd.readouterr()
    assert out == "" and err == "", (out + err)[:2000]
    assert (info.value.module_name, info.value.module_class) == ("gate", "Gate")
    assert len(str(info.value).splitlines()) <= 6
