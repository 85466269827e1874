"""The search: every (dp, tp, pp), microbatch count, schedule and recomputation, predicted and ranked.

See the package docstring (:mod:`merak_core.planner`) for the cost model and its limits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from merak_core.planner.comm import CommModel
from merak_core.planner.memory import ZERO_STAGES, model_state_bytes
from merak_core.planner.profile import ModelProfile
from merak_pipe import schedule_info, schedule_infos

__all__ = [
    "PLANNER_SCHEDULES",
    "RECOMPUTE_MODES",
    "Candidate",
    "format_plan",
    "plan",
    "predict",
    "split_layers",
    "why_best",
]

PLANNER_SCHEDULES = tuple(info.key for info in schedule_infos() if info.one_stage_per_rank)
"""Schedules the Trainer runs with one stage per rank (config spelling): the registry's, in its order."""
RECOMPUTE_MODES = ("none", "full", "stage_aware")
VIRTUAL_STAGE_SCHEDULES = tuple(info.key for info in schedule_infos() if not info.one_stage_per_rank)
"""Schedules with several stages per rank, planned with ``virtual_stages`` when :func:`plan` is given v > 1."""


@dataclass(frozen=True)
class Candidate:
    """One planned configuration with its predictions."""

    dp: int
    tp: int
    pp: int
    schedule: str
    num_microbatches: int
    micro_batch_size: int
    recompute: str
    recompute_fractions: tuple[float, ...]
    stage_layers: tuple[int, ...]
    """Layers per stage (contiguous)."""
    step_time_s: float
    pipeline_s: float
    dp_allreduce_s: float
    peak_memory_bytes: tuple[float, ...]
    """Per stage: static (weights, gradients, optimizer) + simulated activation peak."""
    memory_per_device: float = field(default=0.0, repr=False)
    stage_forward_s: tuple[float, ...] = ()
    """Predicted forward seconds of one microbatch, per stage, as a run measures them (ranks sharing
    cores included, TP all-reduces included)."""
    stage_backward_s: tuple[float, ...] = ()
    """Predicted backward seconds of one microbatch, per stage, likewise (without recomputation)."""
    overhead_s: float = 0.0
    """Predicted seconds per step outside the pipeline and the DP all-reduce (optimizer, clipping, loss)."""
    virtual_stages: int = 1
    """Pipeline stages per rank (``pp * virtual_stages`` stages; the per-stage tuples have that many)."""
    device_peak_bytes: tuple[float, ...] = ()
    """Per pipeline rank: its stages' static bytes plus the simulated activation peak of the rank
    (what ``memory_per_device`` bounds); the per-stage peaks when each rank holds one stage."""

    @property
    def layout(self) -> str:
        return f"dp{self.dp}-tp{self.tp}-pp{self.pp}"

    def training_fields(self) -> dict[str, Any]:
        """The job file's ``training`` fields for this choice."""
        out: dict[str, Any] = {
            "dp": self.dp,
            "tp": self.tp,
            "pp": self.pp,
            "schedule": self.schedule,
            "per_device_train_batch_size": self.micro_batch_size,
            "gradient_accumulation_steps": self.num_microbatches,
            "recompute": self.recompute,
        }
        if self.recompute == "stage_aware":
            out["memory_budget"] = int(self.memory_per_device)
        if self.virtual_stages > 1:
            out["virtual_stages"] = self.virtual_stages
        return out


