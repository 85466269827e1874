"""Context parallelism (the cp axis) on the cluster model: the terms of :mod:`.context_cost` applied
to a meta-traced model's :class:`~merak_core.planner.cluster_cost.ModelCosts`.

[Note: cluster cp terms] At ``cp > 1`` a stage is priced as :func:`.cluster_cost.stage_costs` prices
one cp rank's tokens: every shard's forward seconds, FLOPs, produced and output bytes and the TP
all-reduce's bytes divided by cp (as :func:`.context_cost.cp_local_profile` divides a profile), each
shard's activations plus :func:`.context_cost.cp_attention_extra_bytes` per attention it holds, and
per attention and microbatch the cp group's exchanges of :func:`.context_cost.cp_layer_comm_s` (ring
passes overlapped with ``1 / cp`` of the shard's local forward; Ulysses' all-to-alls) over the cp
group's link: ranks ``0, tp, ..., (cp - 1) tp`` of the rank order ``((pp dp + d) cp + c) tp + t``
(within a node when ``cp * tp`` divides the devices per node, as TP). The attention's widths come
from the residual stream (``tp_message_bytes``, [Note: attention sizes from the profile]).
Gradients are summed over the dp x cp ranks of a stage (the layout's ``dp_cp_group``), and ZeRO-2/3
shard over them; ZeRO-1 shards the optimizer over dp only, so its optimizer states and step are
priced at dp. Pipeline messages and the DP group use the stride ``dp * cp * tp``.

Attentions are counted from the model (:func:`attach_attentions`): the outermost modules whose class
name ends in ``Attention``, each in the shard holding its first parameter. Not priced: cp with
expert parallelism (refused).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from torch import nn

from merak_core.planner import choices
from merak_core.planner.cluster import ClusterSpec
from merak_core.planner.cluster_cost import (
    STEP_OPS_PER_TENSOR,
    ModelCosts,
    StageCosts,
    stage_costs,
    state_bytes,
    step_overhead_s,
)
from merak_core.planner.comm import CommModel
from merak_core.planner.context_cost import (
    check_cp,
    cp_allowed,
    cp_attention_extra_bytes,
    cp_layer_comm_s,
    cp_local_profile,
)
from merak_core.planner.model_profile import ModelProfile

__all__ = ["attach_attentions", "cp_layouts", "cp_stage_costs", "cp_step_overhead_s", "local_costs"]

_KEY = "cp_attentions"


def attach_attentions(costs: ModelCosts, model: nn.Module) -> ModelCosts:
    """Record in ``costs`` how many attention modules each shard holds ([Note: cluster cp terms]); ``costs``."""
    owner = {name: i for i, ly in enumerate(costs.layers) for name in ly.param_names}
    counts = [0] * costs.num_layers
    seen: list[str] = []
    for name, module in model.named_modules():
        if not type(module).__name__.endswith("Attention") or any(name.startswith(p + ".") for p in seen):
            continue
        seen.append(name)
        first = next((f"{name}.{n}" for n, _ in module.named_parameters()), None)
        if first is not None and first in owner:
            counts[owner[first]] += 1
    costs._cache[_KEY] = tuple(counts)
    return costs


def _attentions(costs: ModelCosts) -> tuple[int, ...]:
    counts = costs._cache.get(_KEY)
    if counts is None or not any(counts):
        raise ValueError(
            "cp > 1 on the cluster model needs the model's attention layers: call "
            "merak_core.planner.cluster_context.attach_attentions(costs, model) (none found: an attention "
            "module's class name must end in 'Attention')"
        )
    return tuple(counts)


def _attention_view(costs: ModelCosts) -> ModelProfile:
    """A one-layer profile holding what the cp terms read: the residual stream's bytes and the heads."""
    return ModelProfile(
        layer_forward_s=[0.0],
        layer_backward_s=[0.0],
        layer_activation_bytes=[0.0],
        layer_param_bytes=[0.0],
        boundary_bytes=costs.tp_message_bytes,
        num_heads=costs.num_heads,
        num_kv_heads=costs.num_kv_heads,
    )


def local_costs(costs: ModelCosts, cp: int, cp_mode: str) -> ModelCosts:
    """One cp rank's :class:`ModelCosts` ([Note: cluster cp terms]); ``costs`` at cp=1."""
    check_cp(cp, cp_mode)
    if cp == 1:
        return costs
    counts = _attentions(costs)
    extra = cp_attention_extra_bytes(_attention_view(costs), cp, cp_mode)
    layers = tuple(
        dataclasses.replace(
            ly,
            forward_s=ly.forward_s / cp,
            flops=ly.flops / cp,
            activation_bytes=ly.activation_bytes / cp + n * extra,
            output_bytes=ly.output_bytes / cp,
        )
        for ly, n in zip(costs.layers, counts, strict=True)
    )
    out = dataclasses.replace(costs, layers=layers, tp_message_bytes=costs.tp_message_bytes / cp, _cache={})
    out._cache[_KEY] = counts
    return out


