"""``parallelize``: convert an existing model to tensor parallelism in place, following a plan.

Steps, in an order that leaves the model untouched if anything is invalid:

1. resolve the plan (``plan=None`` picks a built-in plan by model type);
2. check and compute every per-rank attribute (head counts...) and build every
   parallel layer by slicing the existing weights (real or meta tensors), so a
   size that the TP degree does not divide raises before anything changes;
3. swap the layers in under the same names, keep tied parameters tied (a
   parameter shared by two sharded modules is sliced once and shared; any other
   module attribute holding it gets the shard too), set the attributes;
4. with ``overlap_chunks > 1`` or ``sequence_parallel``, turn the plan's regions
   into sub-pipelined / sequence-parallel regions (see ``overlap.py``).

After it, every parameter has a ``ShardSpec`` (see [Note: shard metadata] in
``shard_spec.py``); ``gather_tensor`` rebuilds a full tensor from the shards.

[Note: stock forwards] A module is replaced by a parallel layer only when the
result cannot change: its class's forward is ``nn.Linear``'s or
``nn.Embedding``'s (subclasses that keep it are fine), it is a transformers
``Conv1D``, or the plan declares its class in ``module_kinds`` (e.g. Gemma's
scaled embedding as ``scaled_embedding``, whose scale the parallel embedding
keeps). Any other module under a sharding style is an error naming it, its
class and the fix; a plan pattern that matches no module is an error too.
"""

from __future__ import annotations

import difflib
import fnmatch
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from merak_tp import _compat
from merak_tp.collectives import tp_size
from merak_tp.embedding import VocabParallelEmbedding
from merak_tp.layer_kinds import _build, _kind
from merak_tp.linear import ColumnParallelLinear, RowParallelLinear
from merak_tp.overlap import make_region, make_sequence_gather, make_sequence_scatter
from merak_tp.plans import TPPlan, get_plan, plan_for_model, resolve_sections
from merak_tp.rng import RNGTracker
from merak_tp.shard_spec import REPLICATED, get_shard_spec, has_shard_spec, set_shard_spec

logger = logging.getLogger(__name__)

__all__ = ["gather_tensor", "grad_sum_groups", "is_replicated", "parallelize"]


def _match(name: str, patterns: Any) -> str | None:
    for pattern in patterns:
        if fnmatch.fnmatchcase(name, pattern):
            return pattern
    return None


def _closest(pattern: str, names: list[str]) -> list[str]:
    """Module names nearest to a pattern that matches none: the pattern's siblings, most similar first."""
    parent, _, leaf = pattern.rpartition(".")
    if parent:
        by_leaf: dict[str, str] = {}
        for n in names:
            head, _, tail = n.rpartition(".")
            if fnmatch.fnmatchcase(head, parent):
                by_leaf.setdefault(tail, n)
        if by_leaf:
            near = difflib.get_close_matches(leaf, list(by_leaf), n=5, cutoff=0.0)
            return [by_leaf[n] for n in near]
    return difflib.get_close_matches(pattern.replace("*", "0"), names, n=3, cutoff=0.5)


def _check_patterns(model: nn.Module, plan: TPPlan, names: list[str]) -> None:
    """Every pattern of the plan matches at least one module (unless listed in ``plan.optional``)."""
    groups = (("layers", plan.layers), ("attributes", plan.attributes), ("regions", plan.regions))
    for where, patterns in groups:
        for pattern in patterns:
            if pattern in plan.optional or any(fnmatch.fnmatchcase(n, pattern) for n in names):
                continue
            close = _closest(pattern, [n for n in names if n])
            raise ValueError(
                f"TP plan {plan.name!r}: {where} pattern {pattern!r} matched no module of {type(model).__name__} "
                f"(closest module names: {close or 'none'}); fix the pattern against model.named_modules() "
                "('*' matches any text, dots included), or list it in the plan's optional patterns"
            )