def _sort_key(c: Candidate) -> tuple[Any, ...]:
    order = PLANNER_SCHEDULES + VIRTUAL_STAGE_SCHEDULES
    return (
        float(f"{c.step_time_s:.9g}"),
        c.tp,
        c.layout,
        order.index(c.schedule),
        c.num_microbatches,
        RECOMPUTE_MODES.index(c.recompute),
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


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
class _Layout:
    """What one (dp, tp, pp) fixes, whatever the schedule and microbatches."""

    dp: int
    tp: int
    pp: int
    sizes: list[int]
    fwd1: list[float]  # per stage, one sample, divided by tp
    bwd1: list[float]
    act1: list[list[float]]  # per stage, per layer, one sample, divided by tp
    layers: list[int]  # layers per stage (len of each stage range)
    static: list[float]  # weights + grads + optimizer states per stage
    dp_allreduce_s: float
    optimizer_s: float  # optimizer step over this rank's parameters (uncontended)
    step_comm_s: float  # the gradient-norm and loss all-reduces over every rank
    zero_stage: int = 0
    optimizer_state_factor: float = 2.0


def _layout(
    profile: ModelProfile,
    comm: CommModel,
    dp: int,
    tp: int,
    pp: int,
    zero_stage: int,
    optimizer_state_factor: float,
    virtual_stages: int = 1,
) -> _Layout:
    num_stages = pp * virtual_stages
    sizes = split_layers(profile.layer_forward_s, num_stages)
    bounds = [sum(sizes[:s]) for s in range(num_stages + 1)]
    stage = [range(bounds[s], bounds[s + 1]) for s in range(num_stages)]
    params = [sum(profile.layer_param_bytes[i] for i in r) / tp for r in stage]
    if pp == 1:  # one stage holds the first and the last layer: a tied embedding once
        params[0] -= profile.shared_param_bytes / tp
    opt_div = dp if zero_stage >= 1 else 1
    static = [
        sum(
            model_state_bytes(
                p,
                zero_stage=zero_stage,
                dp=dp,
                optimizer_state_factor=optimizer_state_factor,
                largest_unit_bytes=max(profile.layer_param_bytes[i] for i in r) / tp,
            )
        )
        for p, r in zip(params, stage, strict=True)
    ]
    world = dp * tp * pp
    # Per step outside the pipeline: the optimizer over this rank's parameters (its share under
    # ZeRO-1), the gradient-norm all-reduce and the loss all-reduce over every rank.
    # A rank holds every pp-th stage (round-robin; a V holds the same amount up to rounding).
    rank_params = [sum(params[s] for s in range(num_stages) if s % pp == r) for r in range(pp)]
    optimizer = max(rank_params) / opt_div * profile.optimizer_s_per_byte
    return _Layout(
        dp=dp,
        tp=tp,
        pp=pp,
        sizes=sizes,
        fwd1=[sum(profile.layer_forward_s[i] for i in r) / tp for r in stage],
        bwd1=[sum(profile.layer_backward_s[i] for i in r) / tp for r in stage],
        act1=[[profile.layer_activation_bytes[i] / tp for i in r] for r in stage],
        layers=[len(r) for r in stage],
        static=static,
        dp_allreduce_s=max(comm.allreduce_s(p, dp) for p in rank_params) + _wait(comm, dp),
        optimizer_s=optimizer,
        step_comm_s=2 * (comm.allreduce_s(8.0, world) + _wait(comm, world)),
        zero_stage=zero_stage,
        optimizer_state_factor=optimizer_state_factor,
    )


def _wait(comm: CommModel, group_size: int) -> float:
    """The scheduling wait of one synchronising collective over ``group_size`` ranks (none alone)."""
    return comm.sync_wait_s if group_size > 1 else 0.0


def _contended(seconds: float, busy_ranks: int, compute_slots: float | None) -> float:
    """Time of work that ``busy_ranks`` ranks do at once on ``compute_slots`` cores (None: a device each)."""
    if compute_slots is None or busy_ranks <= compute_slots:
        return seconds
    return seconds * busy_ranks / compute_slots


def _evaluate(
    profile: ModelProfile,
    comm: CommModel,
    lay: _Layout,
    *,
    schedule: str,
    num_microbatches: int,
    micro_batch_size: int,
    recompute: str,
    memory_per_device: float,
    compute_slots: float | None,
) -> Candidate | None:
    """Predict one configuration; None when stage-aware recomputation cannot fit the memory."""
    from merak_pipe import CostModel, build_schedule, simulate, stage_aware_plan
    from merak_pipe.recompute import RecomputePlan

    pp, m, b = lay.pp, num_microbatches, micro_batch_size
    num_stages = len(lay.sizes)  # pp * virtual stages
    tp_comm = [
        2 * n * (comm.allreduce_s(b * profile.boundary_bytes, lay.tp) + _wait(comm, lay.tp))
        for n in lay.layers
    ]
    # The fixed per-microbatch cost (operator dispatch) belongs to the layers' operators: each stage
    # pays its share (by layer count), and a TP shard runs every operator of its layers.
    half = [profile.microbatch_overhead_s / 2 * n / profile.num_layers for n in lay.layers]
    world = lay.dp * lay.tp * pp
    # [Note: compute slots] Ranks that share cores (CPU processes) slow each other's compute down
    # by world / compute_slots, on the critical path too: the replicas of a stage (DP, TP) run and
    # wait at the same moments, so one pipeline's idle time is rarely another's compute time.
    # Waiting for communication is not CPU work and is not slowed down.
    slow = world / compute_slots if compute_slots is not None and world > compute_slots else 1.0
    k = profile.tp_scale.get(lay.tp, 1.0)  # measured against modelled at this TP degree (1: not measured)
    fwd = [((h + b * f) * slow + c) * k for h, f, c in zip(half, lay.fwd1, tp_comm, strict=True)]
    bwd = [((h + b * x) * slow + c) * k for h, x, c in zip(half, lay.bwd1, tp_comm, strict=True)]
    costs = CostModel(
        forward=fwd,
        backward=bwd,
        recompute=fwd,
        p2p_latency=comm.p2p_latency_s + comm.sync_wait_s if pp > 1 else 0.0,
        p2p_bandwidth=comm.p2p_bandwidth,
        boundary_bytes=b * profile.boundary_bytes,
        activation_bytes=[b * sum(a) for a in lay.act1],
        input_bytes=b * profile.boundary_bytes,
    )
    name = schedule_info(schedule).name
    if recompute == "stage_aware":
        if pp < 2:
            return None
        base = build_schedule(name, num_stages=num_stages, num_ranks=pp, num_microbatches=m)
        try:
            rplan = stage_aware_plan(
                layer_activation_bytes=[[b * a for a in layer] for layer in lay.act1],
                memory_budget=float(memory_per_device),
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
        dp=lay.dp,
        tp=lay.tp,
        pp=pp,
        schedule=schedule,
        num_microbatches=m,
        micro_batch_size=b,
        recompute=recompute,
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
        virtual_stages=num_stages // pp,
        device_peak_bytes=device,
    )


def _held_once(profile: ModelProfile, lay: _Layout, stage_to_rank: Sequence[int]) -> list[float]:
    """Static bytes per stage, less the tied copy on the last stage when the first stage's rank holds it
    too (ZB-V: one local parameter; see merak_core.planner.memory)."""
    static = list(lay.static)
    last = len(static) - 1
    if last > 0 and stage_to_rank[0] == stage_to_rank[last] and profile.shared_param_bytes:
        p = profile.shared_param_bytes / lay.tp
        static[last] -= sum(
            model_state_bytes(
                p, zero_stage=lay.zero_stage, dp=lay.dp, optimizer_state_factor=lay.optimizer_state_factor
            )
        )
    return static


def _check_common(memory_per_device: float, zero_stage: int, compute_slots: float | None) -> None:
    if not memory_per_device > 0:
        raise ValueError(f"memory_per_device={memory_per_device!r}; expected bytes > 0")
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage={zero_stage!r}; expected one of {ZERO_STAGES}")
    if compute_slots is not None and (
        not isinstance(compute_slots, (int, float))
        or isinstance(compute_slots, bool)
        or not 1 <= compute_slots < math.inf
    ):
        raise ValueError(
            f"compute_slots={compute_slots!r}; expected a number >= 1 (ranks that can compute at once "
            "on one host: its cores, or world_size / measure_contention(...)), or None when every rank "
            "has its own device"
        )


def predict(
    profile: ModelProfile,
    *,
    dp: int,
    tp: int,
    pp: int,
    schedule: str,
    num_microbatches: int,
    micro_batch_size: int,
    recompute: str = "none",
    comm: CommModel | None = None,
    memory_per_device: float = math.inf,
    zero_stage: int = 0,
    optimizer_state_factor: float = 2.0,
    compute_slots: float | None = None,
    virtual_stages: int = 1,
) -> Candidate:
    """The planner's prediction for one given configuration (whether or not it fits the memory).

    Same cost model as :func:`plan`; ``compute_slots`` is how many ranks can compute at once on
    the host (CPU cores per host when ranks are CPU processes; None: one device per rank).
    """
    comm = comm or CommModel()
    _check_common(memory_per_device, zero_stage, compute_slots)
    for name, v in (
        ("dp", dp),
        ("tp", tp),
        ("pp", pp),
        ("num_microbatches", num_microbatches),
        ("micro_batch_size", micro_batch_size),
    ):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"predict: {name}={v!r}; expected an int >= 1")
    allowed = PLANNER_SCHEDULES if virtual_stages == 1 else VIRTUAL_STAGE_SCHEDULES
    if schedule not in allowed:
        raise ValueError(
            f"predict: schedule {schedule!r} with virtual_stages={virtual_stages} is not one of {allowed}"
        )
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"predict: recompute {recompute!r} is not one of {RECOMPUTE_MODES}")
    if pp * virtual_stages > profile.num_layers:
        raise ValueError(
            f"predict: pp={pp} x virtual_stages={virtual_stages} stages but the profile has "
            f"{profile.num_layers} layers; use pp * virtual_stages <= layers"
        )
    lay = _layout(profile, comm, dp, tp, pp, zero_stage, optimizer_state_factor, virtual_stages)
    if recompute == "stage_aware" and pp < 2:
        recompute = "none"
    cand = _evaluate(
        profile,
        comm,
        lay,
        schedule=schedule if pp > 1 else "1f1b",
        num_microbatches=num_microbatches,
        micro_batch_size=micro_batch_size,
        recompute=recompute,
        memory_per_device=memory_per_device,
        compute_slots=compute_slots,
    )
    if cand is None:
        raise ValueError(
            f"predict: stage-aware recomputation cannot fit memory_per_device={memory_per_device:.6g} "
            "bytes for this configuration; raise the memory or use recompute='full'"
        )
    return cand


