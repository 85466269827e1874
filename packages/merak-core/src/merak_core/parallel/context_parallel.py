"""Context parallel (the cp axis) in a run: checks, routing a model's attention, splitting batches, the loss.

At ``training.cp > 1`` each rank of a CP group (:attr:`ParallelLayout.cp_group`) holds ``seq_len / cp``
tokens of every sample. This module wires merak-tp's CP attention (:mod:`merak_tp.context`) into a run:

- :func:`check_cp_arguments` (with the arguments) and :func:`check_cp_model` (with the model, before any
  process group) refuse, by name and with the fix, every combination that is not exact yet;
- :func:`route_attention` makes a transformers model call Merak's attention through transformers'
  attention-function registry (``AttentionInterface.register("merak_cp", ...)``, the model's
  ``config._attn_implementation``), so its code is unchanged; a handwritten model uses the hook of
  :mod:`merak_tp.context` (``cp_attention``/``cp_positions``) and says so with a class attribute
  ``supports_context_parallel = True``;
- :class:`ContextParallelRun` splits each batch along the sequence (``ring``: the load-balanced chunk
  pair of ``2 * cp`` chunks; ``ulysses``: the contiguous block), gives transformers models the global
  ``position_ids`` of the local tokens (rotary embeddings need them), enters the CP context around a
  step, and makes the loss exact (see [Note: cp loss]).

[Note: cp loss] One process averages the token losses of a microbatch over its ``N`` counted tokens
(labels not -100). A CP rank holds ``n_r`` of them, ``sum_r n_r = N``: its loss is
``cp * sum_r(token losses) / N`` (``N`` all-reduced over the CP group), so that the mean over the CP
ranks is the one-process loss, and the gradients, averaged over DP x CP by the gradient sync
(``layout.grad_sync_group``: CP ranks are replicas for the parameters), are the one-process gradients.
The engine averages the reported loss over ``dp * cp`` ranks for the same reason.

[Note: cp evaluation] Evaluation splits each batch as training does and runs in the CP context; each
rank weighs the token-mean loss of its own tokens (the default loss, no CP scaling) by their count, and
the evaluation's sum over all ranks (merak_core.run.evaluation [Note: eval weighting]) adds the CP ranks'
disjoint tokens: ``eval_loss`` is the mean over every counted token of the set, as one process computes
it. Per-example ``compute_metrics`` read whole samples and are refused.

At pp > 1 the pipeline tracer keeps a transformers model's attention modules whole
(:func:`attention_leaf_classes`, added to the leaves by ``compose``), so their attention function runs
at run time in the CP context; a handwritten model is traced in a CP context with the hook functions
as leaf calls (:func:`hook_tracing`, :func:`hook_functions`, [Note: cp hook at pp > 1]). Stage
boundaries carry the local tokens.

Not done here (refused instead): padding masks or restarting position ids (packed documents), LoRA
dropout, ``compute_metrics``, a custom ``loss_fn``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from merak_tp.context import (
    CP_MODES,
    ContextParallel,
    active_context,
    context_parallel,
    cp_attention,
    cp_positions,
    shard_positions,
)

__all__ = [
    "ATTN_IMPLEMENTATION",
    "ContextParallelRun",
    "attention_leaf_classes",
    "check_cp_arguments",
    "check_cp_batch",
    "check_cp_model",
    "cp_run_for",
    "hook_functions",
    "hook_tracing",
    "route_attention",
    "split_batch",
]

ATTN_IMPLEMENTATION = "merak_cp"
"""The name of Merak's attention function in transformers' attention-function registry."""

_REFUSED_ARGS: tuple[tuple[str, Any, str], ...] = ()
"""(argument, refused at cp > 1, the fix): none left (``layout: auto`` keeps or replaces the job's cp, searching
the degrees the model and its batch allow: :func:`merak_core.autoplan.givens.model_cp_degrees`)."""


def check_cp_arguments(args: Any) -> None:
    """``cp`` and ``cp_mode`` of a ``TrainingArguments``; ValueError for a combination not made exact at cp > 1."""
    cp = args.cp
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp={cp!r} is invalid: expected an integer >= 1 (1: no context parallelism)")
    if args.cp_mode not in CP_MODES:
        raise ValueError(f"cp_mode={args.cp_mode!r} is invalid: expected one of {CP_MODES}")
    if cp == 1:
        return
    for name, refused, fix in _REFUSED_ARGS:
        if refused(args):
            raise ValueError(
                f"cp={cp} with {name}={getattr(args, name)!r} is not supported (context parallelism is exact "
                f"only without it): set {fix}, or cp=1"
            )


def _head_counts(model: nn.Module) -> tuple[int | None, int | None]:
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "num_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or getattr(config, "num_kv_heads", None) or heads
    return heads, kv


def is_transformers_model(model: nn.Module) -> bool:
    """Whether ``model`` routes attention through transformers' attention-function registry."""
    config = getattr(model, "config", None)
    return (
        config is not None
        and hasattr(config, "_attn_implementation")
        and hasattr(model, "set_attn_implementation")
    )


