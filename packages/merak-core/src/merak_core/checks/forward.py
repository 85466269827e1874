"""Preflight: the first batch against the model's ``forward`` (on the meta device).

- the batch's input keys name ``forward``'s parameters (:func:`merak_core.parallel.forward_inputs.input_order`:
  with several inputs a key that matches none is refused, never passed by position);
- with the default loss, the output holds logits: a tensor, an object or dict with ``logits``
  (transformers' ``ModelOutput``), or a tuple whose first element the loss reads (said in the
  launch log, with how to choose another); a dict without ``logits`` is refused.

Not checked here: models that do not run on meta tensors (the ranks run them).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from merak_core.checks.base import PreflightError

logger = logging.getLogger(__name__)


def meta_output(model: nn.Module, inputs: Any) -> Any:
    """``model``'s output for ``inputs`` moved to the meta device (None when the model cannot run there)."""

    def meta(x: Any) -> Any:
        return x.to("meta") if isinstance(x, torch.Tensor) else x

    try:
        with torch.no_grad():
            if isinstance(inputs, Mapping):
                return model(**{k: meta(v) for k, v in inputs.items()})
            if isinstance(inputs, (list, tuple)):
                return model(*[meta(v) for v in inputs])
            return model(meta(inputs))
    except Exception:  # noqa: BLE001 - not every model runs on meta tensors; the ranks run it then
        return None


def check_input_keys(model: nn.Module, inputs: Any, what: str) -> None:
    """Every key of a dict batch with several inputs is a parameter of ``model.forward``."""
    from merak_core.parallel.forward_inputs import input_order

    if not isinstance(inputs, Mapping):
        return
    try:
        input_order(model, inputs)
    except ValueError as exc:
        raise PreflightError(f"the first {what} batch: {exc}") from None


def check_default_loss_output(model: nn.Module, inputs: Any) -> None:
    """The default loss can read logits from the model's output (see the module docstring)."""
    out = meta_output(model, inputs)
    name = type(model).__name__
    if isinstance(out, Mapping) and "logits" not in out and not hasattr(out, "logits"):
        raise PreflightError(
            f"{name}.forward returns a dict with keys {sorted(map(str, out))} and no 'logits', so the default "
            "loss (cross-entropy over the logits) has nothing to read: return the logits under 'logits', "
            "or set 'loss: file.py:function' to a loss that reads this dict"
        )
    if isinstance(out, (tuple, list)) and out:
        shapes = [list(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__ for v in out]
        logger.warning(
            "%s.forward returns a %s of %d values %s: the default loss (cross-entropy) reads the first, "
            "output[0], as the logits; to use another, set 'loss: file.py:function' (it gets the whole output)",
            name,
            type(out).__name__,
            len(out),
            shapes,
        )


def check_traceable(model: nn.Module, inputs: Any, args: Any) -> bool:
    """``pp > 1`` at ``tp = 1``: the model traces as the ranks trace it to cut stages; whether it was checked.

    The inputs go by keyword when every key is a ``forward`` parameter, else by position, and the
    TP plan's ``trace_leaves`` stay whole, as in :func:`merak_core.parallel.compose.build_parallel_model`.
    With ``tp > 1`` the ranks trace the TP-sharded model (its TP layers opaque), which is not built
    here, and a failure that names the meta device is left to the ranks (they may trace real values).
    """
    import types
    import typing

    import merak_graph
    from merak_core.parallel.forward_inputs import _all_forward_params, input_order, untraceable_message
    from merak_core.parallel.tensor_parallel import trace_leaves

    if args.pp <= 1 or args.tp != 1 or args.layout == "auto":
        return False
    if isinstance(inputs, Mapping):
        if _all_forward_params(model, list(inputs)):
            example: Any = dict(inputs)
        else:
            example = tuple(inputs[k] for k in input_order(model, inputs) or ())
    else:
        example = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    leaves = trace_leaves(model, typing.cast(Any, types.SimpleNamespace(tp=1)), args.tp_plan)  # tp=1: no TP
    try:
        merak_graph.trace(model, example_inputs=example, leaf_modules=leaves)
    except merak_graph.TraceError as exc:
        if "meta" in str(exc):
            return False
        raise PreflightError(f"training.{untraceable_message(model, exc, args.pp)}") from None
    return True
