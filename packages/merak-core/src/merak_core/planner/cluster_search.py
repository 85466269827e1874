"""The search at cluster scale: every layout, microbatch count, schedule, recomputation, ZeRO stage
and TP overlap for N devices of a :class:`ClusterSpec`, priced by :mod:`.cluster_cost`.

TP stays inside a node (tp divides the devices per node) and must divide heads, kv heads and
vocabulary; dp must divide the global batch; pp is at most the number of layers (shards). Layers
are split contiguously to balance forward time (:func:`merak_core.planner.split_layers`). The
pipeline is simulated with :func:`merak_pipe.simulate`; stage-aware recomputation uses
:func:`merak_pipe.stage_aware_plan` against the device's usable memory.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from merak_core.config.layout_choice import LayoutChoice
from merak_core.planner import choices
from merak_core.planner.action_cost import runtime_actions_s
from merak_core.planner.candidate import ranked_rows
from merak_core.planner.choices import (
    CLUSTER_SCHEDULES,
    PREDICTABLE_SCHEDULES,
    RECOMPUTE_MODES,
    check_counts,
)
from merak_core.planner.cluster import ClusterSpec
from merak_core.planner.cluster_context import cp_layouts, cp_stage_costs, cp_step_overhead_s
from merak_core.planner.cluster_cost import ModelCosts
from merak_core.planner.expert_cost import expert_degrees
from merak_core.planner.expert_pricing import price_expert_parallel
from merak_core.planner.pricing import split_layers
from merak_pipe import schedule_info

logger = logging.getLogger(__name__)

__all__ = [
    "CLUSTER_SCHEDULES",
    "PREDICTABLE_SCHEDULES",
    "ClusterCandidate",
    "format_cluster_plan",
    "plan_cluster",
    "predict_config",
]


@dataclass(frozen=True, kw_only=True)
class ClusterCandidate(LayoutChoice):
    """One configuration on the cluster (its :class:`LayoutChoice` fields) with its predicted step
    time and per-stage memory."""

    recompute_fractions: tuple[float, ...]
    stage_layers: tuple[int, ...]
    step_time_s: float
    pipeline_s: float
    dp_allreduce_s: float
    optimizer_s: float
    stage_memory_bytes: tuple[float, ...]
    """Per pipeline rank (device): weights + gradients + optimizer states + simulated activation peak
    of every stage it holds."""
    stage_static_bytes: tuple[float, ...]
    """Per pipeline rank: weights + gradients + optimizer states."""
    memory_limit_bytes: float
    pipeline_crosses_nodes: bool
    dp_crosses_nodes: bool

    @property
    def fits(self) -> bool:
        return max(self.stage_memory_bytes) <= self.memory_limit_bytes

    def training_fields(self, memory_budget: float | None = None) -> dict[str, Any]:
        """The job file's ``training`` fields for this choice (stage-aware: the device's usable memory)."""
        return super().training_fields(self.memory_limit_bytes if memory_budget is None else memory_budget)


def _bounds(sizes: Sequence[int]) -> list[int]:
    out = [0]
    for n in sizes:
        out.append(out[-1] + n)
    return out


def _stages_per_rank(costs: ModelCosts, choice: LayoutChoice) -> int:
    """Stages per pipeline rank that ``choice`` runs: its ``virtual_stages`` for the schedules whose
    count an option chooses (``interleaved_1f1b``), the schedule's own count (ZB-V: two), else 1."""
    if choice.schedule not in PREDICTABLE_SCHEDULES:
        raise ValueError(f"schedule {choice.schedule!r} is not one of {PREDICTABLE_SCHEDULES}")
    if choice.recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute {choice.recompute!r} is not one of {RECOMPUTE_MODES}")
    info = schedule_info(choice.schedule)
    pp = choice.pp
    v = (info.stages_per_rank or choice.virtual_stages) if pp > 1 and not info.one_stage_per_rank else 1
    if v < 1 or v * pp > costs.num_layers:
        raise ValueError(
            f"virtual_stages={choice.virtual_stages} with pp={pp}: expected 1 <= pp * virtual_stages <= "
            f"{costs.num_layers} layers"
        )
    return v