def _attributes(named: dict[str, nn.Module], plan: TPPlan, tp: int) -> list[tuple[str, str, int]]:
    """(module name, attribute, per-rank value) for every attribute the plan divides; checked first."""
    out: list[tuple[str, str, int]] = []
    for name, module in named.items():
        pattern = _match(name, plan.attributes)
        if pattern is None:
            continue
        for attr in plan.attributes[pattern]:
            value = getattr(module, attr, None)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(
                    f"TP plan {plan.name!r}: attribute {attr!r} of {name} ({type(module).__name__}) "
                    f"is {value!r}, not an integer to divide by the TP size; fix the plan's "
                    f"attributes for pattern {pattern!r}"
                )
            if value % tp:
                raise ValueError(
                    f"{name}.{attr}={value} is not divisible by the tensor-parallel size {tp}; "
                    f"choose a TP degree that divides {value}"
                )
            out.append((name, attr, value // tp))
    return out


def _swap_in(model: nn.Module, replaced: list[tuple[str, nn.Module, nn.Module]]) -> None:
    """Put the new layers in place, keeping ties: a parameter shared by several modules is sliced once."""
    shard_of: dict[int, nn.Parameter] = {}
    for name, old, new in replaced:
        for pname, new_p in list(new.named_parameters(recurse=False)):
            old_p = getattr(old, pname, None)
            if old_p is None:
                continue
            if id(old_p) in shard_of:
                shared = shard_of[id(old_p)]
                if shared.shape != new_p.shape or get_shard_spec(shared).dim != get_shard_spec(new_p).dim:
                    raise ValueError(
                        f"{name}.{pname} is tied to a parameter sharded differently "
                        f"({tuple(shared.shape)} vs {tuple(new_p.shape)}); shard both the same way"
                    )
                setattr(new, pname, shared)
            else:
                shard_of[id(old_p)] = new_p
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    for module in model.modules():
        for pname, p in list(module._parameters.items()):
            if p is not None and id(p) in shard_of and module._parameters[pname] is not shard_of[id(p)]:
                module._parameters[pname] = shard_of[id(p)]


def parallelize(
    model: nn.Module,
    plan: TPPlan | str | None = None,
    *,
    group: ProcessGroup | None,
    overlap_chunks: int = 1,
    sequence_parallel: bool = False,
    vocab_parallel_loss: bool | None = None,
    rng_tracker: RNGTracker | None = None,
) -> nn.Module:
    """Tensor-parallelize ``model`` in place over ``group`` and return it.

    ``plan``: a ``TPPlan``, a registered plan name, or ``None`` for the built-in
    plan of the model's type. ``overlap_chunks``: sub-microbatches for the
    overlapped (sub-pipelined) collectives, 1 = plain TP. ``sequence_parallel``:
    Megatron-style sequence parallelism between the regions (the sequence
    length must be divisible by the TP size). ``vocab_parallel_loss`` overrides
    the plan's choice: True leaves the LM head's logits sharded along the
    vocabulary for ``vocab_parallel_cross_entropy``; the default keeps the
    model's output equal to the unsharded model's. ``rng_tracker``: an
    ``RNGTracker`` holding a "tp" state (see ``merak_tp.rng``); the plan's
    ``rng_regions`` then draw their dropout from it (a different stream on each
    TP rank), everything else from the default generator (same seed on every TP rank).

    Raises ``ValueError`` before changing anything when a plan pattern matches no
    module, a matched module's forward is not one the plan knows (see [Note: stock
    forwards]), or a size is not divisible by the TP degree.
    """
    plan = _resolve_plan(
        model,
        plan,
        overlap_chunks=overlap_chunks,
        sequence_parallel=sequence_parallel,
        rng_tracker=rng_tracker,
    )
    vocab_loss = plan.vocab_parallel_loss if vocab_parallel_loss is None else vocab_parallel_loss
    tp = tp_size(group)
    named = dict(model.named_modules())
    _check_patterns(model, plan, list(named))
    if plan.check is not None:
        plan.check(model, tp)
    region_names = [n for n in named if _match(n, plan.regions) is not None]  # "" = the model itself
    new_attrs = _attributes(named, plan, tp)
    replaced = _build_layers(
        model,
        named,
        plan,
        region_names,
        group=group,
        chunks=overlap_chunks,
        sp=sequence_parallel,
        vocab_loss=vocab_loss,
    )
    # Nothing in the model has changed so far; from here on it is converted.
    _swap_in(model, replaced)
    for name, attr, value in new_attrs:
        setattr(model.get_submodule(name) if name else model, attr, value)
    if plan.fixup is not None:
        for name, module in model.named_modules():
            plan.fixup(module, name, tp)
    for p in model.parameters():
        if not has_shard_spec(p):
            set_shard_spec(p, REPLICATED)
    _apply_regions(
        model,
        plan,
        region_names,
        group=group,
        tp=tp,
        chunks=overlap_chunks,
        sp=sequence_parallel,
        rng_tracker=rng_tracker,
    )
    logger.info(
        "parallelized %s with plan %s over %d ranks (%d layers sharded, overlap_chunks=%d, "
        "sequence_parallel=%s)",
        type(model).__name__,
        plan.name,
        tp,
        len(replaced),
        overlap_chunks,
        sequence_parallel,
    )
    return model


def _resolve_plan(
    model: nn.Module,
    plan: TPPlan | str | None,
    *,
    overlap_chunks: int,
    sequence_parallel: bool,
    rng_tracker: RNGTracker | None,
) -> TPPlan:
    """Step 1: check the arguments and find the plan (``None``: the built-in plan of the model's type)."""
    if overlap_chunks < 1:
        raise ValueError(f"overlap_chunks={overlap_chunks}: expected an integer >= 1 (1 = no overlap)")
    if rng_tracker is not None and "tp" not in rng_tracker:
        raise ValueError(
            'rng_tracker has no "tp" state: call tracker.add("tp", merak_tp.tp_seed(seed, group)) '
            "before parallelize"
        )
    if plan is None:
        plan = plan_for_model(model)
    elif isinstance(plan, str):
        plan = get_plan(plan)
    if sequence_parallel and not plan.sequence_parallel:
        why = f": {plan.sequence_parallel_note}" if plan.sequence_parallel_note else ""
        raise ValueError(
            f"TP plan {plan.name!r} (for {type(model).__name__}) does not support "
            f"sequence_parallel=True{why}; use sequence_parallel=False (training.sequence_parallel: "
            "false), tensor parallelism without it is exact"
        )
    return plan


def _build_layers(
    model: nn.Module,
    named: dict[str, nn.Module],
    plan: TPPlan,
    region_names: list[str],
    *,
    group: ProcessGroup | None,
    chunks: int,
    sp: bool,
    vocab_loss: bool,
) -> list[tuple[str, nn.Module, nn.Module]]:
    """Step 2: every parallel layer, sliced from the existing weights; the model is not changed."""
    replaced: list[tuple[str, nn.Module, nn.Module]] = []
    for name, module in named.items():
        pattern = _match(name, plan.layers) if name else None
        if pattern is None or plan.layers[pattern] in ("replicate", "per_head"):
            continue
        style = plan.layers[pattern]
        kind = _kind(module, name, style, plan)
        spec = plan.sections.get(pattern)
        sections = 1 if spec is None else resolve_sections(spec, model, name)
        in_region = any(r == "" or name.startswith(r + ".") for r in region_names)
        new = _build(
            module,
            name,
            style,
            kind,
            sections,
            group=group,
            chunks=chunks,
            sp=sp,
            in_region=in_region,
            vocab_loss=vocab_loss,
            head_sp=not plan.sequence_gather,
        )
        if isinstance(new, (ColumnParallelLinear, RowParallelLinear)):
            new.layer_name = name
        replaced.append((name, module, new))
    if not replaced:
        raise ValueError(
            f"TP plan {plan.name!r} matched no module of {type(model).__name__}: check its "
            f"patterns {sorted(plan.layers)} against model.named_modules()"
        )
    return replaced


def _apply_regions(
    model: nn.Module,
    plan: TPPlan,
    region_names: list[str],
    *,
    group: ProcessGroup | None,
    tp: int,
    chunks: int,
    sp: bool,
    rng_tracker: RNGTracker | None,
) -> None:
    """Regions: overlap, sequence parallelism and the TP random stream; per-head modules' gradient sums."""
    named = dict(model.named_modules())
    per_head = {
        id(p)
        for n, m in named.items()
        if n and (pattern := _match(n, plan.layers)) is not None and plan.layers[pattern] == "per_head"
        for p in m.parameters()
    }
    if tp > 1:
        for p in model.parameters():
            if id(p) in per_head and p.requires_grad:
                _compat.register_grad_hook(
                    p, _make_sum_hook(group)
                )  # each rank applied it to its own heads only
    if (chunks > 1 or sp or rng_tracker is not None) and tp > 1:
        for name in region_names:
            fork = rng_tracker if _match(name, plan.rng_regions) is not None else None
            if chunks == 1 and not sp and fork is None:
                continue  # only the TP random stream asked for: regions without dropout stay as they are
            make_region(
                named[name], group=group, chunks=chunks, sequence_parallel=sp, name=name, rng_tracker=fork
            )
    if not (sp and tp > 1):
        return
    scatter = [n for n in named if _match(n, plan.sequence_scatter) is not None]
    if not scatter:
        raise ValueError(
            f"sequence_parallel=True but plan {plan.name!r} names no sequence_scatter module "
            f"matching the model (patterns {plan.sequence_scatter})"
        )
    for name in scatter:
        make_sequence_scatter(named[name], group=group)
    for name in [n for n in named if _match(n, plan.sequence_gather) is not None]:
        make_sequence_gather(named[name], group=group)
    full = {
        id(p) for n, m in named.items() if _match(n, plan.sequence_full) is not None for p in m.parameters()
    }
    # A row layer's bias gradient is computed from the gathered output gradient: already full.
    full |= {
        id(p)
        for m in named.values()
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding))
        for p in m.parameters()
    }
    full |= per_head  # inside a region (full sequence); summed over the heads above
    for p in model.parameters():
        spec = get_shard_spec(p)
        if not spec.sharded and id(p) not in full and p.requires_grad:
            set_shard_spec(p, spec.replace(sequence_partial=True))
            _compat.register_grad_hook(p, _make_sum_hook(group))


