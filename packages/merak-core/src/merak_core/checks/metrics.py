"""Preflight: the job's ``metrics`` function, called once on the first evaluation batch.

Evaluation calls ``metrics(logits, labels)`` on the last pipeline stage, after a whole evaluation
pass, and a function that raises there stops every rank (the others wait in a collective). Here
it is called in the launching process with the first evaluation batch's labels and logits of
the model's output shape (random values: the model is on the meta device), and must return a
tensor of per-example values or a mapping of names to such tensors.

Not checked here: the values themselves, and models whose output is not a tensor (or an object
with ``logits``) on the meta device.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from merak_core.checks.base import PreflightError
from merak_core.checks.forward import meta_output
from merak_core.checks.model import _where


def meta_logits(model: nn.Module, inputs: Any) -> torch.Tensor | None:
    """What evaluation hands the metrics function, as a meta tensor (None when the model cannot run on meta)."""
    out = meta_output(model, inputs)
    if isinstance(out, Mapping) and "logits" in out:
        out = out["logits"]
    logits = getattr(out, "logits", out)
    return logits if isinstance(logits, torch.Tensor) else None


def check_metrics(job: Any, model: nn.Module, inputs: Any, labels: Any) -> None:
    """``job.metrics`` runs on the first evaluation batch and returns per-example tensors."""
    fn = job.optional("metrics")
    logits = meta_logits(model, inputs)
    if fn is None or logits is None or not isinstance(labels, torch.Tensor):
        return
    dtype = logits.dtype if logits.is_floating_point() else torch.float32
    fake = torch.randn(tuple(logits.shape), generator=torch.Generator().manual_seed(0), dtype=dtype)
    shapes = f"logits {list(fake.shape)} of random values and the labels {list(labels.shape)}"
    try:
        with torch.no_grad():
            values = fn(fake, labels)
    except Exception as exc:  # noqa: BLE001 - reported with the function's name and where it failed
        raise PreflightError(
            f"metrics {job.metrics!r} fails on the first evaluation batch ({shapes}): "
            f"{type(exc).__name__}: {exc}{_where(exc)}; fix the function: it gets (logits, labels) as "
            "evaluation passes them and returns per-example values"
        ) from None
    named = values if isinstance(values, Mapping) else {"metric": values}
    bad = {str(k): type(v).__name__ for k, v in named.items() if not isinstance(v, torch.Tensor)}
    if bad or not named:
        raise PreflightError(
            f"metrics {job.metrics!r} returned {type(values).__name__}"
            f"{f' with non-tensor values {bad}' if bad and isinstance(values, Mapping) else ''} on the first "
            "evaluation batch: return a tensor of per-example values, or a dict of name -> such tensors "
            "(e.g. {'accuracy': (logits.argmax(-1) == labels).float()})"
        )
