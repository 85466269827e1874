"""Expert parallelism for transformers' fused experts modules (Mixtral, Qwen3-MoE, DeepSeek-V3).

:func:`apply_fused_expert_parallel` (called next to
:func:`merak_core.parallel.expert_parallel.apply_expert_parallel` at ep > 1) keeps, in every fused
experts module (:func:`merak_core.parallel.fused_experts.is_fused_experts`), this rank's rows
``[j * E / ep, (j + 1) * E / ep)`` of ``gate_up_proj`` and ``down_proj`` as new parameters carrying an
:class:`~merak_core.parallel.fused_experts.ExpertShard` ([Note: expert shard record]), and swaps the
module's class for a subclass whose ``forward(hidden_states, top_k_index, top_k_weights)`` sends the
tokens to their experts with :func:`merak_core.parallel.expert_parallel.dispatch`. The block around it
is untouched: the router (Mixtral's top-k softmax, Qwen3-MoE's optional ``norm_topk_prob``,
DeepSeek-V3's grouped sigmoid routing with its correction bias and scaling), the shared experts and
the reshapes are the model's own code. Each local expert computes what transformers' eager experts
forward computes for it: ``down_proj[e] @ apply_gate(gate_up_proj[e] @ x)`` (the gate and up halves
of ``gate_up_proj``, the module's ``act_fn``), weighted by the routing weight in ``dispatch``.

With ``training.moe_capacity_factor`` (:func:`set_fused_capacity`, [Note: expert capacity] in
:mod:`merak_core.parallel.moe_capacity`) the same dispatch drops beyond each expert's capacity, by the
protocol blocks' rule and order: the block hands its experts module its tokens flattened (batch, then
position), so the pairs are taken by token, then by choice, the EP ranks' tokens in EP-rank order. At
ep=1 the class is swapped too, every expert local (no group). The block's other parts (DeepSeek-V3's
shared experts) still see every token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from merak_core.parallel.expert_parallel import (
    DISPATCH_ATTR,
    ExpertDispatch,
    dispatch,
    ep_class,
    expert_dispatch,
)
from merak_core.parallel.fused_experts import ExpertShard, expert_shard, fused_experts, set_expert_shard
from merak_core.parallel.layout import ParallelLayout

__all__ = [
    "FusedExpertParallel",
    "WholeFusedExperts",
    "apply_fused_expert_parallel",
    "fused_expert_leaves",
    "full_expert_tensor",
    "set_fused_capacity",
    "tp_plan_without_experts",
]


class _LocalExperts:
    """The view :func:`dispatch` takes of this rank's experts: keys are global indices, values callables."""

    def __init__(self, module: Any, record: ExpertShard) -> None:
        self.module, self.record = module, record

    def keys(self) -> Iterator[str]:
        return (str(self.record.first + e) for e in range(self.record.num_local))

    def __getitem__(self, key: str) -> Callable[[torch.Tensor], torch.Tensor]:
        e = int(key) - self.record.first
        return lambda x_nh: self.module.run_local_expert(e, x_nh)