def check_cp_model(
    model: nn.Module,
    args: Any,
    *,
    lora: Any = None,
    loss_fn_given: bool = False,
    compute_metrics_given: bool = False,
) -> None:
    """ValueError, before any process group, for a model or run that cp > 1 cannot make exact."""
    cp = args.cp
    if cp == 1:
        return
    if not is_transformers_model(model) and not getattr(model, "supports_context_parallel", False):
        raise ValueError(
            f"cp={cp}: {type(model).__name__} is neither a transformers model (whose attention Merak routes "
            "through transformers' attention-function registry) nor a model that calls merak_tp.cp_attention "
            "and merak_tp.cp_positions (set supports_context_parallel = True on its class once it does): use "
            "that hook in its attention and positions, or cp=1"
        )
    if lora is not None and lora.dropout > 0:
        raise ValueError(
            f"cp={cp} with model.lora.dropout={lora.dropout}: each cp rank would draw the adapters' dropout "
            "masks for its own tokens, not the masks one process draws for the whole sequence: set "
            "model.lora.dropout: 0.0, or cp=1"
        )
    if loss_fn_given:
        raise ValueError(
            f"cp={cp} with a custom loss_fn: the loss must be averaged over the tokens of every CP rank "
            "(merak_core.parallel.context_parallel [Note: cp loss]); only the default token cross-entropy does that: "
            "drop loss_fn, or cp=1"
        )
    if compute_metrics_given:
        raise ValueError(
            f"cp={cp} with compute_metrics: a cp rank holds the logits of its own tokens only, not the "
            "whole samples a per-example metric reads: drop compute_metrics (eval_loss is exact at cp > 1), "
            "or evaluate at cp=1"
        )
    heads, kv = _head_counts(model)
    if args.cp_mode == "ulysses" and heads is not None and kv is not None:
        per_rank = (heads // args.tp, kv // args.tp)
        if per_rank[0] % cp or per_rank[1] % cp:
            raise ValueError(
                f"cp_mode='ulysses' with cp={cp}: the model has {per_rank[0]} query and {per_rank[1]} key/value "
                f"heads per TP rank (tp={args.tp}) and cp must divide both: use cp_mode='ring', or a cp "
                "dividing them"
            )


# ---------------------------------------------------------------------------- transformers


def _hf_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: CP attention in a CP context, transformers' SDPA outside."""
    cp = active_context()
    if cp is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(  # type: ignore[no-any-return]
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if attention_mask is not None:
        raise ValueError(
            "context parallel attention got an attention mask: padding masks are not supported at cp > 1; "
            "train on unpadded (packed to length) sequences, or cp=1"
        )
    if dropout and module.training:
        raise ValueError(f"context parallel attention with attention dropout {dropout}: set it to 0, or cp=1")
    for name in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise ValueError(f"context parallel attention does not support {name}={kwargs[name]!r}: use cp=1")
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else bool(causal)
    out = cp.attention(query, key, value, causal=causal, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def attention_leaf_classes(model: nn.Module) -> tuple[type, ...]:
    """The attention module classes of a transformers model, kept whole by the pipeline tracer at cp > 1:
    their attention function then runs at run time, in the CP context, instead of being traced."""
    found: list[type] = []
    for module in model.modules():
        is_attention = all(hasattr(module, a) for a in ("is_causal", "layer_idx", "config"))
        if is_attention and type(module) not in found:
            found.append(type(module))
    return tuple(found)


# ---------------------------------------------------------------------------- a handwritten model at pp > 1


def hook_functions(model: nn.Module) -> tuple[Callable[..., Any], ...]:
    """The hook functions the pipeline tracer keeps as leaf calls of a handwritten model at cp > 1
    ([Note: cp hook at pp > 1]); none for a transformers model (its attention modules are leaves)."""
    return () if is_transformers_model(model) else (cp_attention, cp_positions)


class _TracingContext(ContextParallel):
    """The context a handwritten model is traced in: its CP branches are taken, and its attention, run
    once by the cost annotation on the local tokens, is this rank's local attention (shapes and costs
    only; no collective)."""

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float | None
    ) -> torch.Tensor:
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def hook_tracing(
    model: nn.Module, group: dist.ProcessGroup | None
) -> contextlib.AbstractContextManager[None]:
    """The context to trace and partition ``model`` in at cp > 1 (``group``: the cp group): for a
    handwritten model a CP context, so that its code takes the path it takes in a step
    ([Note: cp hook at pp > 1]); nothing for a transformers model."""
    if is_transformers_model(model):
        return contextlib.nullcontext()
    if group is None:
        raise ValueError("the layout has no cp group: build it with ParallelLayout.build(..., cp=...)")
    return context_parallel(_TracingContext(group))


# [Note: cp hook at pp > 1] A handwritten model calls merak_tp's hook (``cp_attention``, ``cp_positions``)
# when ``active_context()`` is set. At pp > 1 the model is traced once, at composition, and each stage
# runs the traced graph: the hook must be in the graph as calls that run in the step's CP context, not
# as values computed while tracing. So the pipeline tracer traces the model inside a CP context (its
# CP branches are the ones recorded; :func:`hook_tracing`) and keeps the hook functions as leaf calls
# (:func:`hook_functions`, merak_graph's ``leaf_functions``): at run time each stage computes the
# global positions of its local tokens and its attention over the cp group in the context the engine
# enters around a step. Stage boundaries carry the local tokens (and values such as the rotary tables
# of the local positions). Outside a CP context the stages' ``cp_attention`` refuses to run.


def route_attention(model: nn.Module) -> None:
    """Make a transformers model's attention Merak's (registry name :data:`ATTN_IMPLEMENTATION`)."""
    if not is_transformers_model(model):
        return
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, _hf_attention)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)  # type: ignore[operator]


