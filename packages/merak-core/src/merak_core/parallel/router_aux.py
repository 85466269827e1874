"""The router auxiliary load-balancing loss of transformers' MoE models, over the global batch under DP.

[Note: global router aux loss] ``MixtralForCausalLM`` and ``Qwen3MoeForCausalLM`` with
``output_router_logits=True`` add ``router_aux_loss_coef * aux`` to their loss, where transformers'
``load_balancing_loss_func`` takes the router logits of every layer over the ``R`` rows (layers x
tokens) of the batch the model sees: ``f_e`` = the number of top-k choices of expert ``e`` / ``R``,
``P_e`` = the sum of its softmax probabilities / ``R``, ``aux = E * sum_e f_e * P_e``. That is a
product of two batch means, not a mean over tokens: under DP the mean of the ranks' own aux losses
is not the aux loss of the global batch.

The one-process run matched: the model on the global batch (with gradient accumulation, on the
global microbatch: microbatch ``m`` of every DP rank together), loss = the ``loss_fn`` (the
cross-entropy by default) + ``router_aux_loss_coef * aux``, unpadded batches (``attention_mask``
refused: transformers then drops the padded rows, which the loss does not see).

:class:`GlobalRouterAuxLoss` adds ``coef * A_r`` to rank ``r``'s loss with
``A_r = dp * E * sum_e (C_e / R) * (S_e^r / R)``: the choice counts ``C_e`` and the rows ``R``
all-reduced over the DP group (no gradient: in transformers the counts come from top-k indices and
carry none either), ``S_e^r`` this rank's probability sums (with their gradient). The Trainer's loss
is the DP mean of the ranks' losses and the DP sync averages the gradients, so the mean of ``A_r``,
``E * sum_e (C_e / R) * (sum_r S_e^r / R)``, is the global ``aux`` and its averaged gradient is
``aux``'s gradient. A rank's own ``A_r`` is not an aux loss by itself: only the mean is.

Refused (:func:`check_router_aux`): pipeline stages (the router logits of the first stage's layers
never reach the last stage's loss) and ``cp > 1`` (each rank holds part of every sequence).

[Note: a protocol block's router aux loss] A block of [Note: the MoE block protocol] (in
:mod:`merak_core.parallel.expert_parallel`) with a non-zero ``router_aux_loss_coef`` sets, in each forward,
``router_stats = (probs_ne, experts_nk)``: its router's probabilities over the ``E`` experts of each of its
``n`` tokens (with their gradient) and the ``k`` experts each token chose. Its loss is Switch/Mixtral's per
block, ``coef * E * sum_e f_e * P_e``, ``f_e`` = the tokens that chose ``e`` / ``n``, ``P_e`` = the sum of
``probs_ne[:, e]`` / ``n``, over the tokens of the microbatch; the model's loss is the ``loss_fn``'s plus
every such block's. The one-process run matched is the same as above: the global microbatch (microbatch
``m`` of every DP rank together), every token the block routes counted (padding too: the block sees it).
:class:`BlockRouterAuxLoss` adds ``coef * A_r`` per block, ``A_r = dp * E * sum_e (C_e / N) * (S_e^r / N)``,
with the choice counts ``C_e`` and the tokens ``N`` of all blocks all-reduced over the DP group in one call
(no gradient: the choices are top-k indices) and ``S_e^r`` this rank's probability sums, so the DP mean
of the losses and of the gradients is the global microbatch's at any ep (the router is replicated over
the EP group, whose ranks are DP ranks). Refused (:func:`check_router_aux`): ``pp > 1`` and ``cp > 1``
as above, and recomputation (the recomputed units' graph is dropped after the forward; ``router_stats``
lives outside it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from merak_core.parallel.moe_blocks import moe_blocks

__all__ = [
    "FAMILIES",
    "BlockRouterAuxLoss",
    "GlobalRouterAuxLoss",
    "aux_loss_blocks",
    "check_router_aux",
    "router_aux_settings",
    "with_router_aux_loss",
]


FAMILIES = ("mixtral", "qwen3_moe")
"""The model types whose ``load_balancing_loss_func`` :func:`global_load_balancing_loss` reproduces."""


def router_aux_settings(model: nn.Module | None) -> tuple[float, int, int] | None:
    """(coef, experts, top-k) of a transformers model of :data:`FAMILIES` that adds a router aux loss; None
    for any other (another family's aux loss is not added: the loss is the ``loss_fn``'s alone)."""
    config = getattr(model, "config", None)
    coef = getattr(model, "router_aux_loss_coef", 0.0)
    if getattr(config, "model_type", None) not in FAMILIES:
        return None
    if not getattr(config, "output_router_logits", False) or not coef:
        return None
    experts, top_k = getattr(model, "num_experts", None), getattr(model, "num_experts_per_tok", None)
    if not isinstance(experts, int) or not isinstance(top_k, int):
        return None
    return float(coef), experts, top_k


def aux_loss_blocks(model: nn.Module | None) -> list[tuple[str, Any]]:
    """The protocol MoE blocks of ``model`` with a non-zero ``router_aux_loss_coef`` (name, block), in module
    order ([Note: a protocol block's router aux loss])."""
    if model is None:
        return []
    return [(name, b) for name, b in moe_blocks(model) if getattr(b, "router_aux_loss_coef", 0)]


def check_block_router_aux(model: nn.Module | None, pp: int, cp: int, recompute: str = "none") -> None:
    """ValueError when a protocol block's router aux loss cannot be the global microbatch's (pure)."""
    blocks = aux_loss_blocks(model)
    if not blocks:
        return
    name, block = blocks[0]
    refusals = (
        (pp > 1, f"pp={pp}", "the blocks of earlier stages never reach the last stage's loss", "pp: 1"),
        (cp > 1, f"cp={cp}", "each rank holds part of every sequence", "cp: 1"),
        (
            recompute != "none",
            f"recompute={recompute!r}",
            "the recomputed units' graph, which its router_stats need, is dropped after the forward",
            "recompute: none",
        ),
    )
    for refused, what, why, fix in refusals:
        if refused:
            raise ValueError(
                f"{name!r} ({type(block).__name__}) adds a router auxiliary loss (router_aux_loss_coef="
                f"{block.router_aux_loss_coef}), which Merak computes over the global microbatch; with {what} it "
                f"cannot ({why}): set {fix}, or its router_aux_loss_coef to 0"
            )


def check_router_aux(model: nn.Module | None, pp: int, cp: int, recompute: str = "none") -> None:
    """ValueError when ``model``'s router aux loss (a transformers family's, or a protocol block's) cannot be
    the global batch's at ``pp``, ``cp`` and ``recompute`` (pure)."""
    check_block_router_aux(model, pp, cp, recompute)
    settings = router_aux_settings(model)
    if settings is None:
        return
    refusals = (
        (pp > 1, f"pp={pp}", "the router logits of earlier stages' layers do not reach the loss", "pp: 1"),
        (cp > 1, f"cp={cp}", "each rank holds part of every sequence", "cp: 1"),
    )
    for refused, what, why, fix in refusals:
        if refused:
            raise ValueError(
                f"{type(model).__name__} adds a router auxiliary loss (output_router_logits=True, "
                f"router_aux_loss_coef={settings[0]}), which Merak computes over the global batch; with {what} "
                f"it cannot ({why}): set {fix}, or output_router_logits: false"
            )


def _balance_losses(
    parts: list[tuple[torch.Tensor, int, torch.Tensor]], group: ProcessGroup | None
) -> list[torch.Tensor]:
    """``world * E * sum_e (C_e / N) * (S_e / N)`` for each ``(C_e, n, S_e)``: this rank's choice counts, rows
    and router probability sums (with their gradient). The counts and rows of every part are summed over
    ``group`` in one all-reduce (no gradient); ``S_e`` stays this rank's, so the mean over the group of the
    result and of its gradients is the one-process load-balancing loss of the group's rows together."""
    reduced = torch.cat(
        [torch.cat([c.to(torch.float64), c.new_tensor([n], dtype=torch.float64)]) for c, n, _ in parts]
    )
    world = 1
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(reduced, group=group)
        world = dist.get_world_size(group)
    losses, start = [], 0
    for counts_e, _, sums_e in parts:
        e = counts_e.numel()
        total_e, rows = reduced[start : start + e], reduced[start + e]
        start += e + 1
        fraction_e = (total_e / rows).to(sums_e.dtype)
        losses.append(world * e * torch.sum(fraction_e * sums_e / rows.to(sums_e.dtype)))
    return losses


def global_load_balancing_loss(
    router_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int, group: ProcessGroup | None
) -> torch.Tensor:
    """This rank's ``A_r`` of [Note: global router aux loss] (collective over ``group``)."""
    probs = [F.softmax(layer, dim=-1) for layer in router_logits]
    counts_e = torch.zeros(num_experts, dtype=torch.float64, device=probs[0].device)
    sums_e = torch.zeros(num_experts, dtype=torch.float32, device=probs[0].device)
    rows = 0
    for p_ne in probs:
        chosen = torch.topk(p_ne.detach(), top_k, dim=-1).indices.reshape(-1)
        counts_e += torch.bincount(chosen, minlength=num_experts).to(counts_e.dtype)
        sums_e = sums_e + p_ne.float().sum(0)
        rows += p_ne.size(0)
    return _balance_losses([(counts_e, rows, sums_e)], group)[0]


class GlobalRouterAuxLoss:
    """``loss_fn(output, labels) + coef * A_r`` (see [Note: global router aux loss])."""

    def __init__(
        self, loss_fn: Callable[[Any, Any], torch.Tensor], settings: tuple[float, int, int], group: Any
    ) -> None:
        self.loss_fn, self.group = loss_fn, group
        self.coef, self.num_experts, self.top_k = settings

    def __call__(self, output: Any, labels: Any) -> torch.Tensor:
        loss = self.loss_fn(output, labels)
        logits = output.get("router_logits") if isinstance(output, Mapping) else None
        if not logits:
            raise ValueError(
                "the model adds a router auxiliary loss (output_router_logits=True) but its output has no "
                "router_logits: return them, or set output_router_logits: false"
            )
        aux = global_load_balancing_loss(tuple(logits), self.num_experts, self.top_k, self.group)
        return loss + self.coef * aux.to(loss.dtype)


def block_load_balancing_losses(
    stats: list[tuple[torch.Tensor, torch.Tensor]], num_experts: list[int], group: ProcessGroup | None
) -> list[torch.Tensor]:
    """This rank's ``A_r`` of each block ([Note: a protocol block's router aux loss]; one all-reduce over
    ``group`` of every block's choice counts and tokens)."""
    parts = [
        (torch.bincount(experts_nk.detach().reshape(-1), minlength=e), probs_ne.size(0), probs_ne.sum(0))
        for (probs_ne, experts_nk), e in zip(stats, num_experts, strict=True)
    ]
    return _balance_losses(parts, group)


class BlockRouterAuxLoss:
    """``loss_fn(output, labels) + sum over blocks of coef * A_r`` ([Note: a protocol block's router aux loss])."""

    def __init__(self, loss_fn: Callable[[Any, Any], torch.Tensor], blocks: list[Any], group: Any) -> None:
        self.loss_fn, self.blocks, self.group = loss_fn, blocks, group

    def __call__(self, output: Any, labels: Any) -> torch.Tensor:
        loss = self.loss_fn(output, labels)
        stats = []
        for block in self.blocks:
            recorded = getattr(block, "router_stats", None)
            if recorded is None:
                raise ValueError(
                    f"{type(block).__name__} declares router_aux_loss_coef={block.router_aux_loss_coef} but its "
                    "forward set no router_stats = (probs_ne, experts_nk): set them in each forward, or "
                    "router_aux_loss_coef to 0"
                )
            stats.append(recorded)
            block.router_stats = None  # consumed: a block that skips a forward is refused, not reused
        aux = block_load_balancing_losses(stats, [b.num_experts for b in self.blocks], self.group)
        coefs = [float(b.router_aux_loss_coef) for b in self.blocks]
        return loss + sum(c * a.to(loss.dtype) for c, a in zip(coefs, aux, strict=True))


def with_router_aux_loss(
    model: nn.Module | None, loss_fn: Callable[[Any, Any], torch.Tensor], group: Any, example_inputs: Any
) -> Callable[[Any, Any], torch.Tensor]:
    """``loss_fn``, plus the global router aux loss when ``model`` adds one (``group``: the DP group): a
    transformers family's, and its protocol blocks' ([Note: a protocol block's router aux loss])."""
    blocks = aux_loss_blocks(model)
    if blocks:
        loss_fn = BlockRouterAuxLoss(loss_fn, [b for _, b in blocks], group)
    settings = router_aux_settings(model)
    if settings is None:
        return loss_fn
    if isinstance(example_inputs, Mapping) and "attention_mask" in example_inputs:
        raise ValueError(
            f"{type(model).__name__} adds a router auxiliary loss (output_router_logits=True) and the batches "
            "carry an attention_mask: the loss over padded batches (transformers drops the padded rows from "
            "the aux loss) is not done; train on unpadded (packed) sequences, or set output_router_logits: false"
        )
    return GlobalRouterAuxLoss(loss_fn, settings, group)