class _Pipeline:
    """The schedules and simulations of one choice's pipeline, reused through ``memo`` across calls."""

    def __init__(self, choice: LayoutChoice, num_stages: int, memo: dict[Any, Any] | None) -> None:
        self.name = schedule_info(choice.schedule).name if choice.pp > 1 else "1f1b"
        self.num_stages, self.pp, self.m = num_stages, choice.pp, choice.num_microbatches
        self.check = memo is None  # with a memo, schedules are not re-validated
        self.memo: dict[Any, Any] = {} if memo is None else memo

    def schedule(self, rplan: Any) -> Any:
        from merak_pipe import build_schedule

        key = ("schedule", self.name, self.num_stages, self.pp, self.m, rplan)
        if key not in self.memo:
            options = {"num_ranks": self.pp} if self.num_stages > self.pp else {}
            self.memo[key] = build_schedule(
                self.name,
                num_stages=self.num_stages,
                num_microbatches=self.m,
                recompute=rplan,
                check=self.check,
                **options,
            )
        return self.memo[key]

    def recompute_plan(self, recompute: str, st: Any, limit: float) -> Any:
        """The per-stage recomputation of ``recompute``; None when stage-aware cannot fit ``limit``."""
        from merak_pipe import RecomputePlan, stage_aware_plan

        if recompute == "stage_aware" and self.pp > 1:
            try:
                return stage_aware_plan(
                    layer_activation_bytes=st.activation_bytes,
                    memory_budget=limit,
                    static_bytes=st.static_bytes,
                    schedule=self.schedule(None),
                    input_bytes=st.input_bytes,
                )
            except ValueError:
                return None
        if recompute == "full":
            return RecomputePlan.full(self.num_stages)
        return RecomputePlan.none(self.num_stages)

    def simulate(self, rplan: Any, st: Any) -> Any:
        from merak_pipe import CostModel, simulate

        activation = [sum(a) for a in st.activation_bytes]
        key = (
            "sim",
            self.name,
            self.num_stages,
            self.pp,
            self.m,
            rplan,
            tuple(st.forward_s),
            tuple(st.backward_s),
            tuple(st.input_bytes),
            st.p2p_latency_s,
            st.p2p_bandwidth,
            tuple(activation),
        )
        if key not in self.memo:
            link = {"p2p_latency": st.p2p_latency_s, "p2p_bandwidth": st.p2p_bandwidth}
            sizes = {
                "boundary_bytes": st.boundary_bytes,
                "activation_bytes": activation,
                "input_bytes": st.input_bytes,
            }
            costs = CostModel(
                forward=st.forward_s, backward=st.backward_s, recompute=st.forward_s, **link, **sizes
            )
            self.memo[key] = simulate(self.schedule(rplan), costs)
        return self.memo[key]


def predict_config(
    costs: ModelCosts,
    cluster: ClusterSpec,
    choice: LayoutChoice,
    *,
    tp_chunks: int = 2,
    stage_layers: Sequence[int] | None = None,
    memo: dict[Any, Any] | None = None,
) -> ClusterCandidate | None:
    """Predict one :class:`LayoutChoice` (fitting or not); None when stage-aware recomputation cannot fit.

    ``memo`` (a dict kept across calls on the same costs and cluster) reuses built schedules and
    simulations; with it, schedules are not re-validated. The choice's ``virtual_stages`` applies to
    the schedules with several stages per rank whose count an option chooses (``interleaved_1f1b``:
    pp * virtual_stages stages, stage s on pipeline rank s % pp); ZB-V always runs two.
    """
    dp, tp, pp = choice.dp, choice.tp, choice.pp
    v = _stages_per_rank(costs, choice)
    num_stages = pp * v
    sizes = (
        list(stage_layers)
        if stage_layers is not None
        else split_layers([ly.forward_s for ly in costs.layers], num_stages)
    )
    bounds = _bounds(sizes)
    grid: dict[str, Any] = {
        "bounds": bounds,
        "dp": dp,
        "tp": tp,
        "cp": choice.cp,
    }  # at cp > 1 one cp rank's tokens
    st = cp_stage_costs(  # [Note: cluster cp terms]
        costs,
        cluster,
        **grid,
        cp_mode=choice.cp_mode,
        micro_batch_size=choice.micro_batch_size,
        zero_stage=choice.zero_stage,
        tp_overlap=choice.tp_overlap,
        tp_chunks=tp_chunks,
        num_ranks=pp,
    )
    # The all-to-alls and the experts' bytes / ep ([Note: expert-parallel cost terms]); refuses cp > 1.
    st = price_expert_parallel(costs, cluster, st, choice, bounds=bounds)
    limit = cluster.usable_memory_bytes
    pipeline = _Pipeline(choice, num_stages, memo)
    rplan = pipeline.recompute_plan(choice.recompute, st, limit)
    if rplan is None:
        return None
    result = pipeline.simulate(rplan, st)
    placement = list(result.schedule.stage_to_rank)
    dp_s, opt_s = cp_step_overhead_s(
        costs, cluster, st, **grid, zero_stage=choice.zero_stage, stage_to_rank=placement
    )
    static = [
        sum(b for b, r in zip(st.static_bytes, placement, strict=True) if r == rank) for rank in range(pp)
    ]
    stride = dp * choice.cp * tp
    return ClusterCandidate(
        **{
            **choice.choice_fields(),
            "schedule": choice.schedule if pp > 1 else "1f1b",
            "tp_overlap": choice.tp_overlap and tp > 1,
            "virtual_stages": v,
        },
        recompute_fractions=tuple(rplan.fractions),
        stage_layers=tuple(sizes),
        step_time_s=result.makespan + dp_s + opt_s + runtime_actions_s(cluster.per_action_s, result.schedule),
        pipeline_s=result.makespan,
        dp_allreduce_s=dp_s,
        optimizer_s=opt_s,
        stage_memory_bytes=tuple(s + a for s, a in zip(static, result.peak_memory_per_rank, strict=True)),
        stage_static_bytes=tuple(static),
        memory_limit_bytes=limit,
        pipeline_crosses_nodes=any(
            cluster.node_of(s * stride) != cluster.node_of((s + 1) * stride) for s in range(pp - 1)
        ),
        dp_crosses_nodes=cluster.node_of(0) != cluster.node_of((dp - 1) * choice.cp * tp),
    )