# ---------------------------------------------------------------------------- a run


def _accepts(model: nn.Module, name: str) -> bool:
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


class ContextParallelRun:
    """What a run at cp > 1 does around each step (see the module docstring)."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup, mode: str) -> None:
        self.context = ContextParallel(group, mode)
        self.position_ids = is_transformers_model(model) and _accepts(model, "position_ids")

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The CP context the attention consults (merak_tp.context [Note: attention hook])."""
        with context_parallel(self.context):
            yield

    def split(self, inputs: Any, labels: Any, *, read_here: bool = False) -> tuple[Any, Any]:
        """This rank's tokens of a batch read whole by every CP rank (refusals are the same on every rank).

        ``read_here``: the batch holds this rank's tokens already (it comes from a :meth:`read_here` view):
        only the global ``position_ids`` are added (transformers models).
        """
        if read_here:
            return _with_positions(inputs, self.context, self.position_ids), labels
        return split_batch(inputs, labels, self.context.positions, position_ids=self.position_ids)

    def split_batches(self, batches: Iterable[Any], *, read_here: bool = False) -> Iterator[Any]:
        """The batches of an evaluation loader (``StageBatch``), each with this rank's tokens
        ([Note: cp evaluation])."""
        for batch in batches:
            inputs, labels = self.split(batch.inputs, batch.labels, read_here=read_here)
            yield dataclasses.replace(batch, inputs=inputs, labels=labels)

    def read_here(self, dataset: Any) -> Any:
        """``dataset`` as a view whose items hold this rank's tokens only, when it can make one (a
        ``reading_positions(positions)`` method: the text data's, [Note: cp reads] in
        ``merak_core.data.text.samples``); else ``dataset`` (its batches are read whole and split)."""
        view = getattr(dataset, "reading_positions", None)
        return dataset if view is None else view(self.context.positions)

    @staticmethod
    def reads_here(dataset: Any) -> bool:
        """Whether ``dataset`` is a :meth:`read_here` view (its batches are split already)."""
        return getattr(dataset, "cp_positions", None) is not None

    def loss(self, output: Any, labels: torch.Tensor) -> torch.Tensor:
        """The token cross-entropy of the local tokens, scaled as [Note: cp loss] says."""
        logits = output["logits"] if isinstance(output, Mapping) and "logits" in output else output
        logits = getattr(logits, "logits", logits)
        if isinstance(logits, (tuple, list)):
            logits = logits[0]
        flat = logits.reshape(-1, logits.size(-1))
        if flat.dtype in (torch.float16, torch.bfloat16):
            flat = flat.float()
        flat_labels = labels.reshape(-1)
        total = F.cross_entropy(flat, flat_labels, ignore_index=-100, reduction="sum")
        count = (flat_labels != -100).sum().to(total.dtype)
        if count.device.type != "meta":  # the pipeline's loss check tries the loss on meta tensors
            dist.all_reduce(count, group=self.context.group)
        return total * self.context.size / count


