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
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

__all__ = [
    "FAMILIES",
    "GlobalRouterAuxLoss",
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


def check_router_aux(model: nn.Module | None, pp: int, cp: int) -> None:
    """ValueError when ``model``'s router aux loss cannot be the global batch's at ``pp``, ``cp`` (pure)."""
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
    totals = torch.cat([counts_e, counts_e.new_tensor([rows])])
    world = 1
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(totals, group=group)
        world = dist.get_world_size(group)
    total_rows = totals[-1]
    fraction_e = (totals[:-1] / total_rows).to(sums_e.dtype)
    return world * num_experts * torch.sum(fraction_e * sums_e / total_rows.to(sums_e.dtype))


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


def with_router_aux_loss(
    model: nn.Module | None, loss_fn: Callable[[Any, Any], torch.Tensor], group: Any, example_inputs: Any
) -> Callable[[Any, Any], torch.Tensor]:
    """``loss_fn``, plus the global router aux loss when ``model`` adds one (``group``: the DP group)."""
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
