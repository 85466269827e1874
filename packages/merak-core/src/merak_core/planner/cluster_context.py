"""Context parallelism (the cp axis) on the cluster model: the terms of :mod:`.context_cost` applied
to a meta-traced model's :class:`~merak_core.planner.cluster_cost.ModelCosts`.

[Note: cluster cp terms] At ``cp > 1`` a stage is priced as :func:`.cluster_cost.stage_costs` prices
one cp rank's tokens: every shard's forward seconds, FLOPs, produced and output bytes and the TP
all-reduce's bytes divided by cp (as :func:`.context_cost.cp_local_profile` divides a profile), each
shard's activations plus :func:`.context_cost.cp_attention_extra_bytes` per attention it holds, and
per attention and microbatch the cp group's exchanges of :func:`.context_cost.cp_layer_comm_s` (ring
passes overlapped with ``1 / cp`` of the shard's local forward, in the backward with ``1 / cp`` of its
backward, twice the forward; Ulysses' all-to-alls) over the cp
group's link: ranks ``0, tp, ..., (cp - 1) tp`` of the rank order ``((pp dp + d) cp + c) tp + t``
(within a node when ``cp * tp`` divides the devices per node, as TP). The attention's widths come
from the residual stream (``tp_message_bytes``, [Note: attention sizes from the profile]).
Gradients are summed over the dp x cp ranks of a stage (the layout's ``dp_cp_group``), and ZeRO-2/3
shard over them; ZeRO-1 shards the optimizer over dp only, so its optimizer states and step are
priced at dp. Pipeline messages and the DP group use the stride ``dp * cp * tp``.

The ring computes in float32 or wider (:mod:`merak_tp.context`): a 16-bit model's key/value blocks
(and, in the backward, their gradients) travel in float32, twice the model's bytes, and every ring
attention keeps its per-row log-sum-exp in float32 (``local tokens x heads``, priced from the head dim
the attention module says) on top of context_cost's extra bytes (:func:`ring_wire_factor`).

Attentions are counted from the model (:func:`attach_attentions`): the outermost modules whose class
name ends in ``Attention``, each in the shard holding its first parameter. Not priced: cp with
expert parallelism (the run refuses it; the search never pairs them, :func:`.expert_pricing.price_expert_parallel`
refuses).

[Note: cluster cp search] ``merak plan --cluster`` searches cp for every job: a job at cp=1 whose
sequence is long may need the sequence split to fit a device at all. It tries the cp degrees ``layout:
auto`` may choose (:func:`merak_core.autoplan.givens.model_cp_degrees`: the run's own refusals, the
sequence in ``2 cp`` chunks) that divide the devices per node, each cp > 1 in both modes (ring; Ulysses
where cp divides the heads per TP rank) unless the job names its cp and mode, and never with ep > 1 (the
run refuses the pair). A short sequence gains nothing from cp (the same tokens per device, the cp
exchanges on top), so cp = 1 ranks first there; a sequence too long for any TP x PP layout ranks a cp
layout first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from torch import nn

from merak_core.planner import choices
from merak_core.planner.cluster import ClusterSpec
from merak_core.planner.cluster_cost import ModelCosts, StageCosts, stage_costs, state_bytes
from merak_core.planner.cluster_overhead import STEP_OPS_PER_TENSOR, busiest_rank, step_overhead_s
from merak_core.planner.comm import CommModel
from merak_core.planner.context_cost import (
    check_cp,
    cp_allowed,
    cp_attention_extra_bytes,
    cp_layer_comm_s,
    cp_local_profile,
)
from merak_core.planner.model_profile import ModelProfile

__all__ = [
    "attach_attentions",
    "attention_view",
    "cp_layouts",
    "cp_stage_costs",
    "cp_step_overhead_s",
    "local_costs",
    "ring_wire_factor",
]

_KEY = "cp_attentions"
_HEAD_DIM = "cp_head_dim"


def attach_attentions(costs: ModelCosts, model: nn.Module) -> ModelCosts:
    """Record in ``costs`` how many attention modules each shard holds and their head dim (``head_dim``, for
    the ring's log-sum-exp) ([Note: cluster cp terms]); ``costs``."""
    owner = {name: i for i, ly in enumerate(costs.layers) for name in ly.param_names}
    counts = [0] * costs.num_layers
    seen: list[str] = []
    head_dims: list[int] = []
    for name, module in model.named_modules():
        if not type(module).__name__.endswith("Attention") or any(name.startswith(p + ".") for p in seen):
            continue
        seen.append(name)
        if isinstance(getattr(module, "head_dim", None), int):
            head_dims.append(module.head_dim)
        first = next((f"{name}.{n}" for n, _ in module.named_parameters()), None)
        if first is not None and first in owner:
            counts[owner[first]] += 1
    costs._cache[_KEY] = tuple(counts)
    costs._cache[_HEAD_DIM] = min(head_dims, default=None)
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


def attention_view(costs: ModelCosts) -> ModelProfile:
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


def ring_wire_factor(costs: ModelCosts) -> float:
    """Bytes the ring moves (and its log-sum-exp keeps) per byte of the model's activations: it computes in
    float32 or wider (:mod:`merak_tp.context`), so a 16-bit model's key/value blocks travel in float32 (2);
    1 for a float32 or float64 model. The activation width is read from the weights' (``Precision``)."""
    return max(1.0, 4.0 / costs.precision.weight_bytes)


def _extra_bytes(costs: ModelCosts, cp: int, cp_mode: str) -> float:
    """What one attention keeps per sample beyond ``1 / cp`` of the trace's activations: context_cost's
    :func:`.context_cost.cp_attention_extra_bytes`, plus for the ring its per-row log-sum-exp in float32 or
    wider (``tokens / cp x heads``: the local boundary / head dim, times :func:`ring_wire_factor`), which the
    trace of a one-process attention does not produce."""
    extra = cp_attention_extra_bytes(attention_view(costs), cp, cp_mode)
    head_dim = costs._cache.get(_HEAD_DIM)
    if cp_mode == "ring" and isinstance(head_dim, int):
        extra += costs.tp_message_bytes / cp / head_dim * ring_wire_factor(costs)
    return extra


def local_costs(costs: ModelCosts, cp: int, cp_mode: str) -> ModelCosts:
    """One cp rank's :class:`ModelCosts` ([Note: cluster cp terms]); ``costs`` at cp=1."""
    check_cp(cp, cp_mode)
    if cp == 1:
        return costs
    counts = _attentions(costs)
    extra = _extra_bytes(costs, cp, cp_mode)
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
    out._cache.update({k: costs._cache.get(k) for k in (_KEY, _HEAD_DIM)})
    return out


def cp_stage_costs(
    costs: ModelCosts, cluster: ClusterSpec, *, cp: int, cp_mode: str, **stage: Any
) -> StageCosts:
    """:func:`.cluster_cost.stage_costs` (``stage``: its keywords, ``bounds``, ``dp``, ``tp``,
    ``micro_batch_size``, ...) at ``cp`` ([Note: cluster cp terms]); the same at cp=1."""
    local = local_costs(costs, cp, cp_mode)
    st = stage_costs(local, cluster, **{**stage, "dp": stage["dp"] * cp})
    if cp == 1:
        return st
    bounds, tp, b = stage["bounds"], stage["tp"], stage["micro_batch_size"]
    counts = _attentions(local)
    bandwidth, latency = cluster.link([c * tp for c in range(cp)])
    comm = CommModel(p2p_latency_s=latency, p2p_bandwidth=bandwidth)
    view = cp_local_profile(attention_view(costs), cp, cp_mode)
    if cp_mode == "ring":  # its blocks travel in float32 or wider: the bytes the ring sends
        view = dataclasses.replace(view, boundary_bytes=view.boundary_bytes * ring_wire_factor(costs))
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
                    layer_backward_s=2 * b * local.layers[i].forward_s / tp,  # backward: twice the forward
                    tp=tp,
                )
                fwd[s] += counts[i] * f
                bwd[s] += counts[i] * g
    static = st.static_bytes
    if stage.get("zero_stage", 0) == 1:  # the optimizer is sharded over dp, not dp x cp
        trainable = st.trainable_per_device or st.params_per_device
        static = [
            state_bytes(n, costs.precision, zero_stage=1, dp=stage["dp"], trainable_numel=t)
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
    """The optimizer step's seconds of :func:`.cluster_overhead.step_overhead_s` under ZeRO-1 over ``div`` ranks."""
    prec = costs.precision
    largest, most_tensors = busiest_rank(costs, stages, bounds, placement)
    touched = largest / div * (2 * prec.optimizer_bytes + prec.grad_bytes + prec.weight_bytes)
    seconds = touched / (cluster.memory_bandwidth * cluster.memory_efficiency)
    return seconds + most_tensors / div * STEP_OPS_PER_TENSOR * cluster.op_overhead_s


def cp_step_overhead_s(
    costs: ModelCosts, cluster: ClusterSpec, stages: StageCosts, *, cp: int, **overhead: Any
) -> tuple[float, float]:
    """:func:`.cluster_overhead.step_overhead_s` (``overhead``: its keywords, ``bounds``, ``dp``, ``tp``,
    ``zero_stage``, ``stage_to_rank``) at ``cp``: the gradient sync over dp x cp ([Note: cluster cp terms])."""
    dp, bounds = overhead["dp"], overhead["bounds"]
    sync, rest = step_overhead_s(costs, cluster, stages, **{**overhead, "dp": dp * cp})
    if overhead["zero_stage"] == 1 and cp > 1:
        placement = overhead.get("stage_to_rank") or list(range(len(bounds) - 1))
        rest += _zero1_optimizer_s(costs, cluster, stages, bounds, list(placement), dp) - _zero1_optimizer_s(
            costs, cluster, stages, bounds, list(placement), dp * cp
        )
    return sync, rest


def cp_layouts(
    costs: ModelCosts,
    cluster: ClusterSpec,
    world: int,
    *,
    global_batch_size: int,
    cps: Sequence[int],
    cp_modes: Sequence[str],
) -> list[tuple[int, int, int, int, str]]:
    """Every (dp, tp, pp, cp, cp_mode) for ``world`` ranks with cp in ``cps`` (cp=1 once, with the first
    mode), each cp > 1 in every mode of ``cp_modes``: cp * tp divides the devices per node (both groups
    inside a node) and tp and cp suit the heads (:func:`.context_cost.cp_allowed`)."""
    out: list[tuple[int, int, int, int, str]] = []
    view = attention_view(costs)
    for cp, mode in [(c, m) for c in cps for m in (cp_modes if c > 1 else cp_modes[:1])]:
        if world % cp:
            continue

        def allowed(tp: int, cp: int = cp, mode: str = mode) -> bool:
            return (
                cluster.devices_per_node % (tp * cp) == 0
                and costs.tp_allowed(tp)
                and cp_allowed(view, cp, mode, tp)
            )

        grid = choices.layouts(
            world // cp, num_layers=costs.num_layers, global_batch_size=global_batch_size, tp_allowed=allowed
        )
        out += [(dp, tp, pp, cp, mode) for dp, tp, pp in grid]
    return out