def split_batch(
    inputs: Any, labels: Any, positions: Callable[[int], torch.Tensor], *, position_ids: bool
) -> tuple[Any, Any]:
    """The tokens at ``positions(seq_len)`` of a batch (dim 1 of every tensor); ValueError for what cp > 1
    cannot split exactly (a padding mask, restarting position ids, a length not dividing into chunks).

    ``position_ids``: add the global positions as ``position_ids`` (transformers models).
    """
    seq_len = _seq_len(inputs if inputs is not None else labels)
    pos = positions(seq_len)
    out_inputs = None if inputs is None else _split_inputs(inputs, pos, seq_len, position_ids)
    out_labels = None if labels is None else _slice(labels, pos, seq_len, "labels")
    return out_inputs, out_labels


def _with_positions(inputs: Any, context: ContextParallel, position_ids: bool) -> Any:
    """A batch of this rank's tokens with the global ``position_ids`` added (``position_ids``: the model
    takes them); ValueError for inputs that are not tokens."""
    if inputs is None or not position_ids:
        return inputs
    tokens = inputs if isinstance(inputs, torch.Tensor) else inputs.get("input_ids")
    if not isinstance(tokens, torch.Tensor) or tokens.ndim != 2:
        raise ValueError(
            f"cp > 1 reads token batches (input_ids [batch, tokens]), got {type(inputs).__name__}"
        )
    pos = context.positions(tokens.shape[1] * context.size).to(tokens.device)
    out = {"input_ids": inputs} if isinstance(inputs, torch.Tensor) else dict(inputs)
    out["position_ids"] = pos.expand(tokens.shape[0], -1)
    return out


def _split_inputs(inputs: Any, pos: torch.Tensor, seq_len: int, position_ids: bool) -> Any:
    if isinstance(inputs, torch.Tensor):
        if not position_ids:
            return _slice(inputs, pos, seq_len, "inputs")
        inputs = {"input_ids": inputs}
    if not isinstance(inputs, Mapping):
        raise ValueError(f"cp > 1 splits tensor or dict batches along dim 1, got {type(inputs).__name__}")
    out: dict[str, Any] = {}
    for key, value in inputs.items():
        if key == "attention_mask":
            if value is not None and not bool(torch.all(value != 0)):
                raise ValueError(
                    "cp > 1 with a padding attention_mask (some entries 0) is not exact: train on "
                    "sequences without padding (pack them to data.seq_len), or cp=1"
                )
            continue  # all ones: causal attention needs no mask
        if key == "position_ids" and value is not None:
            whole = torch.arange(seq_len, device=value.device).expand_as(value)
            if not torch.equal(value, whole):
                raise ValueError(
                    "cp > 1 with position_ids that restart (packed documents) is not exact: drop "
                    "position_ids from the batch, or cp=1"
                )
            continue
        out[key] = _slice(value, pos, seq_len, key) if isinstance(value, torch.Tensor) else value
    if position_ids:
        first = next(v for v in out.values() if isinstance(v, torch.Tensor))
        out["position_ids"] = pos.to(first.device).expand(first.shape[0], -1)
    return out


def check_cp_batch(inputs: Any, labels: Any, cp: int, mode: str) -> None:
    """The split's refusals on a first batch, without a process group (the launch checks)."""
    split_batch(
        inputs, labels, lambda n: shard_positions(n, cp, 0, balanced=mode == "ring"), position_ids=False
    )


def cp_run_for(model: nn.Module, layout: Any, mode: str) -> ContextParallelRun:
    """Route ``model``'s attention (:func:`route_attention`) and build the run's :class:`ContextParallelRun`."""
    if layout.cp_group is None:
        raise ValueError("the layout has no cp group: build it with ParallelLayout.build(..., cp=...)")
    route_attention(model)
    return ContextParallelRun(model, layout.cp_group, mode)


def _seq_len(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        tensor = batch
    elif isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), torch.Tensor):
        tensor = batch["input_ids"]
    else:
        raise ValueError(
            f"cp > 1 needs token batches (a tensor or a dict with input_ids), got {type(batch).__name__}"
        )
    if tensor.ndim < 2:
        raise ValueError(f"cp > 1 splits dim 1 (the sequence), but the batch has shape {tuple(tensor.shape)}")
    return int(tensor.shape[1])


def _slice(value: torch.Tensor, pos: torch.Tensor, seq_len: int, name: str) -> torch.Tensor:
    if value.ndim < 2 or value.shape[1] != seq_len:
        raise ValueError(
            f"cp > 1 splits dim 1 of every batch tensor, but {name} has shape {tuple(value.shape)} and the "
            f"sequence has {seq_len} tokens"
        )
    return value.index_select(1, pos.to(value.device))
