"""Dry run at any scale: build, in one process, what every one of N ranks would build, and say
which rank would fail first and why.

:func:`dry_run` checks the layout (dp * tp * pp = N, tp dividing heads and vocabulary); ranks
build their :class:`~merak_core.parallel.layout.ParallelLayout` over torch's fake process group (no
communication: a group records its ranks, collectives do nothing), so the real group code runs
at 1024 ranks (every rank up to 64 ranks, a sample beyond: see [Note: dry-run groups]); it
partitions the model on the meta device (merak-graph) and gives each rank its stage, its schedule (built and validated by merak-pipe), its recomputation plan, the groups of
parameters tied across stages, and its memory against the cluster's device
(:mod:`.cluster_cost`). The report lists every problem; :attr:`DryRunReport.first_failure` is
the lowest rank that would fail.

Deliberately not done: running any computation, building the TP-sharded modules (TP divides
each stage's costs and memory by tp, see [Note: cluster model terms]), loading weights.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from merak_core.config.layout_choice import LayoutChoice
from merak_core.planner.cluster import ClusterSpec
from merak_core.planner.cluster_context import attach_attentions
from merak_core.planner.cluster_cost import model_costs, trace_for_cluster
from merak_core.planner.cluster_search import ClusterCandidate, _bytes, predict_config
from merak_core.planner.dryrun_groups import Groups as _Groups
from merak_core.planner.dryrun_groups import build_groups as _build_groups
from merak_core.planner.dryrun_groups import sample_ranks as _sample_ranks

__all__ = ["DryRunProblem", "DryRunReport", "RankPlan", "dry_run"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankPlan:
    """What one rank would build."""

    rank: int
    node: int
    stage: int
    dp_rank: int
    tp_rank: int
    dp_group: tuple[int, ...]
    tp_group: tuple[int, ...]
    pp_group: tuple[int, ...]
    schedule: str
    """This rank's actions in the schedule's compact form (e.g. ``0F0 0F1 0B0 ...``)."""
    recompute_fraction: float
    shared_groups: dict[str, tuple[int, ...]]
    """Tied parameter -> the ranks its gradient is all-reduced over (this rank included)."""
    memory_bytes: float
    ep_rank: int = 0
    """This rank's index in its expert-parallel group (0 at ep=1)."""
    ep_group: tuple[int, ...] = ()
    """The ranks between which this rank's tokens travel to their experts (empty at ep=1)."""
    expert_replica_group: tuple[int, ...] = ()
    """The ranks holding this rank's experts, over which their gradients are summed (empty at ep=1)."""
    cp_rank: int = 0
    cp_group: tuple[int, ...] = ()
    """The ranks sharing this rank's samples, each holding seq_len / cp of their tokens (empty at cp=1)."""


@dataclass(frozen=True)
class DryRunProblem:
    """Something that would fail (``fatal``) or cost time at run time."""

    rank: int
    stage: int | None
    kind: str
    message: str
    fatal: bool = True

    def __str__(self) -> str:
        where = f"rank {self.rank}" + (f" (stage {self.stage})" if self.stage is not None else "")
        return f"{'error' if self.fatal else 'note'} [{self.kind}] {where}: {self.message}"


