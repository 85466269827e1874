"""Pricing one configuration from a profile: its stages' costs and memory, then the simulated pipeline.

:func:`split_layers` cuts the layers into contiguous stages balancing forward time; a
:class:`LayoutCosts` holds what one (dp, tp, pp) and stage count fix (per-stage seconds and bytes of
one sample, held state, the DP all-reduce, the optimizer); :func:`price` adds a schedule,
microbatches and recomputation, simulates the pipeline with :func:`merak_pipe.simulate` and
returns a :class:`~merak_core.planner.candidate.Candidate`. Held state per stage is
:func:`merak_core.planner.memory.model_state_bytes` under the ZeRO stage in use.

[Note: expert parallelism priced] At ``ep > 1`` (a profile with ``layer_expert_bytes``; uniform routing
assumed, as in [Note: expert-parallel cost terms] of :mod:`.expert_cost`) a rank holds ``1 / ep`` of each
MoE block's experts, whole (not split by tp), and the dense rest split by tp; ZeRO shards the experts'
optimizer states (and, at ZeRO-2/3, their gradients and parameters) over the expert-replica group
(``dp / ep`` of the ZeRO group). Each MoE block adds two all-to-alls to a microbatch's forward and two to
its backward, each sending :func:`~merak_core.planner.expert_cost.all_to_all_bytes` off the rank (``top_k``
rows of the block's output per token, the output priced at ``boundary_bytes``) as ``ep - 1`` point-to-point
messages over the measured link, not overlapped. Layer compute and activations are unchanged: every token
still visits ``top_k`` experts, on whichever rank holds them. The DP all-reduce carries the rank's
parameters (experts ``1 / ep``) over dp x cp.

See the package docstring (:mod:`merak_core.planner`) for the cost model and its limits. Not done
here: which configurations to try (:mod:`.search`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from merak_core.config.layout_choice import LayoutChoice
from merak_core.planner.candidate import Candidate
from merak_core.planner.comm import CommModel
from merak_core.planner.context_cost import cp_layer_comm_s
from merak_core.planner.expert_cost import all_to_all_bytes
from merak_core.planner.memory import WEIGHT_GRAD_FRACTION, model_state_bytes, usable_memory
from merak_core.planner.model_profile import ModelProfile
from merak_pipe import schedule_info

__all__ = ["LayoutCosts", "layout_costs", "price", "split_layers"]


def split_layers(costs: Sequence[float], num_stages: int) -> list[int]:
    """Contiguous split of ``costs`` into ``num_stages`` non-empty parts minimising the largest sum.

    Ties go to the earliest cut; returns layers per stage.
    """
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ValueError(f"num_stages={num_stages}: expected 1..{n} (one layer at least per stage)")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for j in range(s, n - (num_stages - s) + 1):
            for i in range(s - 1, j):
                v = max(best[s - 1][i], prefix[j] - prefix[i])
                if v < best[s][j] - 1e-15 * max(1.0, abs(v)):
                    best[s][j], cut[s][j] = v, i
    sizes, j = [], n
    for s in range(num_stages, 0, -1):
        i = cut[s][j]
        sizes.append(j - i)
        j = i
    return sizes[::-1]


@dataclass(frozen=True)
class LayoutCosts:
    """What one (dp, tp, pp) fixes, whatever the schedule and microbatches."""

    dp: int
    tp: int
    pp: int
    sizes: list[int]
    fwd1: list[float]  # per stage, one sample, divided by tp
    bwd1: list[float]
    act1: list[list[float]]  # per stage, per layer, one sample, divided by tp
    layers: list[int]  # layers per stage (len of each stage range)
    static: list[
        float
    ]  # weights + grads + optimizer states per stage (grads and states of trainable weights)
    dp_allreduce_s: float
    optimizer_s: float  # optimizer step over this rank's parameters (uncontended)
    step_comm_s: float  # the gradient-norm and loss all-reduces over every rank
    zero_stage: int = 0
    optimizer_state_factor: float = 2.0
    cp: int = 1  # context-parallel ranks (the profile is then one cp rank's: merak_core.planner.context_cost)
    cp_mode: str = "ring"
    ep: int = 1  # expert-parallel ranks, carved out of dp ([Note: expert parallelism priced])
    moe_blocks: tuple[int, ...] = ()  # MoE blocks per stage (all-to-alls at ep > 1)


def layout_costs(
    profile: ModelProfile,
    comm: CommModel,
    dp: int,
    tp: int,
    pp: int,
    zero_stage: int,
    optimizer_state_factor: float,
    virtual_stages: int = 1,
    cp: int = 1,
    cp_mode: str = "ring",
    ep: int = 1,
) -> LayoutCosts:
    """What (dp, tp, pp) fixes; at ``cp > 1`` ``profile`` is one cp rank's
    (:func:`merak_core.planner.context_cost.cp_local_profile`) and the gradients are averaged over dp x cp;
    at ``ep > 1`` the experts are sharded over ep ([Note: expert parallelism priced])."""
    num_stages = pp * virtual_stages
    sizes = split_layers(profile.layer_forward_s, num_stages)
    bounds = [sum(sizes[:s]) for s in range(num_stages + 1)]
    stage = [range(bounds[s], bounds[s + 1]) for s in range(num_stages)]
    experts = _expert_bytes(profile, stage, ep)
    params = [sum(profile.layer_param_bytes[i] for i in r) / tp for r in stage]
    per_layer = profile.trainable_bytes  # [Note: frozen weights] in merak_core.planner.memory
    trainable = [sum(per_layer[i] for i in r) / tp for r in stage]
    if pp == 1:  # one stage holds the first and the last layer: a tied embedding once
        params[0] -= profile.shared_param_bytes / tp
        trainable[0] -= profile.shared_trainable / tp
    # ZeRO-1 shards the optimizer over dp; ZeRO-2/3 (FSDP2) over the dp x cp replicas (grad_sync_group).
    shard_dp = dp * cp if zero_stage >= 2 else dp
    opt_div = shard_dp if zero_stage >= 1 else 1

    def state(s: int, p: float, t: float, r: range, *, group: int) -> float:
        return sum(
            model_state_bytes(
                p,
                zero_stage=zero_stage,
                dp=group,
                optimizer_state_factor=optimizer_state_factor,
                largest_unit_bytes=max(profile.layer_param_bytes[i] for i in r) / tp,
                stage_index=s,
                num_stages=num_stages,
                trainable_bytes=t,
            )
        )

    static = []
    for s, r in enumerate(stage):
        whole = experts[s] * ep / tp  # the experts' bytes in params[s] (split by tp at ep=1)
        dense_trainable = max(trainable[s] - whole, 0.0)  # the experts train (ep refuses LoRA)
        static.append(
            state(s, params[s] - whole, dense_trainable, r, group=shard_dp)
            + (state(s, experts[s], experts[s], r, group=shard_dp // ep) if experts[s] else 0.0)
        )
        params[s] += experts[s] - whole
        trainable[s] = dense_trainable + experts[s]
    world = dp * cp * tp * pp
    # Per step outside the pipeline: the optimizer over this rank's trainable parameters (its share
    # under ZeRO-1), the gradient-norm all-reduce and the loss all-reduce over every rank.
    # A rank holds every pp-th stage (round-robin; a V holds the same amount up to rounding).
    rank_params = [sum(trainable[s] for s in range(num_stages) if s % pp == r) for r in range(pp)]
    # ZeRO shards the experts' optimizer over their replica group (opt_div / ep ranks)
    expert_div = opt_div // ep if zero_stage >= 1 else 1
    optimized = [(t - e) / opt_div + e / expert_div for t, e in zip(trainable, experts, strict=True)]
    optimizer = max(sum(optimized[s] for s in range(num_stages) if s % pp == r) for r in range(pp))
    optimizer *= profile.optimizer_s_per_byte
    return LayoutCosts(
        dp=dp,
        tp=tp,
        pp=pp,
        sizes=sizes,
        fwd1=[sum(profile.layer_forward_s[i] for i in r) / tp for r in stage],
        bwd1=[sum(profile.layer_backward_s[i] for i in r) / tp for r in stage],
        act1=[[profile.layer_activation_bytes[i] / tp for i in r] for r in stage],
        layers=[len(r) for r in stage],
        static=static,
        dp_allreduce_s=max(comm.allreduce_s(p, dp * cp) for p in rank_params) + _wait(comm, dp * cp),
        optimizer_s=optimizer,
        step_comm_s=2 * (comm.allreduce_s(8.0, world) + _wait(comm, world)),
        zero_stage=zero_stage,
        optimizer_state_factor=optimizer_state_factor,
        cp=cp,
        cp_mode=cp_mode,
        ep=ep,
        moe_blocks=tuple(
            sum((profile.layer_moe_blocks or [0] * profile.num_layers)[i] for i in r) for r in stage
        ),
    )


def _expert_bytes(profile: ModelProfile, stage: Sequence[range], ep: int) -> list[float]:
    """Per stage: the expert bytes one rank holds at ``ep > 1`` (whole experts, ``1 / ep`` of them); zeros at
    ep=1, where the experts are priced with the dense parameters (split by tp)."""
    if ep == 1 or profile.layer_expert_bytes is None:
        return [0.0] * len(stage)
    return [sum(profile.layer_expert_bytes[i] for i in r) / ep for r in stage]


def _wait(comm: CommModel, group_size: int) -> float:
    """The scheduling wait of one synchronising collective over ``group_size`` ranks (none alone)."""
    return comm.sync_wait_s if group_size > 1 else 0.0


def _contended(seconds: float, busy_ranks: int, compute_slots: float | None) -> float:
    """Time of work that ``busy_ranks`` ranks do at once on ``compute_slots`` cores (None: a device each)."""
    if compute_slots is None or busy_ranks <= compute_slots:
        return seconds
    return seconds * busy_ranks / compute_slots


def price(
    profile: ModelProfile,
    comm: CommModel,
    lay: LayoutCosts,
    choice: LayoutChoice,
    *,
    memory_per_device: float,
    compute_slots: float | None,
) -> Candidate | None:
    """Predict ``choice`` (its degrees, ZeRO stage and stage count are ``lay``'s); None when
    stage-aware recomputation cannot fit the memory."""
    from merak_pipe import CostModel, build_schedule, simulate, stage_aware_plan
    from merak_pipe.recompute import RecomputePlan

    pp, m, b = lay.pp, choice.num_microbatches, choice.micro_batch_size
    schedule, recompute = choice.schedule, choice.recompute
    num_stages = len(lay.sizes)  # pp * virtual stages
    tp_comm = [
        2 * n * (comm.allreduce_s(b * profile.boundary_bytes, lay.tp) + _wait(comm, lay.tp))
        for n in lay.layers
    ]
    # The fixed per-microbatch cost (operator dispatch) belongs to the layers' operators: each stage
    # pays its share (by layer count), and a TP shard runs every operator of its layers.
    half = [profile.microbatch_overhead_s / 2 * n / profile.num_layers for n in lay.layers]
    world = lay.dp * lay.cp * lay.tp * pp
    # [Note: compute slots] Ranks that share cores (CPU processes) slow each other's compute down
    # by world / compute_slots, on the critical path too: the replicas of a stage (DP, TP) run and
    # wait at the same moments, so one pipeline's idle time is rarely another's compute time.
    # Waiting for communication is not CPU work and is not slowed down.
    slow = world / compute_slots if compute_slots is not None and world > compute_slots else 1.0
    k = profile.tp_scale.get(lay.tp, 1.0)  # measured against modelled at this TP degree (1: not measured)
    cp_fwd, cp_bwd = _cp_comm(profile, comm, lay, b, slow)
    a2a = _all_to_alls_s(profile, comm, lay, b)  # [Note: expert parallelism priced]; the same in backward
    fwd = [
        ((h + b * f) * slow + c + e + a) * k
        for h, f, c, e, a in zip(half, lay.fwd1, tp_comm, cp_fwd, a2a, strict=True)
    ]
    bwd = [
        ((h + b * x) * slow + c + e + a) * k
        for h, x, c, e, a in zip(half, lay.bwd1, tp_comm, cp_bwd, a2a, strict=True)
    ]
    # I and W: each half of B times the runtime's measured split cost (CommModel.split_backward_scale)
    split = [x * comm.split_backward_scale / 2 for x in bwd]
    costs = CostModel(
        forward=fwd,
        backward=bwd,
        backward_input=split,
        backward_weight=split,
        recompute=fwd,
        p2p_latency=comm.p2p_latency_s + comm.sync_wait_s if pp > 1 else 0.0,
        per_action=comm.per_action_s if pp > 1 else 0.0,  # the pipeline runtime's own cost per action
        p2p_bandwidth=comm.p2p_bandwidth,
        boundary_bytes=b * profile.boundary_bytes,
        activation_bytes=[b * sum(a) for a in lay.act1],
        input_bytes=b * profile.boundary_bytes,
        weight_grad_fraction=WEIGHT_GRAD_FRACTION,
    )
    name = schedule_info(schedule).name
    if recompute == "stage_aware":
        if pp < 2:
            return None
        base = build_schedule(name, num_stages=num_stages, num_ranks=pp, num_microbatches=m)
        try:
            rplan = stage_aware_plan(
                layer_activation_bytes=[[b * a for a in layer] for layer in lay.act1],
                memory_budget=usable_memory(memory_per_device),  # [Note: memory margin]
                static_bytes=lay.static,
                schedule=base,
                input_bytes=b * profile.boundary_bytes,
            )
        except ValueError:
            return None
    elif recompute == "full":
        rplan = RecomputePlan.full(num_stages)
    else:
        rplan = RecomputePlan.none(num_stages)
    fractions = tuple(float(rplan[s]) for s in range(num_stages))
    sched = build_schedule(name, num_stages=num_stages, num_ranks=pp, num_microbatches=m, recompute=rplan)
    result = simulate(sched, costs)
    static = _held_once(profile, lay, sched.stage_to_rank)
    peak = tuple(st + a for st, a in zip(static, result.peak_memory, strict=True))
    device = tuple(
        sum(st for st, r in zip(static, sched.stage_to_rank, strict=True) if r == rank)
        + result.peak_memory_per_rank[rank]
        for rank in range(pp)
    )
    pipeline = result.makespan
    overhead = (_contended(lay.optimizer_s, world, compute_slots) + lay.step_comm_s) * profile.overhead_scale
    dp_allreduce = lay.dp_allreduce_s * profile.overhead_scale
    return Candidate(
        **{
            **choice.choice_fields(),
            "dp": lay.dp,
            "tp": lay.tp,
            "pp": pp,
            "virtual_stages": num_stages // pp,
            "zero_stage": lay.zero_stage,
            "cp": lay.cp,
            "cp_mode": lay.cp_mode,
            "ep": lay.ep,
        },
        recompute_fractions=fractions,
        stage_layers=tuple(lay.sizes),
        step_time_s=pipeline + dp_allreduce + overhead,
        pipeline_s=pipeline,
        dp_allreduce_s=dp_allreduce,
        peak_memory_bytes=peak,
        memory_per_device=float(memory_per_device),
        stage_forward_s=tuple(fwd),
        stage_backward_s=tuple(bwd),
        overhead_s=overhead,
        device_peak_bytes=device,
    )


def _cp_comm(
    profile: ModelProfile, comm: CommModel, lay: LayoutCosts, b: int, slow: float
) -> tuple[list[float], list[float]]:
    """Per stage: the (forward, backward) seconds the cp group's attention adds to a microbatch (0 at cp=1)."""
    fwd, bwd = [], []
    for f, g, n in zip(lay.fwd1, lay.bwd1, lay.layers, strict=True):
        one = cp_layer_comm_s(
            profile,
            comm,
            cp=lay.cp,
            cp_mode=lay.cp_mode,
            micro_batch_size=b,
            layer_forward_s=b * f / n * slow,
            layer_backward_s=b * g / n * slow,
            tp=lay.tp,
        )
        fwd.append(n * one[0])
        bwd.append(n * one[1])
    return fwd, bwd


def _all_to_alls_s(profile: ModelProfile, comm: CommModel, lay: LayoutCosts, b: int) -> list[float]:
    """Per stage: the seconds of the two all-to-alls per MoE block that a microbatch's forward (and again its
    backward) adds at ``ep > 1`` ([Note: expert parallelism priced]); zeros at ep=1."""
    if lay.ep == 1:
        return [0.0] * len(lay.sizes)
    sent = all_to_all_bytes(
        b * profile.boundary_bytes, profile.top_k, lay.ep, 1, 1.0
    )  # tokens x hidden x bytes
    one = (lay.ep - 1) * comm.p2p_latency_s + sent / comm.p2p_bandwidth + comm.sync_wait_s
    return [2 * n * one for n in lay.moe_blocks]


def _held_once(profile: ModelProfile, lay: LayoutCosts, stage_to_rank: Sequence[int]) -> list[float]:
    """Static bytes per stage, less the tied copy on the last stage when the first stage's rank holds it
    too (ZB-V: one local parameter; see merak_core.planner.memory)."""
    static = list(lay.static)
    last = len(static) - 1
    if last > 0 and stage_to_rank[0] == stage_to_rank[last] and profile.shared_param_bytes:
        p = profile.shared_param_bytes / lay.tp
        static[last] -= sum(
            model_state_bytes(
                p,
                zero_stage=lay.zero_stage,
                dp=lay.dp * lay.cp if lay.zero_stage >= 2 else lay.dp,  # as in layout_costs
                optimizer_state_factor=lay.optimizer_state_factor,
                stage_index=last,
                num_stages=len(static),
                trainable_bytes=profile.shared_trainable / lay.tp,
            )
        )
    return static
