"""A metrics function that fails in evaluation is reported once, by every rank, with its name (no hang).

Under a pipeline only the last stage calls ``compute_metrics``; when it raised there, the other
stages waited in the next collective until the timeout and every rank printed its own traceback.
The last stage now finishes the pass (the pipeline needs it), shares the error with the metric
names, and every rank raises the same ``ValueError``. (Job files are checked before launch:
``launch_metrics_*`` rows of test_bad_input.py.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.e2e._bad_input_model_cases import Features, _args
from tests.support.dist import run_on_ranks


def item_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> Any:
    return {"accuracy": (logits.argmax(-1) == labels).float().mean().item()}  # a float, not per example


def broken_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> Any:
    return {"accuracy": (logits[:, 3] > 0).float()}  # 3 classes: index 3 is out of range, raises


def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> Any:
    return {"accuracy": (logits.argmax(-1) == labels).float()}


def evaluate_body(tmp: str, metrics: str) -> tuple[str, str] | dict[str, float]:
    from merak_core import Trainer, init

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    layout = init(pp=2, device="cpu")
    trainer = Trainer(
        model,
        _args(Path(tmp), pp=2, comm_timeout_s=30),
        Features(),
        Features(size=8),
        compute_metrics=globals()[metrics],
        layout=layout,
    )
    try:
        return trainer.evaluate()
    except Exception as exc:  # noqa: BLE001 - returned to the test process (the pooled rank survives)
        return type(exc).__name__, str(exc)


@pytest.mark.parametrize(
    ("metrics", "words"),
    [
        (
            "broken_accuracy",
            ("compute_metrics broken_accuracy failed in evaluation", "test_metrics_errors.py:"),
        ),
        ("item_accuracy", ("compute_metrics item_accuracy returned dict", "per-example values")),
    ],
)
def test_every_rank_names_the_failing_metrics_function(
    metrics: str, words: tuple[str, ...], tmp_path: Path
) -> None:
    outcomes = run_on_ranks(2, evaluate_body, str(tmp_path), metrics, timeout_s=120)
    assert outcomes[0] == outcomes[1], outcomes
    kind, message = outcomes[0]
    assert kind == "ValueError" and all(w in message for w in words), outcomes[0]


def test_good_metrics_still_evaluate(tmp_path: Path) -> None:
    outcomes = run_on_ranks(2, evaluate_body, str(tmp_path), "accuracy", timeout_s=120)
    assert outcomes[0] == outcomes[1] and 0.0 <= outcomes[0]["eval_accuracy"] <= 1.0
