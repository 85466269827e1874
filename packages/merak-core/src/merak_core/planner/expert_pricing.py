"""Expert parallelism applied to a stage's cluster costs ([Note: expert-parallel cost terms] in
:mod:`.expert_cost`): the all-to-alls added to forward and backward, the experts' bytes divided by ep.

Not here: the terms themselves (:mod:`.expert_cost`), the dense stage (:mod:`.cluster_cost`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from merak_core.config.layout_choice import LayoutChoice
from merak_core.planner.cluster import ClusterSpec
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
    if dp % ep or moe.num_experts % ep or zero_stage >= 2:
        raise ValueError(
            f"ep={ep} at dp={dp} with {moe.num_experts} experts and zero_stage={zero_stage}: ep must divide dp "
            "and the experts, with ZeRO 0 or 1"
        )
    nbytes = choice.micro_batch_size * all_to_all_bytes_per_sample(costs, ep)
    one = all_to_all_s(nbytes, ep, tp, cluster)  # one all-to-all of one MoE block
    fwd, bwd, static, params, trainable = [], [], [], [], []
    for s in range(len(bounds) - 1):
        lo, hi = bounds[s], bounds[s + 1]
        names = {n for ly in costs.layers[lo:hi] for n in ly.param_names}
        expert = sum(costs.param_numel[n] for n in names & moe.expert_params)
        expert_trainable = sum(costs.param_numel[n] for n in (names & moe.expert_params) - costs.frozen)
        blocks = sum(moe.blocks_per_layer[lo:hi])
        fwd.append(stages.forward_s[s] + 2 * blocks * one)
        bwd.append(stages.backward_s[s] + 2 * blocks * one)
        dense = stages.params_per_device[s] - expert / tp
        dense_t = (stages.trainable_per_device or stages.params_per_device)[s] - expert_trainable / tp
        prec = costs.precision
        static.append(
            state_bytes(dense, prec, zero_stage=zero_stage, dp=dp, trainable_numel=dense_t)
            + state_bytes(
                expert / ep, prec, zero_stage=zero_stage, dp=dp // ep, trainable_numel=expert_trainable / ep
            )
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
