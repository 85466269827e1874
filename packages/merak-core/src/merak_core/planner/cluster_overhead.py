"""The cluster model's step outside the pipeline: the DP gradient sync, the tied-parameter all-reduce,
the optimizer step and the engine's fixed host time (see [Note: cluster model terms] in :mod:`.cluster_cost`).

[Note: per-tensor step operators] Besides its bytes, the optimizer step runs a fixed number of small
operators per parameter tensor, whatever its size: AdamW's multi-tensor step on CPU falls back to one
operator per tensor for each of its ~16 list operations, the gradient norm and the clipping add ~3, the
gradients' reset 1. Measured on this project's 2-core CPU with the demo (68 tensors,
``benchmarks/bench_cluster_plan.py steps``): AdamW 16 and clipping 3 operator overheads per tensor. With a
small model this is most of the time outside the pipeline; a GPU file with ``op_overhead_us`` 0 leaves it
out. ZeRO-1 runs the optimizer on the tensors a rank owns (about 1/dp of them); FSDP2 (ZeRO-2/3) on a shard
of every tensor.

[Note: measured step overhead] Outside the pipeline a step also costs host time that does not
depend on the model: the engine's bookkeeping (the step flags and the loss vector, the gradients'
reset, the learning-rate schedule, the per-phase watchdog). A cluster file may state it per device
(``device.step_overhead_us``), with the per-tensor cost (``device.step_tensor_us``, replacing
``STEP_OPS_PER_TENSOR`` x ``op_overhead_us``) and the per-parameter cost (``device.step_param_ns``,
replacing Adam's bytes once at the memory bandwidth: on CPU the unfused multi-tensor AdamW, the norm
and the clipping pass over the memory once per list operation, about 16 times, not once).
``bench_cluster_plan.py steps`` measures all three on one rank of the real Trainer (the CPU time of a
step minus its pipeline's) with the demo's model at width 8 and 1 and 8 layers (their slope per
tensor, their intercept fixed; their parameters are negligible) and at width 128 and 2 layers (what
is left per parameter).
On the project's 2-core CPU (load 14-16) it read 1.6 ms + 22 us per tensor, about what
``STEP_OPS_PER_TENSOR`` gave for the demo's 68 tensors, while the phases of the demo's real step
outside its pipeline took 4-6.5 ms of CPU (docs/cluster.md): after a pipeline of larger tensors the
same code runs slower than in the probe. Shipped GPU files leave all three out.
"""

from __future__ import annotations

from collections.abc import Sequence

from merak_core.planner.cluster import ClusterSpec
from merak_core.planner.cluster_collectives import dp_ranks, ring_allreduce_s, ring_s, small_allreduce_s
from merak_core.planner.cluster_cost import ModelCosts, StageCosts

STEP_OPS_PER_TENSOR = 20
"""Operators the optimizer step runs per parameter tensor: AdamW 16, norm and clipping 3, reset 1
([Note: per-tensor step operators])."""

__all__ = ["STEP_OPS_PER_TENSOR", "busiest_rank", "step_overhead_s", "step_tensor_s"]


def busiest_rank(
    costs: ModelCosts, stages: StageCosts, bounds: Sequence[int], placement: Sequence[int]
) -> tuple[float, int]:
    """(Most trainable parameters, most trainable tensors) of a pipeline rank (stage s on ``placement[s]``):
    what gradients, their DP sync and the optimizer step count ([Note: frozen weights])."""
    per_rank: dict[int, float] = {}
    tensors: dict[int, int] = {}
    for s, n in enumerate(stages.trainable_per_device or stages.params_per_device):
        per_rank[placement[s]] = per_rank.get(placement[s], 0.0) + n
        count = costs.stage_tensors(bounds[s], bounds[s + 1], trainable=True)
        tensors[placement[s]] = tensors.get(placement[s], 0) + count
    return max(per_rank.values()), max(tensors.values())


def step_overhead_s(
    costs: ModelCosts,
    cluster: ClusterSpec,
    stages: StageCosts,
    *,
    bounds: Sequence[int],
    dp: int,
    tp: int,
    zero_stage: int,
    stage_to_rank: Sequence[int] | None = None,
) -> tuple[float, float]:
    """(DP gradient sync + tied-parameter all-reduce, the rest: optimizer step with clipping and the
    gradient-norm and loss all-reduces) seconds per step (see [Note: cluster model terms]).

    ``stage_to_rank``: the pipeline rank of each stage (default: stage s on rank s).
    """
    prec = costs.precision
    placement = list(stage_to_rank) if stage_to_rank is not None else list(range(len(bounds) - 1))
    largest, most_tensors = busiest_rank(costs, stages, bounds, placement)
    group = dp_ranks(dp, tp)
    if zero_stage <= 1:
        dp_s = ring_allreduce_s(largest * prec.grad_bytes, group, cluster)
    else:  # FSDP2: the step's reduce-scatter; ZeRO-2 also gathers the parameters once per step
        dp_s = ring_s(largest * prec.grad_bytes, group, cluster, 1)
        if zero_stage == 2:
            dp_s += ring_s(largest * prec.weight_bytes, group, cluster, 1)
    stride = dp * tp
    tied = 0.0
    for name, held in costs.tied_across(bounds).items():
        if name in costs.frozen:
            continue  # a frozen tied weight gets no cross-stage gradient sum
        ranks = sorted({placement[s] * stride for s in held})
        tied += ring_allreduce_s(costs.param_numel[name] / tp * prec.grad_bytes, ranks, cluster)
    pp = max(placement) + 1
    flags = small_allreduce_s(list(range(tp)), cluster) + small_allreduce_s(
        [r * stride for r in range(pp)], cluster
    )  # the gradient norm over TP and PP
    flags += small_allreduce_s(list(range(stride * pp)), cluster)  # the loss and step flags over all ranks
    opt_div = dp if zero_stage >= 1 else 1
    # Adam reads and writes master weights, moments and gradients, writes the 16-bit weights.
    touched = largest / opt_div * (2 * prec.optimizer_bytes + prec.grad_bytes + prec.weight_bytes)
    optimizer = touched / (cluster.memory_bandwidth * cluster.memory_efficiency)
    if cluster.step_param_s is not None:  # measured per parameter ([Note: measured step overhead])
        optimizer = largest / opt_div * cluster.step_param_s
    owned = most_tensors / (dp if zero_stage == 1 else 1)  # ZeRO-1 owns whole tensors
    optimizer += owned * step_tensor_s(cluster) + cluster.step_overhead_s  # [Note: measured step overhead]
    return dp_s + tied, optimizer + flags


def step_tensor_s(cluster: ClusterSpec) -> float:
    """Host seconds per parameter tensor in the step outside the pipeline: the cluster file's measured
    ``device.step_tensor_us``, else ``STEP_OPS_PER_TENSOR`` operators at ``op_overhead_s``
    ([Note: per-tensor step operators], [Note: measured step overhead])."""
    if cluster.step_tensor_s is not None:
        return cluster.step_tensor_s
    return STEP_OPS_PER_TENSOR * cluster.op_overhead_s
