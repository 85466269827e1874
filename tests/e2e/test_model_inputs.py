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


def test_a_tuple_output_is_read_at_its_first_element_and_the_launch_log_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from tests.e2e._bad_input_launch_cases import MODELS, train_dry_run, write_job
    from tests.e2e._bad_input_support import CaseContext

    ctx = CaseContext(tmp_path)
    job = write_job(
        ctx,
        model={"factory": f"{MODELS}:Scored", "kwargs": {"as_tuple": True}},
        data={"factory": f"{MODELS}:features"},
    )
    with caplog.at_level("WARNING", logger="merak_core.checks"):
        train_dry_run(ctx, job)  # accepted
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "Scored.forward returns a tuple of 2 values [[2, 3], [2, 8]]" in said and "output[0]" in said
    assert "'loss: file.py:function'" in said


def test_the_default_loss_reads_logits_or_the_first_element_and_refuses_a_dict_without_logits() -> None:
    from merak_core.run.engine import default_loss

    logits = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 2, 1, 2])
    expected = torch.nn.functional.cross_entropy(logits, labels)
    assert torch.equal(default_loss((logits, torch.zeros(4, 8)), labels), expected)
    assert torch.equal(default_loss({"logits": logits}, labels), expected)
    with pytest.raises(ValueError, match=r"dict with keys \['scores'\] and no 'logits'.*loss_fn"):
        default_loss({"scores": logits}, labels)


def test_input_order_by_name_and_the_single_input_of_another_name() -> None:
    from merak_core.parallel.forward_inputs import input_order

    class KeywordOnly(torch.nn.Module):
        def forward(self, x: torch.Tensor, *, mask: torch.Tensor | None = None) -> torch.Tensor:
            return x

    x = torch.zeros(2, 4)
    assert input_order(cases.Masked(), {"mask": x, "x": x}) == ["x", "mask"]  # the signature's order
    assert input_order(cases.Masked(), {"features": x}) == ["features"]  # one input: by position
    assert input_order(KeywordOnly(), {"x": x, "mask": x}) == ["x", "mask"]  # keyword-only: by name
    with pytest.raises(
        ValueError, match=r"'maks' matches no parameter of Masked.forward \(did you mean 'mask'"
    ):
        input_order(cases.Masked(), {"x": x, "maks": x})
