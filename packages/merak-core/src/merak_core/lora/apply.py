"""Finding LoRA's target modules and wrapping them; the names the wrapped model's parameters go by.

:func:`check_targets` resolves ``target_modules`` against a model (the unsharded one, meta is
fine) and refuses, before any process starts, a list that matches nothing (naming the nearest
module names) or a module kind LoRA cannot wrap. :func:`apply_lora` wraps the targets of a model
after ``merak_tp.parallelize`` (so each adapter's ``ShardSpec`` is derived from its base
weight's, [Note: adapters under TP]) and before tracing (the wrapper is an opaque leaf, so the
pipeline partitioner, recomputation and ZeRO-1 see the adapters as ordinary parameters).

[Note: LoRA logical names] The base layer is the wrapper's child ``base_layer``; its parameters
keep the logical name they had (``h.0.attn.c_attn.weight``, as checkpoints, pretrained folders
and exports spell it), while the adapters are ``h.0.attn.c_attn.lora_A.weight`` and
``...lora_B.weight`` (PEFT's keys without its ``base_model.model.`` prefix).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

import torch
from torch import nn

from merak_core.lora.config import LoraConfig
from merak_core.lora.layer import Kind, LoraLinear

__all__ = [
    "ADAPTER_SUFFIXES",
    "apply_lora",
    "check_targets",
    "is_adapter_name",
    "logical_name",
    "target_names",
]

BASE_SEGMENT = "base_layer"
ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def is_adapter_name(name: str) -> bool:
    """Whether a logical parameter name is an adapter's (see [Note: LoRA logical names])."""
    return name.endswith(ADAPTER_SUFFIXES)


def logical_name(name: str) -> str:
    """``name`` without the wrappers' ``base_layer`` segments (see [Note: LoRA logical names])."""
    return ".".join(part for part in name.split(".") if part != BASE_SEGMENT)


def _is_conv1d(module: nn.Module) -> bool:
    cls = type(module)
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers") and hasattr(module, "nf")


def _linear_kind(module: nn.Module) -> Kind | None:
    """How LoRA wraps ``module``, or None when it is not a linear LoRA can wrap."""
    import merak_tp

    if isinstance(module, merak_tp.ColumnParallelLinear):
        return "column"
    if isinstance(module, merak_tp.RowParallelLinear):
        return "row"
    if isinstance(module, nn.Linear) or _is_conv1d(module):
        return "plain"
    return None


def _output_layer_names(model: nn.Module) -> set[str]:
    """The output layer's names (``all-linear`` leaves it out, as PEFT does)."""
    names = {"lm_head"}
    get = getattr(model, "get_output_embeddings", None)
    out = get() if callable(get) else None
    if isinstance(out, nn.Module):
        names |= {n for n, m in model.named_modules() if m is out}
    return names


def _matches(name: str, targets: Iterable[str]) -> bool:
    return any(name == t or name.endswith("." + t) for t in targets)


def target_names(model: nn.Module, config: LoraConfig) -> list[str]:
    """Qualified names of the modules ``config.target_modules`` selects (matched like PEFT's list)."""
    if config.all_linear:
        skip = _output_layer_names(model)
        return [n for n, m in model.named_modules() if n and n not in skip and _linear_kind(m) is not None]
    found = [n for n, m in model.named_modules() if n and _matches(n, config.target_modules)]
    # A match inside an already matched module (e.g. ``attn`` and ``attn.c_attn``) is the outer one's part.
    return [n for n in found if not any(n.startswith(o + ".") for o in found)]


def check_targets(model: nn.Module, config: LoraConfig) -> list[str]:
    """The target names; ValueError when none matches (with the nearest names) or one is not a linear."""
    names = target_names(model, config)
    if not names:
        linears = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if n and _linear_kind(m)})
        wanted = [t for t in config.target_modules]
        near = sorted({c for t in wanted for c in difflib.get_close_matches(t, linears, n=3, cutoff=0.4)})
        raise ValueError(
            f"model.lora.target_modules={wanted} matches no module of {type(model).__name__}"
            f"{f' (nearest: {near})' if near else ''}; its linear modules are named {linears[:16]}: "
            "list some of them, or use target_modules: all-linear"
        )
    modules = dict(model.named_modules())
    for name in names:
        if _linear_kind(modules[name]) is None:
            raise ValueError(
                f"model.lora.target_modules selects {name!r}, a {type(modules[name]).__name__}: LoRA wraps "
                "linear layers only (nn.Linear, transformers Conv1D); remove the entry that matches it "
                f"(e.g. list {name.rsplit('.', 1)[-1]}'s linear children instead)"
            )
    return names


def _adapters(base: nn.Module, kind: Kind, r: int) -> tuple[nn.Parameter, nn.Parameter]:
    """Empty A and B for ``base``, tagged with ``ShardSpec``s derived from the base weight's."""
    from merak_tp.shard_spec import REPLICATED, ShardSpec, get_shard_spec, set_shard_spec

    weight: torch.Tensor = base.weight  # type: ignore[assignment]
    if _is_conv1d(base):
        in_features, out_features = weight.shape
    else:
        out_features, in_features = weight.shape  # local shapes: sharded dims are this rank's block
    # PEFT's default (autocast_adapter_dtype): float32 adapters beside 16-bit weights.
    dtype = torch.float32 if weight.dtype in (torch.bfloat16, torch.float16) else weight.dtype
    a = nn.Parameter(torch.empty(r, in_features, dtype=dtype, device=weight.device))
    b = nn.Parameter(torch.empty(out_features, r, dtype=dtype, device=weight.device))
    spec = get_shard_spec(weight)
    if kind == "column":  # W split on dim 0 (out): B the same, with the same sections
        set_shard_spec(a, REPLICATED)
        set_shard_spec(b, ShardSpec(0, spec.sections))
    elif kind == "row":  # W split on dim 1 (in): A the same
        set_shard_spec(a, ShardSpec(1))
        set_shard_spec(b, REPLICATED)
    else:
        set_shard_spec(a, REPLICATED)
        set_shard_spec(b, REPLICATED)
    return a, b


def apply_lora(model: nn.Module, config: LoraConfig) -> list[str]:
    """Wrap ``config``'s targets of ``model`` (in place, after TP) and freeze every other parameter.

    Returns the wrapped names. The adapters are allocated (on the base weights' device, meta
    included) but not initialised: the caller fills them once the model is materialised.
    """
    names = check_targets(model, config)
    for p in model.parameters():
        p.requires_grad_(False)
    for name in names:
        base = model.get_submodule(name)
        kind = _linear_kind(base)
        assert kind is not None  # check_targets refused the others
        if kind == "column" and getattr(base, "gather_output", False):
            raise ValueError(
                f"model.lora: {name!r} is a column-parallel linear that gathers its output; LoRA "
                "cannot wrap it yet: remove it from target_modules"
            )
        a, b = _adapters(base, kind, config.r)
        wrapper = LoraLinear(base, a, b, kind=kind, scaling=config.scaling, dropout=config.dropout)
        parent_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, leaf, wrapper)
    return names


def freeze_base(named: Iterable[tuple[str, nn.Parameter]]) -> None:
    """Only adapters train: ``requires_grad`` from the logical name (after a stage is rebuilt)."""
    for name, p in named:
        p.requires_grad_(is_adapter_name(name))