def cp_stage_costs(
    costs: ModelCosts,
    cluster: ClusterSpec,
    *,
    bounds: Sequence[int],
    dp: int,
    tp: int,
    cp: int,
    cp_mode: str,
    micro_batch_size: int,
    zero_stage: int = 0,
    tp_overlap: bool = False,
    tp_chunks: int = 2,
    num_ranks: int | None = None,
) -> StageCosts:
    """:func:`.cluster_cost.stage_costs` at ``cp`` ([Note: cluster cp terms]); the same at cp=1."""
    local = local_costs(costs, cp, cp_mode)
    st = stage_costs(
        local,
        cluster,
        bounds=bounds,
        dp=dp * cp,
        tp=tp,
        micro_batch_size=micro_batch_size,
        zero_stage=zero_stage,
        tp_overlap=tp_overlap,
        tp_chunks=tp_chunks,
        num_ranks=num_ranks,
    )
    if cp == 1:
        return st
    counts = _attentions(local)
    bandwidth, latency = cluster.link([c * tp for c in range(cp)])
    comm = CommModel(p2p_latency_s=latency, p2p_bandwidth=bandwidth)
    view = cp_local_profile(_attention_view(costs), cp, cp_mode)
    b = micro_batch_size
    fwd, bwd = list(st.forward_s), list(st.backward_s)
    for s in range(len(bounds) - 1):
        for i in range(bounds[s], bounds[s + 1]):
            if counts[i]:
                f, g = cp_layer_comm_s(
                    view,
                    comm,
                    cp=cp,
                    cp_mode=cp_mode,
                    micro_batch_size=b,
                    layer_forward_s=b * local.layers[i].forward_s / tp,
                    tp=tp,
                )
                fwd[s] += counts[i] * f
                bwd[s] += counts[i] * g
    static = st.static_bytes
    if zero_stage == 1:  # the optimizer is sharded over dp, not dp x cp
        trainable = st.trainable_per_device or st.params_per_device
        static = [
            state_bytes(n, costs.precision, zero_stage=1, dp=dp, trainable_numel=t)
            for n, t in zip(st.params_per_device, trainable, strict=True)
        ]
    return dataclasses.replace(st, forward_s=fwd, backward_s=bwd, static_bytes=static)


def _zero1_optimizer_s(
    costs: ModelCosts,
    cluster: ClusterSpec,
    stages: StageCosts,
    bounds: Sequence[int],
    placement: list[int],
    div: int,
) -> float:
    """The optimizer step's seconds of :func:`.cluster_cost.step_overhead_s` under ZeRO-1 over ``div`` ranks."""
    prec = costs.precision
    per_rank: dict[int, float] = {}
    tensors: dict[int, int] = {}
    for s, n in enumerate(stages.trainable_per_device or stages.params_per_device):
        per_rank[placement[s]] = per_rank.get(placement[s], 0.0) + n
        count = costs.stage_tensors(bounds[s], bounds[s + 1], trainable=True)
        tensors[placement[s]] = tensors.get(placement[s], 0) + count
    touched = max(per_rank.values()) / div * (2 * prec.optimizer_bytes + prec.grad_bytes + prec.weight_bytes)
    seconds = touched / (cluster.memory_bandwidth * cluster.memory_efficiency)
    return seconds + max(tensors.values()) / div * STEP_OPS_PER_TENSOR * cluster.op_overhead_s


def cp_step_overhead_s(
    costs: ModelCosts,
    cluster: ClusterSpec,
    stages: StageCosts,
    *,
    bounds: Sequence[int],
    dp: int,
    tp: int,
    cp: int,
    zero_stage: int,
    stage_to_rank: Sequence[int] | None = None,
) -> tuple[float, float]:
    """:func:`.cluster_cost.step_overhead_s` at ``cp``: the gradient sync over dp x cp ([Note: cluster cp terms])."""
    sync, rest = step_overhead_s(
        costs,
        cluster,
        stages,
        bounds=bounds,
        dp=dp * cp,
        tp=tp,
        zero_stage=zero_stage,
        stage_to_rank=stage_to_rank,
    )
    if zero_stage == 1 and cp > 1:
        placement = list(stage_to_rank) if stage_to_rank is not None else list(range(len(bounds) - 1))
        rest += _zero1_optimizer_s(costs, cluster, stages, bounds, placement, dp) - _zero1_optimizer_s(
            costs, cluster, stages, bounds, placement, dp * cp
        )
    return sync, rest


def cp_layouts(
    costs: ModelCosts,
    cluster: ClusterSpec,
    world: int,
    *,
    global_batch_size: int,
    cps: Sequence[int],
    cp_mode: str,
) -> list[tuple[int, int, int, int]]:
    """Every (dp, tp, pp, cp) for ``world`` ranks with cp in ``cps``: cp * tp divides the devices per node
    (both groups inside a node), tp and cp suit the heads (:func:`.context_cost.cp_allowed`)."""
    out: list[tuple[int, int, int, int]] = []
    view = _attention_view(costs)
    for cp in cps:
        if world % cp:
            continue

        def allowed(tp: int, cp: int = cp) -> bool:
            return (
                cluster.devices_per_node % (tp * cp) == 0
                and costs.tp_allowed(tp)
                and cp_allowed(view, cp, cp_mode, tp)
            )

        grid = choices.layouts(
            world // cp, num_layers=costs.num_layers, global_batch_size=global_batch_size, tp_allowed=allowed
        )
        out += [(dp, tp, pp, cp) for dp, tp, pp in grid]
    return out
