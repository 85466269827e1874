"""How a batch's inputs meet the model's ``forward``: by name, in signature order, or refused.

A batch given as a dict is passed to the model by name when every key is a ``forward`` parameter
(the pipeline's first stage then takes them in the signature's order). A dict with a single input
may feed a parameter of another name (a dataset's ``input_ids`` for ``forward(self, tokens)``);
with several inputs a key that matches no parameter is refused by name, never passed by position.
Also here: the one paragraph that says why the pipeline could not trace a model and what to do.

Not done here: tracing and partitioning (``merak_graph``), composing the model (``compose.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

__all__ = ["input_order", "untraceable_message"]


def input_order(model: nn.Module, example_inputs: Mapping[str, Any] | Sequence[Any]) -> list[str] | None:
    """The keys of dict inputs in the order the model takes them positionally (None for a tuple).

    Keys that are ``forward`` parameters are ordered by the signature; otherwise the
    dict's own order is kept (e.g. a dataset's ``input_ids`` for ``forward(self, tokens)``).
    """
    if not isinstance(example_inputs, Mapping):
        return None
    import inspect

    signature = inspect.signature(model.forward).parameters
    params = [p.name for p in signature.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    keys = list(example_inputs)
    if all(k in params for k in keys):
        return sorted(keys, key=params.index)
    named = [n for n, p in signature.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    unknown = [k for k in keys if k not in named]
    if len(keys) > 1 and unknown:  # which key feeds which parameter cannot be told: never guess by position
        import difflib

        close = difflib.get_close_matches(str(unknown[0]), named, n=1)
        raise ValueError(
            f"the batch's input {unknown[0]!r} matches no parameter of {type(model).__name__}.forward"
            f"{f' (did you mean {close[0]!r}?)' if close else ''}; its parameters are {named}. Inputs are "
            "passed by name: rename or drop that key in the dataset or the collate function (a batch "
            "with a single input may feed a parameter of another name)"
        )
    return keys


def _all_forward_params(model: nn.Module, keys: list[str]) -> bool:
    import inspect

    params = inspect.signature(model.forward).parameters
    return bool(keys) and all(k in params for k in keys)


def untraceable_message(model: nn.Module, exc: Any, pp: int) -> str:
    """One paragraph for a model the pipeline cannot trace: both tracers' errors, the module, the fix."""
    lines = [line.strip() for line in str(exc).splitlines()[1:] if not line.startswith("Fix:")]
    name = getattr(exc, "module_name", None)
    if getattr(getattr(model, "config", None), "use_cache", False) and "Cache" in str(exc):
        return (
            f"pp={pp}: the pipeline cuts {type(model).__name__} into stages by tracing it into a graph, and "
            f"with use_cache=True its forward returns a KV cache object, which no stage can pass on: build "
            "the model with use_cache=False (model.config.use_cache = False in the factory), or train "
            "without a pipeline (pp=1)"
        )
    keep = (
        f"keep module {name!r} whole inside one stage (training.tp_plan: {{layers: {{}}, trace_leaves: "
        f"[{name!r}]}} in a job file; merak_graph.trace(..., leaf_modules=...) by hand), or "
        if name
        else ""
    )
    return (
        f"pp={pp}: the pipeline cuts {type(model).__name__} into stages by tracing it into a graph, and it "
        f"cannot be traced: {' '.join(lines)}. Fix: {keep}train without a pipeline (pp=1)"
    )
