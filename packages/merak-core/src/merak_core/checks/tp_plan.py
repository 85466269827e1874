"""Preflight: the TP plan against the meta model (patterns, divisible sizes, a parallelize on a fake group)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from merak_core.checks.base import PreflightError


def _resolve_plan(model: nn.Module, tp_plan: Any) -> Any:
    import merak_tp

    if tp_plan in (None, "auto"):
        return merak_tp.plan_for_model(model)
    if isinstance(tp_plan, str):
        return merak_tp.get_plan(tp_plan)
    from_mapping = getattr(merak_tp, "plan_from_mapping", None)
    if from_mapping is not None:
        return from_mapping(tp_plan)
    return merak_tp.TPPlan(name="user", layers=dict(tp_plan))


def _match(name: str, patterns: Any) -> str | None:
    import fnmatch

    return next((p for p in patterns if fnmatch.fnmatchcase(name, p)), None)


def _section_sizes(plan: Any, pattern: str, style: str, model: nn.Module, name: str, size: int) -> list[int]:
    if style == "column_qkv":
        return [size // 3] * 3
    spec = getattr(plan, "sections", {}).get(pattern)
    if spec is None:
        return [size]
    import merak_tp.plans as plans

    resolved = plans.resolve_sections(spec, model, name)
    return [size // resolved] * resolved if isinstance(resolved, int) else list(resolved)


def _sharded_sizes(module: nn.Module, style: str) -> tuple[str, int] | None:
    """The size a style splits (its name and value), or None for styles not checked here."""
    if style == "vocab" and isinstance(module, nn.Embedding):
        return "num_embeddings", module.num_embeddings
    transposed = type(module).__name__ == "Conv1D" and hasattr(module, "nf")
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return None
    out_features, in_features = (weight.shape[1], weight.shape[0]) if transposed else weight.shape
    if style in ("column", "column_qkv", "lm_head"):
        return "out_features", int(out_features)
    if style == "row":
        return "in_features", int(in_features)
    return None


def check_tp_plan(model: nn.Module, tp_plan: Any, tp: int | None, overlap_chunks: int = 1) -> str | None:
    """Resolve the TP plan against ``model``: patterns match modules, sizes divide by ``tp``.

    Returns the plan's name, or None when the job uses no TP plan (``tp == 1`` and no
    ``tp_plan``). ``tp=None`` (the planner chooses it) checks the patterns only.
    """
    if (tp is None or tp == 1) and tp_plan in (None, "auto"):
        return None
    try:
        plan = _resolve_plan(model, tp_plan)
    except ValueError as exc:
        raise PreflightError(f"training.tp_plan={tp_plan!r}: {exc}") from None
    named = dict(model.named_modules())
    _check_patterns(model, plan, named)
    if tp is None or tp == 1:
        return str(plan.name)
    check = getattr(plan, "check", None)
    if check is not None:
        try:
            check(model, tp)
        except ValueError as exc:
            raise PreflightError(f"training.tp={tp} with TP plan {plan.name!r}: {exc}") from None
    for name, module in named.items():
        _check_divisible(model, plan, tp, name, module)
    _parallelize_on_fake_group(model, plan, tp, overlap_chunks)
    return str(plan.name)


def _check_patterns(model: nn.Module, plan: Any, named: dict[str, nn.Module]) -> None:
    """Every layer, attribute and region pattern of ``plan`` matches a module (unless optional)."""
    optional = tuple(getattr(plan, "optional", ()))
    for where in ("layers", "attributes", "regions"):
        for pattern in getattr(plan, where, ()):
            if pattern in optional or any(_match(n, [pattern]) for n in named if n):
                continue
            import difflib

            close = difflib.get_close_matches(pattern, [n for n in named if n], n=3, cutoff=0.5)
            raise PreflightError(
                f"training.tp_plan: {where} pattern {pattern!r} matches no module of {type(model).__name__} "
                f"(closest module names: {close or 'none'}); fix the pattern against model.named_modules() "
                "('*' matches any text, dots included)"
            )


def _check_divisible(model: nn.Module, plan: Any, tp: int, name: str, module: nn.Module) -> None:
    """The sizes ``plan`` shards in ``module`` (weights, sections, head-count attributes) divide by ``tp``."""
    pattern = _match(name, plan.layers) if name else None
    if pattern is not None:
        style = plan.layers[pattern]
        sized = _sharded_sizes(module, style)
        if sized is not None:
            what, size = sized
            for part in _section_sizes(plan, pattern, style, model, name, size):
                if part % tp:
                    raise PreflightError(
                        f"training.tp={tp} does not divide {name}.{what}={size}"
                        f"{f' (a section of {part})' if part != size else ''}, sharded by style {style!r} of "
                        f"tp_plan pattern {pattern!r}; choose a TP degree that divides {part}, or leave "
                        f"{name!r} replicated"
                    )
    attr_pattern = _match(name, getattr(plan, "attributes", {}))
    for attr in getattr(plan, "attributes", {}).get(attr_pattern, ()) if attr_pattern else ():
        value = getattr(module, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value % tp:
            raise PreflightError(
                f"training.tp={tp} does not divide {name}.{attr}={value} (TP plan "
                f"{plan.name!r}); choose a TP degree that divides {value}"
            )


def _parallelize_on_fake_group(model: nn.Module, plan: Any, tp: int, overlap_chunks: int) -> None:
    """Run ``merak_tp.parallelize`` itself on a copy of the meta model, as TP rank 0 of a fake group of ``tp``.

    [Note: the plan as the ranks apply it] The checks above speak in job-file terms; this one
    runs the very code every rank runs (module kinds, fused sections, head counts, the plan's own
    checks), over torch's fake process group (its collectives do nothing), in this process. It
    is skipped when torch does not ship the fake backend or a process group already exists here.
    """
    import copy

    import torch.distributed as dist

    import merak_tp
    from merak_core.parallel import _compat

    store = _compat.fake_process_group_store()
    if store is None or not dist.is_available() or dist.is_initialized():
        return
    dist.init_process_group("fake", rank=0, world_size=tp, store=store())
    try:
        merak_tp.parallelize(
            copy.deepcopy(model), plan, group=dist.group.WORLD, overlap_chunks=overlap_chunks
        )
    except ValueError as exc:
        raise PreflightError(f"training.tp={tp}, tp_plan {plan.name!r}: {exc}") from None
    finally:
        dist.destroy_process_group()
