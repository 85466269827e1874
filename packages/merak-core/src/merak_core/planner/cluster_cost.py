"""The cluster cost model: a meta-traced model's FLOPs and bytes priced on a :class:`ClusterSpec`.

:func:`trace_for_cluster` traces a model (on the meta device: no weights, no profiling on the
target), annotates every graph node with merak-graph's FLOPs and bytes, priced by a roofline at
the cluster device's sustained rates (``max(flops / (peak * efficiency), bytes / (bandwidth *
efficiency))`` per node, backward twice the forward; a node of an operator class the cluster gives a
rate for at that rate instead of the bandwidth, [Note: operator class rates]), and cuts the graph at its natural
boundaries (about two shards per transformer block). :func:`model_costs` turns that chain into
per-layer :class:`LayerCost` for one sample; :func:`predict_config` prices one configuration.

[Note: cluster model terms] Per stage and microbatch of b samples:
- compute: b x the stage's forward divided by tp, plus the cluster's fixed ``op_overhead_s`` per
  operator the stage runs (not divided by tp, not scaled by b); backward: 2x that;
- TP: one all-reduce of the residual stream (b x ``tp_message_bytes``) per shard holding
  parameters, in forward and in backward, over the TP group's link (a node's NVLink when tp
  fits a node). Sub-pipelined TP (``tp_overlap``) splits the microbatch in ``k = tp_chunks``:
  each TP block then runs k all-reduces of 1/k of the bytes (k times the latency) and k times
  its operators (k times their fixed overhead), and only ``max(comm / k, comm - compute (k - 1)
  / k)`` of that communication stays exposed: with latency-bound all-reduces it costs more than
  it hides;
- recomputation reruns the forward (compute and its TP all-reduces);
- pipeline messages carry the stage's output over the link between the two stages' ranks
  (between nodes when a pipeline neighbour lives on another node), latency + bytes / bandwidth;
- the schedule and its bubble come from :func:`merak_pipe.simulate`;
- per step: the ring all-reduce of the largest stage's gradients over the DP group (ZeRO-1: a
  reduce-scatter and an all-gather, the same bytes on the wire; ZeRO-2: a reduce-scatter of the
  gradients and one all-gather of the parameters; ZeRO-3: the reduce-scatter, its all-gathers are
  per microbatch, below), not overlapped; the all-reduce of parameters tied across stages; the
  gradient-norm and loss all-reduces (latency); the optimizer step at the memory bandwidth plus
  ``STEP_OPS_PER_TENSOR`` operators per parameter tensor at ``op_overhead_s`` ([Note: per-tensor
  step operators] in :mod:`.cluster_overhead`, which prices these per-step terms);
- ZeRO-3 (dp > 1): every microbatch's forward all-gathers the stage's parameters over DP, and its
  backward again, except on the last stage of a pipeline (see :mod:`merak_core.parallel.fsdp`, [Note:
  reshard after forward per stage]); not overlapped.
Memory per stage: parameters, gradients and optimizer states (:class:`Precision`) under the ZeRO
stage by the rule of :func:`merak_core.planner.memory.model_state_bytes` ([Note: cluster ZeRO
memory]) plus the simulated activation peak of the schedule, where a layer's activations are the
bytes of every tensor its nodes produce (an upper bound on what autograd keeps), divided by tp.

[Note: cluster ZeRO memory] One rule for both planners: ZeRO-1, 2 and 3 divide the optimizer states by dp;
ZeRO-2 also holds the gathered parameters next to their shard from the first forward to the step's
reduce-scatter, ZeRO-3 holds its shard and one gathered unit (here the stage's largest layer, divided by tp;
the last stage of a pipeline holds them as ZeRO-2); both hold the accumulated gradients unsharded within the
step. At dp = 1 every stage holds what ZeRO-0 holds. The parameter terms are in ``Precision.weight_bytes``,
the gradients in ``grad_bytes`` and the optimizer states in ``optimizer_bytes``. With 16-bit weights the
shard counted beside the optimizer states (whose 12 B hold an fp32 master copy) over-counts 2 / dp bytes per
parameter: the one rule is kept rather than special-cased.

Deliberately not modelled: kernel efficiency that varies with matrix size, smaller GEMMs of
sub-microbatches, overlap of the DP all-reduce with the backward, network contention between
rings that share a NIC, sequence parallelism.
"""