class FusedExpertParallel:
    """Mixin put in front of a fused experts class: its forward dispatches over the EP group."""

    gate_up_proj: nn.Parameter
    down_proj: nn.Parameter
    num_experts: int
    act_fn: Callable[[torch.Tensor], torch.Tensor]
    merak_expert_shard: ExpertShard
    """The parameters' record, kept on the module too: under ZeRO-2/3 FSDP2 registers unsharded copies of
    the parameters for the forward, which carry no record ([Note: ZeRO-2/3 with experts])."""

    def run_local_expert(self, e: int, x_nh: torch.Tensor) -> torch.Tensor:
        """Local expert ``e`` on its rows, as transformers' eager forward computes one expert."""
        gate_up = F.linear(x_nh, self.gate_up_proj[e])
        apply_gate = getattr(self, "_apply_gate", None)
        if apply_gate is not None:
            hidden = apply_gate(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = self.act_fn(gate) * up
        return F.linear(hidden, self.down_proj[e])

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        record = self.merak_expert_shard
        local: Any = _LocalExperts(self, record)
        capacity = expert_dispatch(self).capacity_factor  # type: ignore[arg-type]
        out = dispatch(
            hidden_states,
            top_k_weights,
            top_k_index,
            local,
            self.num_experts,
            record.group,
            capacity_factor=capacity,
        )
        return out.to(hidden_states.dtype)


class WholeFusedExperts:
    """Mixin put in front of a fused experts class at ep=1 under a pipeline: the module's own forward on
    real tensors (a trace leaf, its routing loop is data-dependent); on meta tensors (the tracer's eager
    pre-run and the partitioner's cost of a meta model) the work of the active experts, ``k`` of ``E`` per
    token, as one expert over the ``n * k`` rows, with the output's shape ([Note: active-expert cost])."""

    gate_up_proj: nn.Parameter
    down_proj: nn.Parameter
    act_fn: Callable[[torch.Tensor], torch.Tensor]

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        if not hidden_states.is_meta:
            return super().forward(hidden_states, top_k_index, top_k_weights)  # type: ignore[misc,no-any-return]
        rows = hidden_states.repeat_interleave(top_k_index.size(-1), 0)
        gate, up = F.linear(rows, self.gate_up_proj[0]).chunk(2, dim=-1)
        out = F.linear(self.act_fn(gate) * up, self.down_proj[0])
        return out.reshape(hidden_states.size(0), -1, out.size(-1)).sum(1).to(hidden_states.dtype)


def fused_expert_leaves(model: nn.Module) -> list[type]:
    """At ep=1 under a pipeline: every fused experts module's class gets :class:`WholeFusedExperts` in
    front (in place); their classes (trace leaves, each runs whole inside one stage)."""
    classes: list[type] = []
    for _name, module in fused_experts(model):
        module.__class__ = ep_class(WholeFusedExperts, type(module))
        classes.append(type(module))
    return list(dict.fromkeys(classes))


def set_fused_capacity(model: nn.Module, capacity_factor: float, *, ep: int) -> None:
    """Give every fused experts module the capacity of [Note: expert capacity] (in place, before composing).

    At ep > 1 :func:`apply_fused_expert_parallel` swaps the class later; at ep=1 the class is swapped here
    for the dispatching one with every expert local (a record of one EP rank, no group; the parameters stay
    plain, whole tensors). Checked by :func:`merak_core.parallel.expert_parallel.check_ep_model`.
    """
    for _name, module in fused_experts(model):
        setattr(
            module, DISPATCH_ATTR, ExpertDispatch(capacity_factor=capacity_factor)
        )  # its group: the shard's
        if ep == 1:
            module.__class__ = ep_class(FusedExpertParallel, type(module))
            module.merak_expert_shard = ExpertShard(module.num_experts, 1, 0)


def _ep_mesh(layout: ParallelLayout) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    assert layout.ep_group is not None
    return DeviceMesh.from_group(layout.ep_group, layout.mesh.device_type, mesh_dim_names=("ep",))


def apply_fused_expert_parallel(model: nn.Module, layout: ParallelLayout) -> list[type]:
    """Keep this rank's experts in every fused experts module (in place); their new classes (trace leaves).

    The modules were checked by :func:`merak_core.parallel.fused_experts.check_fused_experts`.
    """
    found = fused_experts(model)
    if not found or layout.ep == 1:
        return []
    mesh = _ep_mesh(layout)
    classes: list[type] = []
    for _name, module in found:
        record = ExpertShard(module.num_experts, layout.ep, layout.ep_rank, layout.ep_group, mesh)
        for attr in ("gate_up_proj", "down_proj"):
            full = getattr(module, attr)
            local = nn.Parameter(record.slice(full.detach()).clone(), requires_grad=full.requires_grad)
            setattr(module, attr, set_expert_shard(local, record))
        module.__class__ = ep_class(FusedExpertParallel, type(module))
        module.merak_expert_shard = record
        classes.append(type(module))
    return classes


def tp_plan_without_experts(model: nn.Module, plan: Any) -> Any:
    """``plan`` (None: the model's built-in one) without its ``experts`` entries, for ep > 1 with tp > 1.

    The fused experts stay whole on each EP rank (sharded over EP, not TP), like the protocol blocks:
    attention, embeddings and head are still TP-sharded by the plan; the router stays replicated.
    Unchanged (``plan`` itself) for a model without fused experts or a plan without such entries.
    """
    import dataclasses

    import merak_tp

    if not fused_experts(model):
        return plan
    resolved = merak_tp.plan_for_model(model) if plan is None else plan
    if isinstance(resolved, str):
        resolved = merak_tp.get_plan(resolved)
    dropped = {pattern for pattern, style in resolved.layers.items() if style == "experts"}
    if not dropped:
        return plan
    return dataclasses.replace(
        resolved,
        layers={k: v for k, v in resolved.layers.items() if k not in dropped},
        attributes={k: v for k, v in resolved.attributes.items() if k not in dropped},
    )


def full_expert_tensor(param: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (``param``'s local value) gathered over its EP group when ``param`` is an expert shard.

    Collective over the EP group for a shard (every member calls it, in the same order); ``tensor``
    itself otherwise.
    """
    record = expert_shard(param)
    if record is None:
        return tensor
    import torch.distributed as dist

    pieces = [torch.empty_like(tensor) for _ in range(record.ep)]
    dist.all_gather(pieces, tensor.contiguous(), group=record.group)
    return torch.cat(pieces, 0)