def plan(
    profile: ModelProfile,
    *,
    world_size: int,
    memory_per_device: float,
    global_batch_size: int,
    comm: CommModel | None = None,
    zero_stage: int = 0,
    optimizer_state_factor: float = 2.0,
    schedules: Sequence[str] = PLANNER_SCHEDULES,
    recompute_modes: Sequence[str] = RECOMPUTE_MODES,
    max_microbatches: int = 64,
    compute_slots: float | None = None,
    virtual_stages: Sequence[int] = (1,),
) -> list[Candidate]:
    """Every feasible configuration, best predicted step time first.

    ``memory_per_device`` is bytes; ``optimizer_state_factor`` is optimizer-state bytes per
    parameter byte (2 for Adam in the parameters' dtype); ``compute_slots`` is how many ranks can
    compute at once on one host (CPU cores when the ranks are CPU processes; None: a device per
    rank). Ties in step time are broken by fewer TP ranks, then the layout string, schedule,
    microbatches and recompute mode.
    Raises ValueError on invalid inputs, or when nothing fits (naming the least memory needed).
    """
    comm = comm or CommModel()
    for name, v in (
        ("world_size", world_size),
        ("global_batch_size", global_batch_size),
        ("max_microbatches", max_microbatches),
    ):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"plan: {name}={v!r}; expected an int >= 1")
    try:
        _check_common(memory_per_device, zero_stage, compute_slots)
    except ValueError as exc:
        raise ValueError(f"plan: {exc}") from None
    for s in schedules:
        if s not in PLANNER_SCHEDULES:
            raise ValueError(f"plan: schedule {s!r} is not one of {PLANNER_SCHEDULES}")
    for r in recompute_modes:
        if r not in RECOMPUTE_MODES:
            raise ValueError(f"plan: recompute mode {r!r} is not one of {RECOMPUTE_MODES}")

    out: list[Candidate] = []
    least_needed = math.inf
    layouts_tried = 0
    for tp in _divisors(world_size):
        if not profile.tp_allowed(tp):
            continue
        for pp in _divisors(world_size // tp):
            if pp > profile.num_layers:
                continue
            dp = world_size // (tp * pp)
            if global_batch_size % dp:
                continue
            layouts_tried += 1
            lays = {
                v: _layout(profile, comm, dp, tp, pp, zero_stage, optimizer_state_factor, v)
                for v in sorted(set(virtual_stages))
                if v == 1 or 1 < pp and pp * v <= profile.num_layers
            }
            per_dp = global_batch_size // dp
            for m in _divisors(per_dp):
                if m > max_microbatches or m < pp:  # the Trainer needs a microbatch per stage at least
                    continue
                for sched, v in _runs(pp, schedules, lays):
                    lay = lays[v]
                    seen: set[tuple[float, ...]] = set()
                    for mode in recompute_modes:
                        cand = _evaluate(
                            profile,
                            comm,
                            lay,
                            schedule=sched,
                            num_microbatches=m,
                            micro_batch_size=per_dp // m,
                            recompute=mode,
                            memory_per_device=memory_per_device,
                            compute_slots=compute_slots,
                        )
                        if cand is None or cand.recompute_fractions in seen:
                            continue
                        seen.add(cand.recompute_fractions)
                        least_needed = min(least_needed, max(cand.device_peak_bytes))
                        if max(cand.device_peak_bytes) > memory_per_device:
                            continue
                        out.append(cand)
    if layouts_tried == 0:
        raise ValueError(
            f"plan: no (dp, tp, pp) with dp*tp*pp={world_size} suits this model: tp must divide heads="
            f"{profile.num_heads}, kv heads={profile.num_kv_heads}, vocab={profile.vocab_size}; pp <= layers="
            f"{profile.num_layers}; dp must divide global_batch_size={global_batch_size}. Change world_size or the "
            "batch size"
        )
    if not out:
        raise ValueError(
            f"plan: nothing fits in memory_per_device={memory_per_device:.6g} bytes; the smallest configuration needs "
            f"{least_needed:.6g} bytes per device: raise the memory, add devices or shrink the batch"
        )
    out.sort(key=_sort_key)
    return out


def _runs(pp: int, schedules: Sequence[str], lays: dict[int, _Layout]) -> list[tuple[str, int]]:
    """(schedule, virtual stages) pairs to try at ``pp``: the given one-stage schedules, and with v > 1 the
    registry's schedules that place v stages per rank."""
    if pp == 1:
        return [("1f1b", 1)]
    runs = [(sched, 1) for sched in schedules] if 1 in lays else []
    for v in sorted(lays):
        if v > 1:
            runs += [
                (sched, v)
                for sched in VIRTUAL_STAGE_SCHEDULES
                if schedule_info(sched).stages_per_rank in (None, v)
            ]
    return runs


def why_best(cands: Sequence[Candidate]) -> str:
    """One line on why the first candidate wins."""
    if not cands:
        return ""
    top = cands[0]
    text = (
        f"{top.layout} {top.schedule} m={top.num_microbatches} recompute={top.recompute}: predicted "
        f"{top.step_time_s * 1e3:.3f} ms (pipeline {top.pipeline_s * 1e3:.3f} ms + DP all-reduce "
        f"{top.dp_allreduce_s * 1e3:.3f} ms + optimizer/clip/loss {top.overhead_s * 1e3:.3f} ms), peak {max(top.peak_memory_bytes) / 2**20:.1f} MiB"
    )
    other = next((c for c in cands[1:] if c.layout != top.layout), None)
    if other is not None:
        gain = 100 * (other.step_time_s / top.step_time_s - 1) if top.step_time_s > 0 else 0.0
        text += f"; {gain:.1f}% faster than the best other layout ({other.layout}, {other.schedule})"
    else:
        text += "; the only layout that fits"
    return text


def format_plan(cands: Sequence[Candidate], top: int = 10) -> str:
    """A ranked table of the first ``top`` candidates, then why the first wins."""
    lines = [
        f"{'#':>3} {'layout':<14} {'schedule':<22} {'m':>3} {'mbs':>4} {'recompute (per stage)':<28} "
        f"{'step ms':>9}  peak MiB per stage"
    ]
    for i, c in enumerate(cands[:top], 1):
        rc = (
            c.recompute
            if c.recompute != "stage_aware"
            else "sa:" + ",".join(f"{f:.2f}" for f in c.recompute_fractions)
        )
        peaks = ",".join(f"{p / 2**20:.1f}" for p in c.peak_memory_bytes)
        sched = c.schedule + (f" v={c.virtual_stages}" if c.virtual_stages > 1 else "")
        lines.append(
            f"{i:>3} {c.layout:<14} {sched:<22} {c.num_microbatches:>3} {c.micro_batch_size:>4} "
            f"{rc:<28} {c.step_time_s * 1e3:>9.3f}  {peaks}"
        )
    lines.append("why: " + why_best(cands))
    return "\n".join(lines)