def _cluster_runs(
    pp: int, schedules: Sequence[str], virtual_stages: Sequence[int], num_layers: int
) -> list[tuple[str, int]]:
    """(schedule, stages per rank) pairs to try at ``pp``: the one-stage schedules of ``schedules``,
    and those with several stages per rank at each v of ``virtual_stages`` they run (the registry's
    ``runs_stages_per_rank``) with pp * v <= layers."""
    if pp == 1:
        return [("1f1b", 1)]
    runs = [(sched, 1) for sched in schedules if schedule_info(sched).one_stage_per_rank]
    for sched in schedules:
        info = schedule_info(sched)
        if not info.one_stage_per_rank:
            runs += [
                (sched, v)
                for v in virtual_stages
                if v > 1 and info.runs_stages_per_rank(v) and pp * v <= num_layers
            ]
    return runs


def _zero_and_ep(costs: ModelCosts, dp: int, cp: int, zero_stages: Sequence[int]) -> list[tuple[int, int]]:
    """(ZeRO stage, ep) pairs to try: every ep of an MoE model (:func:`expert_degrees`) with every ZeRO stage
    (ZeRO-2/3 shard the experts over their replica group: :func:`.expert_pricing.price_expert_parallel`), at
    cp=1 only (expert parallelism refuses cp > 1 in the run, so cp > 1 is planned at ep=1)."""
    eps = expert_degrees(costs, dp) if cp == 1 else [1]
    return [(zero, ep) for zero in zero_stages for ep in eps]


def _base_choices(
    costs: ModelCosts,
    grid: Sequence[tuple[int, int, int, int, str]],
    *,
    global_batch_size: int,
    max_microbatches: int,
    schedules: Sequence[str],
    virtual_stages: Sequence[int],
    zero_stages: Sequence[int],
    tp_overlaps: Sequence[bool],
) -> Iterator[LayoutChoice]:
    """Every configuration :func:`plan_cluster` tries, before its recomputation: per (dp, tp, pp, cp, mode)
    of ``grid``, every microbatch count from pp to ``max_microbatches`` dividing a replica's samples, then
    the schedules, (ZeRO, ep) pairs and TP overlaps."""
    for dp, tp, pp, cp, mode in grid:
        per_dp = global_batch_size // dp
        runs = _cluster_runs(pp, schedules, virtual_stages, costs.num_layers)
        rest = list(
            itertools.product(
                runs, _zero_and_ep(costs, dp, cp, zero_stages), tp_overlaps if tp > 1 else [False]
            )
        )
        axes: dict[str, Any] = {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "cp_mode": mode}
        for m in choices.divisors(per_dp):
            if not pp <= m <= max_microbatches:
                continue
            for (sched, v), (zero, ep), overlap in rest:
                yield LayoutChoice(
                    **axes,
                    ep=ep,
                    zero_stage=zero,
                    schedule=sched,
                    num_microbatches=m,
                    micro_batch_size=per_dp // m,
                    tp_overlap=overlap,
                    virtual_stages=v,
                )