@dataclass
class DryRunReport:
    """The dry run's result: per-rank plans, problems, and how long it took."""

    world_size: int
    degrees: tuple[int, int, int] | None
    cluster: str
    ranks: list[RankPlan] = field(default_factory=list)
    problems: list[DryRunProblem] = field(default_factory=list)
    prediction: ClusterCandidate | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    groups_backend: str = ""
    ep: int = 1
    cp: int = 1

    @property
    def first_failure(self) -> DryRunProblem | None:
        fatal = [p for p in self.problems if p.fatal]
        return min(fatal, key=lambda p: p.rank) if fatal else None

    @property
    def ok(self) -> bool:
        return self.first_failure is None

    def summary(self, show_ranks: int = 8) -> str:
        lines = [
            f"dry run: {self.world_size} ranks on {self.cluster}"
            + (f", dp={self.degrees[0]} tp={self.degrees[1]} pp={self.degrees[2]}" if self.degrees else "")
            + (f" ep={self.ep} (of dp)" if self.ep > 1 else "")
            + (f" cp={self.cp}" if self.cp > 1 else "")
        ]
        if self.ranks:
            lines.append(
                f"  built {len(self.ranks)} ranks' groups ({self.groups_backend}), partition, schedules and "
                "memory"
            )
            firsts = {p.stage: p.rank for p in reversed(self.ranks)}  # the first rank of each stage
            picks = sorted({*sorted(firsts.values())[:show_ranks], len(self.ranks) - 1})
            for r in picks:
                p = self.ranks[r]
                sched = p.schedule if len(p.schedule) <= 60 else p.schedule[:57] + "..."
                lines.append(
                    f"  rank {p.rank:>5} node {p.node:>4} stage {p.stage:>3} dp_rank {p.dp_rank:>4} tp_rank "
                    f"{p.tp_rank:>2}"
                    + (f" ep_rank {p.ep_rank:>2}" if self.ep > 1 else "")
                    + (f" cp_rank {p.cp_rank:>2}" if self.cp > 1 else "")
                    + " "
                    f"recompute {p.recompute_fraction:.2f} memory {_bytes(p.memory_bytes)}"
                    f"  [{sched}]"
                )
        if self.prediction is not None:
            c = self.prediction
            lines.append(
                f"  predicted step {c.step_time_s * 1e3:.3f} ms (pipeline {c.pipeline_s * 1e3:.3f} ms, DP "
                f"{c.dp_allreduce_s * 1e3:.3f} ms); memory per stage: "
                f"{','.join(_bytes(b) for b in c.stage_memory_bytes)} of {_bytes(c.memory_limit_bytes)} usable"
            )
        for prob in self.problems:
            lines.append(f"  {prob}")
        first = self.first_failure
        lines.append(f"  FIRST FAILURE: {first}" if first is not None else "  every rank would build and fit")
        lines.append("  seconds: " + ", ".join(f"{k} {v:.2f}" for k, v in self.seconds.items()))
        return "\n".join(lines)


def _check_layout(
    world_size: int,
    dp: int | None,
    tp: int,
    pp: int,
    cluster: ClusterSpec,
    heads: int | None,
    kv_heads: int | None,
    vocab: int | None,
    cp: int = 1,
) -> tuple[tuple[int, int, int] | None, list[DryRunProblem]]:
    from merak_core.parallel.rank_grid import resolve_degrees

    try:
        degrees = resolve_degrees(world_size, dp, tp, pp, cp=cp)
    except ValueError as exc:
        return None, [DryRunProblem(0, None, "layout", str(exc))]
    problems = []
    for label, v in (("heads", heads), ("kv heads", kv_heads), ("vocabulary", vocab)):
        if v is not None and v % tp:
            problems.append(
                DryRunProblem(
                    0,
                    0,
                    "layout",
                    f"tp={tp} does not divide the model's {label}={v}: choose tp among the divisors of {v}",
                )
            )
    if world_size % cluster.devices_per_node:
        problems.append(
            DryRunProblem(
                0,
                None,
                "layout",
                f"{world_size} ranks fill {world_size // cluster.devices_per_node}"
                f" nodes of {cluster.devices_per_node} and part of another",
                fatal=False,
            )
        )
    if cluster.devices_per_node % tp:
        problems.append(
            DryRunProblem(
                0,
                0,
                "layout",
                f"tp={tp} does not divide the {cluster.devices_per_node} devices "
                "per node: TP groups straddle nodes and their all-reduces cross the network",
                fatal=False,
            )
        )
    return degrees, problems