from __future__ import annotations

import operator
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from merak_core.parallel.active_experts import active_expert_blocks
from merak_core.parallel.fsdp import default_reshard_after_forward
from merak_core.planner.cluster import ClusterSpec
from merak_core.planner.cluster_classes import reprice_classes
from merak_core.planner.cluster_collectives import (
    exposed_tp_s,
    p2p_link,
    ring_allreduce_s,
    tp_ranks,
    zero3_gathers_s,
)
from merak_core.planner.expert_cost import MoECosts, fused_experts_whole, moe_costs
from merak_core.planner.memory import ZERO_STAGES, model_state_bytes

__all__ = [
    "LayerCost",
    "ModelCosts",
    "Precision",
    "StageCosts",
    "model_costs",
    "stage_costs",
    "trace_for_cluster",
]


@dataclass(frozen=True, kw_only=True)
class Precision:
    """Bytes per parameter of the weights, their gradients and the optimizer states."""

    weight_bytes: float = 2.0
    """bf16 weights."""
    grad_bytes: float = 4.0
    """fp32 gradient accumulation (and all-reduce)."""
    optimizer_bytes: float = 12.0
    """fp32 master weights and Adam's two moments."""

    @classmethod
    def for_dtype(cls, dtype: torch.dtype) -> Precision:
        """Mixed precision for 16-bit models, plain fp32 Adam otherwise."""
        if dtype in (torch.bfloat16, torch.float16):
            return cls()
        return cls(weight_bytes=4.0, grad_bytes=4.0, optimizer_bytes=8.0)


@dataclass(frozen=True, kw_only=True)
class LayerCost:
    """One shard of the chain, for one sample, on one device without TP."""

    forward_s: float
    """Forward seconds (roofline at the cluster's sustained rates)."""
    flops: float
    """Forward FLOPs."""
    param_names: tuple[str, ...]
    """Parameters the shard holds (canonical names; a tied parameter appears in every shard using it)."""
    activation_bytes: float
    """Bytes of the tensors the shard's nodes produce."""
    output_bytes: float
    """Bytes of the shard's outputs (the pipeline message when a stage ends here)."""
    num_ops: int = 0
    """Operators the shard's forward runs (graph calls other than tuple indexing)."""

    @property
    def tp_allreduces(self) -> int:
        """TP all-reduces per pass: one per shard holding parameters (see [Note: cluster model terms])."""
        return 1 if self.param_names else 0


