"""Preflight: the model factory's keyword arguments and a build on the meta device."""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn

from merak_core.checks.base import PreflightError
from merak_core.job import JobConfig, _suggest


def _members(annotation: Any) -> tuple[Any, ...]:
    origin = typing.get_origin(annotation)
    return typing.get_args(annotation) if origin in (typing.Union, types.UnionType) else (annotation,)


def _fits(value: Any, annotation: Any) -> bool | None:
    """Whether ``value`` fits a simple annotation (None: cannot tell)."""
    checks: list[bool] = []
    for member in _members(annotation):
        if member is type(None):
            checks.append(value is None)
        elif member is bool:
            checks.append(isinstance(value, bool))
        elif member is int:
            checks.append(isinstance(value, int) and not isinstance(value, bool))
        elif member is float:
            checks.append(isinstance(value, (int, float)) and not isinstance(value, bool))
        elif member is str:
            checks.append(isinstance(value, str))
        elif typing.get_origin(member) in (list, tuple, Sequence) or member in (list, tuple):
            checks.append(isinstance(value, (list, tuple)))
        elif typing.get_origin(member) in (dict, Mapping) or member is dict:
            checks.append(isinstance(value, Mapping))
        else:
            return None
    return any(checks)


def _type_text(annotation: Any) -> str:
    return " or ".join(
        "null" if m is type(None) else getattr(m, "__name__", str(m)) for m in _members(annotation)
    )


def check_model_kwargs(fn: Callable[..., Any], kwargs: Mapping[str, Any], section: str = "model") -> None:
    """Every keyword is a parameter of ``fn`` and fits its annotation (or its default's type)."""
    try:
        sig = inspect.signature(fn)
        hints = typing.get_type_hints(fn)
    except (TypeError, ValueError, NameError):
        return
    params = sig.parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    named = [
        n
        for n, p in params.items()
        if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    name = getattr(fn, "__qualname__", repr(fn))
    for key, value in kwargs.items():
        if key not in params:
            if takes_any:
                continue
            raise PreflightError(
                f"{section}.kwargs.{key}: {name}() takes no argument {key!r}"
                f"{_suggest(str(key), named)}; its arguments are {named}"
            )
        param = params[key]
        if key in hints:
            ok, expected = _fits(value, hints[key]), _type_text(hints[key])
        elif param.default is not inspect.Parameter.empty and param.default is not None:
            default_type = type(param.default)
            ok = _fits(value, default_type) if default_type in (int, float, bool, str) else None
            expected = f"{default_type.__name__} (like its default {param.default!r})"
        else:
            ok = None
        if ok is False:
            raise PreflightError(
                f"{section}.kwargs.{key}={value!r} has the wrong type for {name}(): expected "
                f"{expected}, got {type(value).__name__}; fix {section}.kwargs.{key} in the job file"
            )


def build_meta_model(job: JobConfig) -> nn.Module:
    """The job's model built under ``merak_graph.empty_init`` (parameters on the meta device)."""
    import merak_graph

    if job.model.pretrained is not None:
        return _pretrained_meta_model(job)
    fn = job.model.load(job.base_dir, "model.factory")
    check_model_kwargs(fn, job.model.kwargs)
    try:
        with merak_graph.empty_init():
            model = fn(**job.model.kwargs)
    except Exception as exc:  # noqa: BLE001 - reported with the factory and the kwargs
        culprit = _culprit(fn, job.model.kwargs)
        if culprit is not None:
            raise PreflightError(
                f"model.kwargs.{culprit}={job.model.kwargs[culprit]!r} breaks model.factory "
                f"{job.model.spec!r} (it builds with the factory's default for {culprit!r}): "
                f"{type(exc).__name__}: {exc}{_where(exc)}; fix model.kwargs.{culprit}"
            ) from None
        raise PreflightError(
            f"model.factory {job.model.spec!r} failed with kwargs {job.model.kwargs}: "
            f"{type(exc).__name__}: {exc}{_where(exc)}"
        ) from None
    if not isinstance(model, nn.Module):
        raise PreflightError(
            f"model.factory {job.model.spec!r} returned {type(model).__name__}, not a torch.nn.Module; "
            "return the model"
        )
    return model


def _pretrained_meta_model(job: JobConfig) -> nn.Module:
    """``model.pretrained``: the model built from the folder's config.json and matched to its tensors."""
    from merak_core.hf import PretrainedWeights

    folder = job.model.pretrained
    assert folder is not None
    try:
        model = job.build_model()
    except ValueError as exc:
        raise PreflightError(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - reported with the folder
        raise PreflightError(
            f"model.pretrained {folder!r}: building the model from its config.json failed: "
            f"{type(exc).__name__}: {exc}{_where(exc)}"
        ) from None
    try:
        PretrainedWeights.match(model, folder)  # names and shapes, from the file headers
    except ValueError as exc:
        raise PreflightError(str(exc)) from None
    return model


def _culprit(fn: Callable[..., Any], kwargs: Mapping[str, Any], limit: int = 16) -> str | None:
    """The one keyword argument without which the factory builds (tried on the meta device), if there is one."""
    import merak_graph

    if not 0 < len(kwargs) <= limit:
        return None
    found = []
    for key in kwargs:
        try:
            with merak_graph.empty_init():
                fn(**{k: v for k, v in kwargs.items() if k != key})
        except Exception:  # noqa: BLE001 - still failing (or the key has no default): not this key alone
            continue
        found.append(key)
    return found[0] if len(found) == 1 else None


def _where(exc: BaseException) -> str:
    tb = exc.__traceback__
    last = None
    while tb is not None:
        last = tb
        tb = tb.tb_next
    if last is None:
        return ""
    return f" (at {last.tb_frame.f_code.co_filename}:{last.tb_lineno})"