def _make_sum_hook(group: ProcessGroup | None) -> Callable[[torch.Tensor], torch.Tensor]:
    def hook(grad: torch.Tensor) -> torch.Tensor:
        if hook.merak_tp_deferred:  # type: ignore[attr-defined]  # summed once per step (grad_sums.py)
            return grad
        # Under sequence parallelism a replicated parameter sees only this rank's tokens.
        out = grad.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    hook.merak_tp_sum_group = group  # type: ignore[attr-defined]  # see grad_sum_groups
    hook.merak_tp_deferred = False  # type: ignore[attr-defined]  # see merak_tp.grad_sums.defer_grad_sums
    return hook


def grad_sum_groups(param: torch.Tensor) -> list[ProcessGroup | None]:
    """The groups whose sum ``parallelize`` completes ``param``'s gradient with, by a hook on ``param``.

    [Note: gradient sum hooks] A replicated weight applied to this rank's heads only (per-head norms) or
    to its tokens only (sequence parallelism) gets a partial gradient; a hook on the parameter
    all-reduces it over the TP group. A wrapper that feeds the gradients of replacement parameters
    itself (FSDP2's sharded parameters) never runs the hook: it must do these sums (they commute with
    its own reduce-scatter).
    """
    hooks = param.__dict__.get("_merak_grad_hooks", ())  # recorded by _compat.register_grad_hook
    return [h.merak_tp_sum_group for h in hooks if hasattr(h, "merak_tp_sum_group")]


def is_replicated(param: torch.Tensor) -> bool:
    """True when ``param`` is identical on every TP rank (its ``ShardSpec.dim`` is None)."""
    return not get_shard_spec(param).sharded


def gather_tensor(
    tensor: torch.Tensor, *, like: torch.Tensor | None = None, group: ProcessGroup | None
) -> torch.Tensor:
    """The full tensor from every rank's shard of ``tensor`` (shard layout read from ``like`` or itself).

    Works for a parameter, its ``.grad`` (pass the parameter as ``like``) or an
    optimizer state of the same shape. Replicated tensors are returned as is.
    Collective over ``group`` for a sharded tensor (see ``ShardSpec.gather``).
    """
    spec = get_shard_spec(tensor if like is None else like)
    if not spec.sharded or tp_size(group) == 1:
        return tensor.detach()
    return spec.gather(tensor, group)