@dataclass(frozen=True, kw_only=True)
class ModelCosts:
    """Per-layer costs of one sample plus what constrains TP."""

    layers: tuple[LayerCost, ...]
    param_numel: dict[str, int]
    """Elements of every parameter, by canonical name."""
    precision: Precision
    tp_message_bytes: float
    """Bytes of one TP all-reduce for one sample (the residual stream)."""
    dtype: str = "bf16"
    """FLOP/s key of the cluster to price compute with."""
    num_heads: int | None = None
    num_kv_heads: int | None = None
    vocab_size: int | None = None
    frozen: frozenset[str] = frozenset()
    """Canonical names of the parameters that do not train (a LoRA run's base): weights only, no
    gradient, no optimizer state, no DP sync and nothing for ZeRO to shard ([Note: frozen weights])."""
    moe: MoECosts | None = None
    """The MoE blocks (expert parameters, k of E; :mod:`.expert_cost`); None: a dense model."""
    _cache: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def tp_allowed(self, tp: int) -> bool:
        kv = self.num_kv_heads if self.num_kv_heads is not None else self.num_heads
        return all(v is None or v % tp == 0 for v in (self.num_heads, kv, self.vocab_size))

    def stage_params(self, lo: int, hi: int) -> int:
        """Parameters held by the stage of layers [lo, hi) (a tied parameter once per stage)."""
        key = ("params", lo, hi)
        if key not in self._cache:
            names = {n for layer in self.layers[lo:hi] for n in layer.param_names}
            self._cache[key] = sum(self.param_numel[n] for n in names)
        return int(self._cache[key])

    def stage_trainable(self, lo: int, hi: int) -> int:
        """The part of :meth:`stage_params` that trains (all of it but :attr:`frozen`)."""
        names = {n for layer in self.layers[lo:hi] for n in layer.param_names} - self.frozen
        return sum(self.param_numel[n] for n in names)

    def stage_tensors(self, lo: int, hi: int, *, trainable: bool = False) -> int:
        """Parameter tensors held by the stage of layers [lo, hi) (a tied parameter once per stage);
        ``trainable``: those that train only."""
        names = {n for layer in self.layers[lo:hi] for n in layer.param_names}
        return len(names - self.frozen if trainable else names)

    def largest_layer_params(self, lo: int, hi: int, *, trainable: bool = False) -> int:
        """Parameters of the largest layer of the stage [lo, hi) (ZeRO-3's gathered unit); ``trainable``:
        of the parameters that train (FSDP gathers no frozen one)."""
        skip = self.frozen if trainable else frozenset()
        return max(
            (sum(self.param_numel[n] for n in ly.param_names if n not in skip) for ly in self.layers[lo:hi]),
            default=0,
        )

    def tied_across(self, bounds: Sequence[int]) -> dict[str, list[int]]:
        """Parameters held by more than one stage: name -> stages holding it."""
        key = ("tied", tuple(bounds))
        if key not in self._cache:
            self._cache[key] = self._tied_across(bounds)
        return dict(self._cache[key])

    def _tied_across(self, bounds: Sequence[int]) -> dict[str, list[int]]:
        holders: dict[str, set[int]] = {}
        for s in range(len(bounds) - 1):
            for layer in self.layers[bounds[s] : bounds[s + 1]]:
                for n in layer.param_names:
                    holders.setdefault(n, set()).add(s)
        return {n: sorted(st) for n, st in holders.items() if len(st) > 1}


def trace_for_cluster(
    model: nn.Module,
    example_inputs: Sequence[Any] | Mapping[str, Any],
    cluster: ClusterSpec,
    *,
    dtype: str = "bf16",
    num_shards: int | None = None,
) -> Any:
    """Trace ``model`` (meta is fine), annotate costs at ``cluster``'s rates and shard it; a ``ShardedGraph``."""
    import merak_graph as mg

    by_name = isinstance(example_inputs, Mapping)
    inputs = example_inputs if by_name else tuple(example_inputs)
    with active_expert_blocks(model) as blocks, fused_experts_whole(model) as fused:  # k of E experts, whole
        leaves: list[type | str] = [*blocks, *fused]
        try:  # torch.fx first: fast at any size; torch.export for models fx cannot trace (transformers)
            gm = mg.trace(model, example_inputs=inputs, method="fx", leaf_modules=leaves)
        except mg.TraceError:
            gm = mg.trace(model, example_inputs=inputs, method="auto", leaf_modules=leaves)
        values = (
            [example_inputs[n] for n in gm.meta.get("merak_input_names", list(example_inputs))]  # type: ignore[call-overload]
            if by_name
            else list(example_inputs)
        )
        rates = mg.CostModel(
            flops_per_s=cluster.flops(dtype),
            bytes_per_s=cluster.memory_bandwidth * cluster.memory_efficiency,
            backward_factor=2.0,
        )
        mg.annotate_costs(gm, values, cost_model=rates)
        if cluster.op_class_bandwidth:  # [Note: operator class rates]
            reprice_classes(gm, cluster.op_class_bandwidth, flops_per_s=cluster.flops(dtype))
        count = num_shards if num_shards is not None else mg.natural_shard_count(gm)
        return mg.shard(gm, count, model=model)