def dry_run(
    model: nn.Module,
    example_inputs: Sequence[Any] | Mapping[str, Any],
    cluster: ClusterSpec,
    *,
    world_size: int,
    dp: int | None = None,
    tp: int = 1,
    pp: int = 1,
    schedule: str = "1f1b",
    num_microbatches: int = 1,
    micro_batch_size: int = 1,
    recompute: str = "none",
    zero_stage: int = 0,
    tp_overlap: bool = False,
    tp_chunks: int = 2,
    fake_pg_ranks: int = 64,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    vocab_size: int | None = None,
    dtype: str = "bf16",
    ep: int = 1,
    cp: int = 1,
    cp_mode: str = "ring",
) -> DryRunReport:
    """Build what each of ``world_size`` ranks would build for this job; never raises for a bad job.

    ``model`` is best built on the meta device (``merak_graph.empty_init()``); ``example_inputs``
    hold one sample (meta tensors are fine); costs and memory scale by ``micro_batch_size``.
    Up to ``fake_pg_ranks`` ranks build their groups over the fake process group (all of them when
    ``world_size`` is not larger; see [Note: dry-run groups]).
    """
    import merak_graph as mg
    from merak_pipe import build_schedule, schedule_info

    t0 = time.perf_counter()
    degrees, problems = _check_layout(
        world_size, dp, tp, pp, cluster, num_heads, num_kv_heads, vocab_size, cp
    )
    report = DryRunReport(
        world_size=world_size, degrees=degrees, cluster=cluster.name, problems=problems, ep=ep, cp=cp
    )
    if degrees is None:
        return report
    from merak_core.parallel.rank_grid import check_ep

    try:
        check_ep(degrees[0], ep)
        if cp > 1 and ep > 1:
            raise ValueError(f"cp={cp} with ep={ep}: the dry run does not model both; dry-run one of them")
    except ValueError as exc:
        report.problems.append(DryRunProblem(0, None, "layout", str(exc)))
        return report
    dp, tp, pp = degrees
    if not schedule_info(schedule).one_stage_per_rank:
        report.problems.append(
            DryRunProblem(
                0,
                None,
                "schedule",
                f"{schedule} (several stages per rank) is not dry-run: the dry run builds one stage per "
                "rank; use 1f1b or shifted_critical_path",
            )
        )
        return report
    if num_microbatches < pp:
        report.problems.append(
            DryRunProblem(
                0,
                None,
                "schedule",
                f"num_microbatches={num_microbatches} < pp={pp}: "
                "every stage needs a microbatch; raise gradient_accumulation_steps",
            )
        )
        return report
    sharded = trace_for_cluster(model, example_inputs, cluster, dtype=dtype)
    report.seconds["trace"] = time.perf_counter() - t0
    try:
        part = mg.partition_sharded(sharded, pp, model=model)
    except mg.PartitionError as exc:
        report.problems.append(DryRunProblem(0, None, "partition", str(exc)))
        return report
    costs = attach_attentions(
        model_costs(
            sharded, model, dtype=dtype, num_heads=num_heads, num_kv_heads=num_kv_heads, vocab_size=vocab_size
        ),
        model,
    )  # at cp > 1 each attention's exchanges are priced ([Note: cluster cp terms])
    sizes = [part.bounds[s + 1] - part.bounds[s] for s in range(pp)]
    t1 = time.perf_counter()
    choice = LayoutChoice(
        dp=dp,
        tp=tp,
        pp=pp,
        schedule=schedule,
        num_microbatches=num_microbatches,
        micro_batch_size=micro_batch_size,
        recompute=recompute,
        zero_stage=zero_stage,
        tp_overlap=tp_overlap,
        ep=ep if costs.moe is not None else 1,  # the all-to-alls and experts / ep (planner.expert_cost)
        cp=cp,
        cp_mode=cp_mode,
    )
    cand = predict_config(costs, cluster, choice, tp_chunks=tp_chunks, stage_layers=sizes)
    if cand is None:  # stage-aware recomputation cannot fit: report with full recomputation
        report.problems.append(
            DryRunProblem(
                0,
                0,
                "memory",
                "stage-aware recomputation cannot fit the device even "
                "recomputing everything (see the memory per stage)",
            )
        )
        full = dataclasses.replace(choice, recompute="full")
        cand = predict_config(costs, cluster, full, tp_chunks=tp_chunks, stage_layers=sizes)
    assert cand is not None
    report.prediction = cand
    from merak_pipe import RecomputePlan

    sched = build_schedule(
        schedule if pp > 1 else "1f1b",
        num_stages=pp,
        num_microbatches=num_microbatches,
        recompute=RecomputePlan(cand.recompute_fractions),
    )
    per_stage_actions = [" ".join(str(a) for a in sched.actions[sched.stage_to_rank[s]]) for s in range(pp)]
    report.seconds["partition+schedule"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    groups, report.groups_backend = _build_groups(
        world_size, dp, tp, pp, _sample_ranks(world_size, dp, tp, pp, fake_pg_ranks, cp), cp
    )
    report.seconds["groups"] = time.perf_counter() - t2
    shared = {s.name: sorted({st for st, _ in s.stages}) for s in part.shared_parameters}
    _rank_plans(report, cluster, groups, cand, per_stage_actions, shared, costs.param_numel, tp)
    if ep > 1:
        _add_ep_groups(report, dp, tp, ep)
    report.seconds["total"] = time.perf_counter() - t0
    return report


def _add_ep_groups(report: DryRunReport, dp: int, tp: int, ep: int) -> None:
    """Each rank's EP and expert-replica groups, from the layout's rank formula ([Note: expert-parallel groups])."""
    import dataclasses

    from merak_core.parallel.rank_grid import coords_of, rank_of

    for i, plan in enumerate(report.ranks):
        stage, dp_rank, tp_rank = coords_of(plan.rank, dp=dp, tp=tp)
        first = dp_rank - dp_rank % ep
        report.ranks[i] = dataclasses.replace(
            plan,
            ep_rank=dp_rank % ep,
            ep_group=tuple(rank_of(stage, first + j, tp_rank, dp=dp, tp=tp) for j in range(ep)),
            expert_replica_group=tuple(
                rank_of(stage, b * ep + dp_rank % ep, tp_rank, dp=dp, tp=tp) for b in range(dp // ep)
            ),
        )


def _rank_plans(
    report: DryRunReport,
    cluster: ClusterSpec,
    groups: dict[int, _Groups],
    cand: ClusterCandidate,
    actions: list[str],
    shared: dict[str, list[int]],
    numel: dict[str, int],
    tp: int,
) -> None:
    from merak_core.parallel.rank_grid import coords_of

    dp = cand.dp
    limit = cluster.usable_memory_bytes
    reported_tie: set[str] = set()
    for r in range(report.world_size):
        stage, dp_rank, tp_rank = coords_of(r, dp=dp, tp=tp, cp=cand.cp)
        dpg, tpg, ppg, cpg = groups[r]
        ties = {name: tuple(ppg[s] for s in stages) for name, stages in shared.items() if stage in stages}
        mem = cand.stage_memory_bytes[stage]
        report.ranks.append(
            RankPlan(
                rank=r,
                node=cluster.node_of(r),
                stage=stage,
                dp_rank=dp_rank,
                tp_rank=tp_rank,
                dp_group=dpg,
                tp_group=tpg,
                pp_group=ppg,
                schedule=actions[stage],
                recompute_fraction=cand.recompute_fractions[stage],
                shared_groups=ties,
                memory_bytes=mem,
                cp_rank=cpg.index(r) if cpg else 0,
                cp_group=cpg,
            )
        )
        if mem > limit:
            report.problems.append(
                DryRunProblem(
                    r,
                    stage,
                    "memory",
                    f"stage {stage} needs {mem / 1e9:.2f} GB per device (weights, gradients and "
                    f"optimizer {cand.stage_static_bytes[stage] / 1e9:.2f} GB + activations) but {cluster.device_name or 'the device'} "
                    f"has {limit / 1e9:.2f} GB usable: raise pp or tp, use ZeRO-1, recomputation or fewer microbatches "
                    "in flight",
                )
            )
            limit = float("inf")  # one memory problem per job: the lowest rank
        for name, ranks in ties.items():
            nodes = sorted({cluster.node_of(x) for x in ranks})
            if len(nodes) > 1 and name not in reported_tie:
                reported_tie.add(name)
                report.problems.append(
                    DryRunProblem(
                        r,
                        stage,
                        "shared-parameter",
                        f"{name!r} is tied across stages {sorted(shared[name])} on nodes "
                        f"{nodes} (ranks {list(ranks)}): its gradient ({numel[name] / tp * 4 / 1e6:.1f} MB per rank) is "
                        "all-reduced over the network every step",
                        fatal=False,
                    )
                )
