"""Compare a distributed result with a single-process reference.

Every distributed test in Merak checks three things against a reference run in
one process: the outputs, the loss, and the gradient of every parameter, by
name. These helpers give error messages that say which tensor differs, by how
much, and where.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

# float64 runs should agree to near machine precision; float32 to ~1e-5.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-9),
    torch.float32: (1e-5, 1e-4),
    torch.bfloat16: (1e-2, 1e-2),
}


def _tol(dtype: torch.dtype, rtol: float | None, atol: float | None) -> tuple[float, float]:
    r, a = TOLERANCES.get(dtype, (1e-5, 1e-5))
    return (r if rtol is None else rtol, a if atol is None else atol)


def assert_tensors_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    name: str = "tensor",
    rtol: float | None = None,
    atol: float | None = None,
) -> None:
    """``torch.testing.assert_close`` with Merak's dtype tolerances and a named message."""
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != reference {tuple(expected.shape)}")
    r, a = _tol(expected.dtype, rtol, atol)
    torch.testing.assert_close(
        actual.detach().to(expected.dtype).cpu(),
        expected.detach().cpu(),
        rtol=r,
        atol=a,
        msg=lambda m: f"{name} differs from the reference:\n{m}",
    )


def named_grads(module: nn.Module) -> dict[str, torch.Tensor]:
    """Gradients by parameter name (tied parameters appear once, under their first name)."""
    grads = {}
    for name, param in module.named_parameters():
        if param.grad is None:
            raise AssertionError(f"parameter {name!r} has no gradient")
        grads[name] = param.grad.detach().clone()
    return grads


def assert_grads_match(
    actual: Mapping[str, torch.Tensor],
    expected: Mapping[str, torch.Tensor],
    *,
    rtol: float | None = None,
    atol: float | None = None,
    allow_missing: Iterable[str] = (),
) -> None:
    """Every expected gradient is present in ``actual`` under the same name and is close.

    ``actual`` may be assembled from several ranks (e.g. the union of every pipeline
    stage's gradients, or TP shards concatenated back); names in ``allow_missing``
    may be absent.
    """
    allowed = set(allow_missing)
    missing = sorted(set(expected) - set(actual) - allowed)
    extra = sorted(set(actual) - set(expected))
    if missing or extra:
        raise AssertionError(f"gradient names differ: missing {missing}, unexpected {extra}")
    for name, ref in expected.items():
        if name in actual:
            assert_tensors_close(actual[name], ref, name=f"grad[{name}]", rtol=rtol, atol=atol)


def reference_step(
    model: nn.Module,
    inputs: tuple[torch.Tensor, ...],
    labels: torch.Tensor,
    loss_fn,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """One forward+backward in this process: (outputs, loss, gradients by name)."""
    model.zero_grad(set_to_none=True)
    out = model(*inputs)
    loss = loss_fn(out, labels)
    loss.backward()
    return out.detach(), loss.detach(), named_grads(model)


__all__ = ["TOLERANCES", "assert_grads_match", "assert_tensors_close", "named_grads", "reference_step"]


def replayable_arguments(prefix: str, **values: Any) -> Any:
    """``TrainingArguments`` whose steps a single-process reference replays by hand: a constant learning
    rate, no clipping, no weight decay, every step logged, seed 7, a fresh output folder named ``prefix``;
    ``values`` (the test's sizes, dtype, layout) override any of them."""
    import tempfile

    from merak_core import TrainingArguments

    defaults: dict[str, Any] = dict(
        output_dir=tempfile.mkdtemp(prefix=prefix),
        gradient_accumulation_steps=1,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        weight_decay=0.0,
        logging_steps=1,
        seed=7,
    )
    return TrainingArguments(**{**defaults, **values})
