"""Preflight: the job's numbers against each other, the model and the first batch.

- a step's microbatches fill the pipeline (``gradient_accumulation_steps >= pp``);
- a TP plan that shards a projection inside an attention module splits whole heads: the
  attention's head counts (query and key/value, from the module or the model's config) divide
  by ``tp`` (the built-in plans check their own; this catches hand-written ``tp_plan`` mappings);
- the training set holds at least one global batch (``per_device_train_batch_size x
  gradient_accumulation_steps x dp`` samples; the loader drops a last partial batch);
- the first batch's sequences fit the model's learned position table (``n_positions``,
  ``max_position_embeddings``; rotary models take any length and are not checked);
- the first batch counts at least one label (not every label is the ignore index -100).

Not checked here: what needs the degrees chosen by ``layout: auto`` (they are known only on the ranks).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from merak_core.checks.base import PreflightError

IGNORE_INDEX = -100
"""The label the default loss (and transformers' models) ignores."""

HEAD_ATTRIBUTES = (
    "num_heads",
    "num_attention_heads",
    "n_head",
    "n_heads",
    "num_kv_heads",
    "num_key_value_heads",
    "n_kv_heads",
)
"""Attributes (of an attention module or its ``config``) that hold a head count."""

POSITION_TABLE = re.compile(
    r"(^|\.)(wpe|embed_positions|(pos|position|positional)_?(emb|embed|embeddings?))$"
)
"""Names of learned position embeddings (``wpe``, ``position_embeddings``, ``embed_positions``, ``pos_emb``)."""

SHARDING_STYLES = ("column", "column_qkv", "row")
"""TP styles that split a projection's features (so the heads they carry)."""


def check_microbatches(args: Any) -> None:
    """A pipeline of ``pp`` stages needs at least ``pp`` microbatches per step (``layout: auto`` chooses both)."""
    if args.layout == "auto" or args.pp <= 1 or args.num_microbatches >= args.pp:
        return
    raise PreflightError(
        f"training.gradient_accumulation_steps={args.num_microbatches} microbatches per step is fewer "
        f"than training.pp={args.pp} pipeline stages (the pipeline could not fill); set "
        f"training.gradient_accumulation_steps={args.pp} (or more), or a smaller training.pp"
    )


def check_global_batch(size: int | None, args: Any, dp: int | None) -> None:
    """The training set holds one global batch (``dp`` None: unknown yet, counted as 1, a lower bound)."""
    if size is None:
        return
    replicas = dp if dp is not None else 1
    per_replica = args.per_device_train_batch_size * args.num_microbatches
    if size >= per_replica * replicas:
        return
    dp_text = f"dp={replicas}" if dp is not None else "dp>=1"
    fix = (
        f"lower training.per_device_train_batch_size or training.gradient_accumulation_steps (their product "
        f"times dp must be at most {size})"
        if size >= replicas
        else f"lower training.dp (at most {size}), training.per_device_train_batch_size and "
        "training.gradient_accumulation_steps"
    )
    raise PreflightError(
        f"the training set from data.factory has {size} samples, fewer than one global batch of "
        f"{per_replica * replicas} (training.per_device_train_batch_size={args.per_device_train_batch_size} x "
        f"training.gradient_accumulation_steps={args.num_microbatches} x {dp_text}), so no step could run: "
        f"{fix}, or give the job more data"
    )


def check_attention_heads(model: nn.Module, plan: Any, tp: int | None) -> None:
    """Every attention module that ``plan`` shards a projection of has head counts divisible by ``tp``."""
    if plan is None or tp is None or tp <= 1:
        return
    layers = getattr(plan, "layers", {})
    named = dict(model.named_modules())
    seen: set[str] = set()
    for name in named:
        pattern = next((p for p in layers if name and fnmatch.fnmatchcase(name, p)), None)
        if pattern is None or layers[pattern] not in SHARDING_STYLES:
            continue
        owner = _attention_owner(name, named)
        if owner is None or owner[0] in seen:
            continue
        seen.add(owner[0])
        for attr, (value, where) in owner[1].items():
            if value % tp:
                raise PreflightError(
                    f"training.tp={tp} shards {name} (training.tp_plan pattern {pattern!r}, style "
                    f"{layers[pattern]!r}) inside the attention {owner[0]} ({type(named[owner[0]]).__name__}) "
                    f"whose {attr}={value} ({where}) does not divide by {tp}: every rank must hold whole "
                    f"heads; choose a TP degree that divides {value}, or leave that attention replicated"
                )


def _attention_owner(
    name: str, named: Mapping[str, nn.Module]
) -> tuple[str, dict[str, tuple[int, str]]] | None:
    """The nearest enclosing attention module of ``name`` and its head counts (None outside attention)."""
    parts = name.split(".")
    for depth in range(len(parts) - 1, 0, -1):
        owner = ".".join(parts[:depth])
        counts = _head_counts(named[owner])
        if counts:
            return owner, counts
    return None


def _head_counts(module: nn.Module) -> dict[str, tuple[int, str]]:
    """Head counts held by ``module`` itself, or (for a module named like an attention) by its ``config``."""
    counts: dict[str, tuple[int, str]] = {}
    for attr in HEAD_ATTRIBUTES:
        value = getattr(module, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            counts[attr] = (value, "an attribute of the module")
    kind = type(module).__name__.lower()
    config = getattr(module, "config", None)
    if not counts and config is not None and ("attention" in kind or "attn" in kind):
        for attr in HEAD_ATTRIBUTES:
            value = getattr(config, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                counts[attr] = (value, "from the model's config")
    return counts


def _seq_key(job: Any) -> str | None:
    """The job key that sets the sequence length, when the job file has one."""
    from merak_core.data.text.job import FACTORY as TEXT_FACTORY

    if "seq_len" in job.data.kwargs:
        return "data.seq_len" if job.data.spec == TEXT_FACTORY else "data.kwargs.seq_len"
    return None


def position_limit(model: nn.Module) -> tuple[str, int] | None:
    """The model's learned position table (its name and how many positions it covers), if it has one."""
    table = next(
        (
            (n, m)
            for n, m in model.named_modules()
            if isinstance(m, nn.Embedding) and POSITION_TABLE.search(n)
        ),
        None,
    )
    config = getattr(model, "config", None)
    if table is None or getattr(config, "position_embedding_type", "absolute") != "absolute":
        return None  # relative position types keep the table but do not index it by position
    limit, where = table[1].num_embeddings, f"{table[0]}.num_embeddings"
    for attr in ("n_positions", "max_position_embeddings"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and 0 < value < limit:
            limit, where = value, f"config.{attr}"  # e.g. OPT's table has two more rows than positions
    return where, limit


def check_positions(model: nn.Module, inputs: Any, job: Any, what: str) -> None:
    """The first batch's ``input_ids`` are no longer than the model's learned position table."""
    ids = inputs.get("input_ids") if isinstance(inputs, Mapping) else inputs
    if not isinstance(ids, torch.Tensor) or ids.dim() < 2 or ids.is_floating_point():
        return
    limit = position_limit(model)
    if limit is None or ids.shape[-1] <= limit[1]:
        return
    where, positions = limit
    length = ids.shape[-1]
    key = _seq_key(job)
    said = f"{key}={length}" if key is not None else f"the first {what} batch's input_ids length {length}"
    set_key = key or "the data's sequence length"
    raise PreflightError(
        f"{said} is longer than the {positions} positions the model {type(model).__name__} can embed "
        f"({where}, a learned position table): set {set_key} to at most {positions}, or build the model "
        f"with {length} positions or more"
    )


def check_labels_counted(labels: Any, what: str) -> None:
    """Not every label of the first batch is ignored (its loss would be 0/0: NaN)."""
    if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or labels.numel() == 0:
        return
    if bool((labels == IGNORE_INDEX).all()):
        raise PreflightError(
            f"every label of the first {what} batch is {IGNORE_INDEX} (the ignore index), so its loss "
            "averages over no token (NaN): check the data's label masking (a prompt longer than the "
            "sequence length masks every target), or use longer sequences"
        )