def model_costs(
    sharded: Any,
    model: nn.Module,
    *,
    dtype: str = "bf16",
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    vocab_size: int | None = None,
) -> ModelCosts:
    """:class:`ModelCosts` of a :func:`trace_for_cluster` chain traced with one sample per microbatch."""
    canonical: dict[int, str] = {}
    numel: dict[str, int] = {}
    frozen: set[str] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        canonical.setdefault(id(p), name)
        numel[canonical[id(p)]] = p.numel()
        if not p.requires_grad:
            frozen.add(canonical[id(p)])
    first = next(iter(model.parameters()), None)
    param_dtype = first.dtype if first is not None else torch.float32
    layers = []
    for s in sharded.shards:
        names = tuple(
            sorted({canonical.get(id(p), n) for n, p in s.module.named_parameters(remove_duplicate=False)})
        )
        for n, p in s.module.named_parameters(remove_duplicate=False):
            numel.setdefault(canonical.get(id(p), n), p.numel())
        layers.append(
            LayerCost(
                forward_s=s.time_s / 3.0,
                flops=float(s.flops),
                param_names=names,
                activation_bytes=float(s.activation_bytes),
                output_bytes=float(sum(b.nbytes for b in s.outputs)),
                num_ops=_count_ops(s.module),
            )
        )
    inner = [ly.output_bytes for ly in layers[:-1] if ly.output_bytes > 0] or [layers[-1].output_bytes]
    return ModelCosts(
        layers=tuple(layers),
        param_numel=numel,
        precision=Precision.for_dtype(param_dtype),
        tp_message_bytes=float(statistics.median(inner)),
        dtype=dtype,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        vocab_size=vocab_size,
        frozen=frozenset(frozen),
        moe=moe_costs(model, sharded, canonical),
    )


def _count_ops(module: nn.Module) -> int:
    """Calls in a shard's graph, the unit of the fixed per-operator overhead."""
    graph = getattr(module, "graph", None)
    if graph is None:
        return 0
    calls = ("call_function", "call_method", "call_module")
    return sum(1 for node in graph.nodes if node.op in calls and node.target is not operator.getitem)


@dataclass(frozen=True, kw_only=True)
class StageCosts:
    """Per-stage seconds and bytes of one microbatch, ready for :func:`merak_pipe.simulate`."""

    forward_s: list[float]
    backward_s: list[float]
    """Without recomputation."""
    tp_exposed_s: list[float]
    """TP all-reduce seconds left on the critical path, forward + backward, per microbatch."""
    activation_bytes: list[list[float]]
    """Per stage, per layer, one microbatch, divided by tp."""
    static_bytes: list[float]
    """Weights, gradients and optimizer states per stage (per device)."""
    params_per_device: list[float]
    trainable_per_device: list[float] = field(default_factory=list)
    """The part of ``params_per_device`` that trains (empty: all of it)."""
    boundary_bytes: list[float]
    """Message from stage s to s+1 for one microbatch."""
    input_bytes: list[float]
    p2p_latency_s: float
    p2p_bandwidth: float


def state_bytes(
    numel: float,
    precision: Precision,
    *,
    unit_numel: float = 0.0,
    trainable_numel: float | None = None,
    **zero: Any,
) -> float:
    """Weights + gradients + optimizer states one device holds at its peak for ``numel`` parameters of one
    stage ([Note: cluster ZeRO memory]; ``unit_numel``: ZeRO-3's gathered unit; ``trainable_numel``: the part
    that trains, None: all, the rest weights only ([Note: frozen weights]); ``zero``: ``model_state_bytes``'s
    ``zero_stage``, ``dp``, ``stage_index`` and ``num_stages``)."""
    w = precision.weight_bytes
    weights, grads, optimizer = model_state_bytes(
        numel * w,
        optimizer_state_factor=precision.optimizer_bytes / w,
        largest_unit_bytes=unit_numel * w,
        trainable_bytes=None if trainable_numel is None else trainable_numel * w,
        **zero,
    )
    return weights + grads * precision.grad_bytes / w + optimizer