def plan_cluster(
    costs: ModelCosts,
    cluster: ClusterSpec,
    *,
    num_nodes: int,
    global_batch_size: int,
    schedules: Sequence[str] = CLUSTER_SCHEDULES,
    recompute_modes: Sequence[str] = RECOMPUTE_MODES,
    zero_stages: Sequence[int] = (0, 1),
    tp_overlaps: Sequence[bool] = (False, True),
    max_microbatches: int = 128,
    layouts: Sequence[tuple[int, int, int]] | None = None,
    virtual_stages: Sequence[int] = (2,),
    cps: Sequence[int] = (1,),
    cp_mode: str | Sequence[str] = "ring",
) -> list[ClusterCandidate]:
    """Every configuration that fits the device memory on ``num_nodes`` nodes, best predicted first.

    ``layouts`` restricts the (dp, tp, pp) tried; ``virtual_stages`` are the stages per rank tried
    with the schedules of ``schedules`` that run several (``interleaved_1f1b``; ``zb_v`` at 2).
    ``cps`` are the context-parallel degrees tried (:func:`.cluster_context.searched_cps` for a job),
    each cp > 1 in every mode of ``cp_mode`` (one mode or several); ep > 1 only at cp=1.
    Raises ValueError when no layout suits the model or nothing fits (naming the least memory any
    configuration needs).
    """
    check_counts(
        "plan_cluster",
        (
            ("num_nodes", num_nodes),
            ("global_batch_size", global_batch_size),
            ("max_microbatches", max_microbatches),
        ),
    )
    world = num_nodes * cluster.devices_per_node
    modes = (cp_mode,) if isinstance(cp_mode, str) else tuple(cp_mode)
    grid = (  # (dp, tp, pp, cp, cp_mode) ([Note: cluster cp terms])
        [(*lay, 1, modes[0]) for lay in layouts]
        if layouts is not None
        else cp_layouts(costs, cluster, world, global_batch_size=global_batch_size, cps=cps, cp_modes=modes)
    )
    if not grid:
        raise ValueError(
            f"plan_cluster: no (dp, tp, pp) with dp*tp*pp={world} suits this model: tp must divide "
            f"the {cluster.devices_per_node} devices per node, heads={costs.num_heads}, kv heads="
            f"{costs.num_kv_heads}, vocab={costs.vocab_size}; pp <= {costs.num_layers} layers; dp "
            f"must divide global_batch_size={global_batch_size}"
        )
    out: list[ClusterCandidate] = []
    least = math.inf
    memo: dict[Any, Any] = {}
    sizes_by_stages: dict[int, list[int]] = {}
    forward = [ly.forward_s for ly in costs.layers]
    bases = _base_choices(
        costs,
        grid,
        global_batch_size=global_batch_size,
        max_microbatches=max_microbatches,
        schedules=schedules,
        virtual_stages=virtual_stages,
        zero_stages=zero_stages,
        tp_overlaps=tp_overlaps,
    )
    for base in bases:
        stages = base.pp * base.virtual_stages
        if stages not in sizes_by_stages:
            sizes_by_stages[stages] = split_layers(forward, stages)
        seen: set[tuple[float, ...]] = set()
        for mode in recompute_modes:
            choice = dataclasses.replace(base, recompute=mode)
            c = predict_config(costs, cluster, choice, stage_layers=sizes_by_stages[stages], memo=memo)
            if c is None or c.recompute_fractions in seen:
                continue
            seen.add(c.recompute_fractions)
            least = min(least, max(c.stage_memory_bytes))
            if c.fits:
                out.append(c)
    if not out:
        raise ValueError(
            f"plan_cluster: nothing fits the usable {cluster.usable_memory_bytes / 1e9:.1f} GB per "
            f"device of {cluster.name}; the smallest configuration needs {least / 1e9:.1f} GB: add "
            "nodes, allow ZeRO-1 or recomputation, or shrink the batch"
        )
    out.sort(
        key=lambda c: (
            c.step_time_s,
            c.tp,
            c.layout,
            c.schedule,
            c.num_microbatches,
            c.recompute,
            c.zero_stage,
            c.tp_overlap,
        )
    )
    return out


def _bytes(n: float) -> str:
    return f"{n / 1e9:.1f}G" if n >= 1e9 else f"{n / 1e6:.1f}M"


def format_cluster_plan(cands: Sequence[ClusterCandidate], top: int = 10) -> str:
    """A ranked table with per-stage memory per device (G = 1e9 bytes, M = 1e6)."""

    def row(c: ClusterCandidate, rc: str) -> str:
        rc = rc if len(rc) <= 24 else rc[:21] + "..."
        mem = ",".join(_bytes(b) for b in c.stage_memory_bytes)
        if len(c.stage_memory_bytes) > 8:
            mem = f"max {_bytes(max(c.stage_memory_bytes))} over {len(c.stage_memory_bytes)} stages"
        return (
            f"{c.schedule_label:<22} {c.num_microbatches:>4} {c.micro_batch_size:>4} {c.zero_stage:>4} "
            f"{'yes' if c.tp_overlap else 'no':>6} {rc:<24} {c.step_time_s * 1e3:>10.3f}  "
            f"{mem} ({_bytes(c.memory_limit_bytes)})"
        )

    head = (
        f"{'schedule':<22} {'m':>4} {'mbs':>4} {'zero':>4} {'tp-ovl':>6} {'recompute':<24} {'step ms':>10}  "
        "memory per stage (usable)"
    )
    return "\n".join(ranked_rows(cands, top, head, row))
