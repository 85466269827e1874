"""Expert parallelism applied to a stage's cluster costs ([Note: expert-parallel cost terms] in
:mod:`.expert_cost`): the all-to-alls added to forward and backward, the experts' bytes divided by ep, and
under ZeRO-2/3 the experts' shards over the expert-replica group (``dp / ep`` ranks; ZeRO-3's all-gathers of
the experts over it too).

Not here: the terms themselves (:mod:`.expert_cost`), the dense stage (:mod:`.cluster_cost`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from merak_core.config.layout_choice import LayoutChoice
from merak_core.parallel.fsdp import default_reshard_after_forward
from merak_core.planner.cluster import ClusterSpec
from merak_core.planner.cluster_collectives import zero3_gathers_s
from merak_core.planner.cluster_cost import ModelCosts, StageCosts, state_bytes
from merak_core.planner.expert_cost import all_to_all_bytes_per_sample, all_to_all_s, moe_of

__all__ = ["price_expert_parallel"]


def price_expert_parallel(
    costs: ModelCosts,
    cluster: ClusterSpec,
    stages: StageCosts,
    choice: LayoutChoice,
    *,
    bounds: Sequence[int],
) -> StageCosts:
    """``stages`` (priced at ep=1 by :func:`merak_core.planner.cluster_cost.stage_costs`) at ``choice``'s ep
    (its dp, tp, micro batch and ZeRO stage): [Note: expert-parallel cost terms]. Never with cp > 1: expert
    parallelism refuses context parallelism in the run, so the cluster model does not price both."""
    dp, tp, ep, zero_stage = choice.dp, choice.tp, choice.ep, choice.zero_stage
    if ep > 1 and choice.cp > 1:
        raise ValueError(
            f"cp={choice.cp} with ep={ep}: expert parallelism runs at cp=1 only (the run refuses both); plan one"
        )
    moe = moe_of(costs)
    if ep == 1 or moe is None:
        return stages
    if dp % ep or moe.num_experts % ep:
        raise ValueError(
            f"ep={ep} at dp={dp} with {moe.num_experts} experts: ep must divide dp and the experts"
        )
    nbytes = choice.micro_batch_size * all_to_all_bytes_per_sample(costs, ep)
    one = all_to_all_s(nbytes, ep, tp, cluster)  # one all-to-all of one MoE block
    fwd, bwd, static, params, trainable = [], [], [], [], []
    num_stages, prec = len(bounds) - 1, costs.precision
    for s in range(num_stages):
        lo, hi = bounds[s], bounds[s + 1]
        names = {n for ly in costs.layers[lo:hi] for n in ly.param_names}
        expert = sum(costs.param_numel[n] for n in names & moe.expert_params)
        expert_trainable = sum(costs.param_numel[n] for n in (names & moe.expert_params) - costs.frozen)
        blocks = sum(moe.blocks_per_layer[lo:hi])
        dense = stages.params_per_device[s] - expert / tp
        dense_t = (stages.trainable_per_device or stages.params_per_device)[s] - expert_trainable / tp
        gather = _zero3_gathers_moved(
            cluster, prec.weight_bytes, choice, dense_t + expert_trainable / tp, dense_t, expert_trainable / ep,
            stage_index=s, num_stages=num_stages,
        )  # fmt: skip
        fwd.append(stages.forward_s[s] + 2 * blocks * one + gather[0])
        bwd.append(stages.backward_s[s] + 2 * blocks * one + gather[1])
        unit = costs.largest_layer_params(lo, hi, trainable=True) / tp if zero_stage == 3 else 0.0
        zero = dict(zero_stage=zero_stage, stage_index=s, num_stages=num_stages)
        static.append(
            state_bytes(dense, prec, dp=dp, trainable_numel=dense_t, unit_numel=unit, **zero)
            + state_bytes(expert / ep, prec, dp=dp // ep, trainable_numel=expert_trainable / ep, **zero)
        )
        params.append(dense + expert / ep)
        trainable.append(dense_t + expert_trainable / ep)
    return dataclasses.replace(
        stages,
        forward_s=fwd,
        backward_s=bwd,
        static_bytes=static,
        params_per_device=params,
        trainable_per_device=trainable,
    )


def _zero3_gathers_moved(
    cluster: ClusterSpec,
    weight_bytes: float,
    choice: LayoutChoice,
    priced: float,
    dense: float,
    experts: float,
    *,
    stage_index: int,
    num_stages: int,
) -> tuple[float, float]:
    """(forward, backward) seconds ZeRO-3's all-gathers change by at ep > 1 (0 below ZeRO-3): the stage priced
    them for ``priced`` trainable parameters over DP; the run gathers the ``dense`` ones over DP and the
    ``experts`` (this rank's ``1 / ep``) over the expert-replica group, ``dp / ep`` ranks ``ep`` DP neighbours
    apart ([Note: ZeRO-2/3 with experts] in :mod:`merak_core.parallel.zero_experts`)."""
    if choice.zero_stage != 3:
        return 0.0, 0.0
    dp, tp, ep = choice.dp, choice.tp, choice.ep
    again = default_reshard_after_forward(3, stage_index=stage_index, num_stages=num_stages)
    old = zero3_gathers_s(priced, weight_bytes, cluster, dp=dp, tp=tp, backward_too=again)
    new_dense = zero3_gathers_s(dense, weight_bytes, cluster, dp=dp, tp=tp, backward_too=again)
    # the replica group's ranks are dp / ep groups of stride ep * tp: dp_ranks(dp / ep, ep * tp)
    new_experts = zero3_gathers_s(experts, weight_bytes, cluster, dp=dp // ep, tp=ep * tp, backward_too=again)
    return new_dense[0] + new_experts[0] - old[0], new_dense[1] + new_experts[1] - old[1]