def stage_costs(
    costs: ModelCosts,
    cluster: ClusterSpec,
    *,
    bounds: Sequence[int],
    dp: int,
    tp: int,
    micro_batch_size: int,
    zero_stage: int = 0,
    tp_overlap: bool = False,
    tp_chunks: int = 2,
    num_ranks: int | None = None,
) -> StageCosts:
    """Seconds and bytes per stage for layers split at ``bounds`` (see [Note: cluster model terms]).

    ``num_ranks``: pipeline ranks when they hold several stages each (virtual stages); default one
    stage per rank.
    """
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage={zero_stage!r}; expected one of {ZERO_STAGES}")
    b, pp = micro_batch_size, len(bounds) - 1
    prec = costs.precision
    tp_group = tp_ranks(dp, tp)
    chunks = tp_chunks if tp_overlap and tp > 1 and tp_chunks >= 2 else 1
    # Sub-pipelined TP: every TP block runs its operators and its all-reduce once per chunk.
    one_ar = chunks * ring_allreduce_s(b * costs.tp_message_bytes / chunks, tp_group, cluster)
    fwd, bwd, exposed, acts, static, params, out_b, in_b = [], [], [], [], [], [], [], []
    trainable: list[float] = []
    for s in range(pp):
        layers = costs.layers[bounds[s] : bounds[s + 1]]
        ops = sum(ly.num_ops * (chunks if ly.tp_allreduces else 1) for ly in layers)
        compute_f = b * sum(ly.forward_s for ly in layers) / tp + cluster.op_overhead_s * ops
        comm = one_ar * sum(ly.tp_allreduces for ly in layers) if tp > 1 else 0.0
        ex_f = exposed_tp_s(comm, compute_f, tp_overlap, tp_chunks)
        ex_b = exposed_tp_s(comm, 2 * compute_f, tp_overlap, tp_chunks)
        n = costs.stage_params(bounds[s], bounds[s + 1]) / tp
        nt = costs.stage_trainable(bounds[s], bounds[s + 1]) / tp  # ZeRO gathers and shards these only
        gather_f = gather_b = 0.0
        if zero_stage == 3:
            again = default_reshard_after_forward(3, stage_index=s, num_stages=pp)
            gather_f, gather_b = zero3_gathers_s(
                nt, prec.weight_bytes, cluster, dp=dp, tp=tp, backward_too=again
            )
        fwd.append(compute_f + ex_f + gather_f)
        bwd.append(2 * compute_f + ex_b + gather_b)
        exposed.append(ex_f + ex_b)
        acts.append([b * ly.activation_bytes / tp for ly in layers])
        params.append(n)
        trainable.append(nt)
        unit = costs.largest_layer_params(bounds[s], bounds[s + 1], trainable=True) / tp
        static.append(
            state_bytes(
                n,
                prec,
                zero_stage=zero_stage,
                dp=dp,
                unit_numel=unit,
                stage_index=s,
                num_stages=pp,
                trainable_numel=nt,
            )
        )
        out_b.append(b * layers[-1].output_bytes)
        in_b.append(b * (costs.layers[bounds[s] - 1].output_bytes if bounds[s] > 0 else 0.0))
    latency, bandwidth = p2p_link(dp, tp, num_ranks if num_ranks is not None else pp, cluster)
    return StageCosts(
        forward_s=fwd,
        backward_s=bwd,
        tp_exposed_s=exposed,
        activation_bytes=acts,
        static_bytes=static,
        params_per_device=params,
        trainable_per_device=trainable,
        boundary_bytes=out_b,
        input_bytes=in_b,
        p2p_latency_s=latency,
        p2p_bandwidth=bandwidth,
    )
