"""The search: every (dp, tp, pp), microbatch count, schedule and recomputation, predicted and ranked.

See the package docstring (:mod:`merak_core.planner`) for the cost model and its limits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from merak_core.planner.comm import CommModel
from merak_core.planner.profile import ModelProfile

__all__ = ["PLANNER_SCHEDULES", "RECOMPUTE_MODES", "Candidate", "format_plan", "plan", "split_layers", "why_best"]

PLANNER_SCHEDULES = ("gpipe", "1f1b", "zb_h1", "shifted_critical_path")
"""Schedules the Trainer runs with one stage per rank (config spelling)."""
RECOMPUTE_MODES = ("none", "full", "stage_aware")


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

    @property
    def layout(self) -> str:
        return f"dp{self.dp}-tp{self.tp}-pp{self.pp}"

    def training_fields(self) -> dict[str, Any]:
        """The job file's ``training`` fields for this choice."""
        out: dict[str, Any] = {"dp": self.dp, "tp": self.tp, "pp": self.pp, "schedule": self.schedule,
                               "per_device_train_batch_size": self.micro_batch_size,
                               "gradient_accumulation_steps": self.num_microbatches, "recompute": self.recompute}
        if self.recompute == "stage_aware":
            out["memory_budget"] = int(self.memory_per_device)
        return out


def _sort_key(c: Candidate) -> tuple[Any, ...]:
    return (float(f"{c.step_time_s:.9g}"), c.tp, c.layout, PLANNER_SCHEDULES.index(c.schedule), c.num_microbatches,
            RECOMPUTE_MODES.index(c.recompute))


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
) -> list[Candidate]:
    """Every feasible configuration, best predicted step time first.

    ``memory_per_device`` is bytes; ``optimizer_state_factor`` is optimizer-state bytes per
    parameter byte (2 for Adam in the parameters' dtype). Ties in step time are broken by fewer
    TP ranks, then the layout string, schedule, microbatches and recompute mode.
    Raises ValueError on invalid inputs, or when nothing fits (naming the least memory needed).
    """
    from merak_pipe import CostModel, build_schedule, simulate, stage_aware_plan
    from merak_pipe.recompute import RecomputePlan

    comm = comm or CommModel()
    for name, v in (("world_size", world_size), ("global_batch_size", global_batch_size),
                    ("max_microbatches", max_microbatches)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"plan: {name}={v!r}; expected an int >= 1")
    if not memory_per_device > 0:
        raise ValueError(f"plan: memory_per_device={memory_per_device!r}; expected bytes > 0")
    if zero_stage not in (0, 1):
        raise ValueError(f"plan: zero_stage={zero_stage!r}; expected 0 or 1")
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
            sizes = split_layers(profile.layer_forward_s, pp)
            bounds = [sum(sizes[:s]) for s in range(pp + 1)]
            stage = [range(bounds[s], bounds[s + 1]) for s in range(pp)]
            fwd1 = [sum(profile.layer_forward_s[i] for i in r) / tp for r in stage]
            bwd1 = [sum(profile.layer_backward_s[i] for i in r) / tp for r in stage]
            act1 = [[profile.layer_activation_bytes[i] / tp for i in r] for r in stage]
            params = [sum(profile.layer_param_bytes[i] for i in r) / tp for r in stage]
            opt_div = dp if zero_stage == 1 else 1
            static = [p * 2 + p * optimizer_state_factor / opt_div for p in params]
            dp_ar = max(comm.allreduce_s(p, dp) for p in params)
            per_dp = global_batch_size // dp
            for m in _divisors(per_dp):
                if m > max_microbatches or m < pp:  # the Trainer needs a microbatch per stage at least
                    continue
                b = per_dp // m
                tp_comm_f = [2 * len(r) * comm.allreduce_s(b * profile.boundary_bytes, tp) for r in stage]
                half = profile.microbatch_overhead_s / 2
                fwd = [half + b * f + c for f, c in zip(fwd1, tp_comm_f, strict=True)]
                bwd = [half + b * x + c for x, c in zip(bwd1, tp_comm_f, strict=True)]
                costs = CostModel(
                    forward=fwd, backward=bwd, recompute=fwd,
                    p2p_latency=comm.p2p_latency_s if pp > 1 else 0.0,
                    p2p_bandwidth=comm.p2p_bandwidth,
                    boundary_bytes=b * profile.boundary_bytes,
                    activation_bytes=[b * sum(a) for a in act1],
                    input_bytes=b * profile.boundary_bytes,
                )
                for sched in (schedules if pp > 1 else ("1f1b",)):
                    seen: set[tuple[float, ...]] = set()
                    for mode in recompute_modes:
                        if mode == "stage_aware":
                            if pp < 2:
                                continue
                            base = build_schedule(sched.replace("_", "-"), num_stages=pp, num_microbatches=m)
                            try:
                                rplan = stage_aware_plan(
                                    layer_activation_bytes=[[b * a for a in layer] for layer in act1],
                                    memory_budget=float(memory_per_device), static_bytes=static, schedule=base,
                                    input_bytes=b * profile.boundary_bytes)
                            except ValueError:
                                continue
                        elif mode == "full":
                            rplan = RecomputePlan.full(pp)
                        else:
                            rplan = RecomputePlan.none(pp)
                        fractions = tuple(float(rplan[s]) for s in range(pp))
                        if fractions in seen:
                            continue
                        seen.add(fractions)
                        schedule = build_schedule(sched.replace("_", "-"), num_stages=pp, num_microbatches=m,
                                                  recompute=rplan)
                        result = simulate(schedule, costs)
                        peak = tuple(st + a for st, a in zip(static, result.peak_memory, strict=True))
                        least_needed = min(least_needed, max(peak))
                        if max(peak) > memory_per_device:
                            continue
                        out.append(Candidate(
                            dp=dp, tp=tp, pp=pp, schedule=sched, num_microbatches=m, micro_batch_size=b,
                            recompute=mode, recompute_fractions=fractions, stage_layers=tuple(sizes),
                            step_time_s=result.makespan + dp_ar, pipeline_s=result.makespan, dp_allreduce_s=dp_ar,
                            peak_memory_bytes=peak, memory_per_device=float(memory_per_device)))
    if layouts_tried == 0:
        raise ValueError(
            f"plan: no (dp, tp, pp) with dp*tp*pp={world_size} suits this model: tp must divide heads="
            f"{profile.num_heads}, kv heads={profile.num_kv_heads}, vocab={profile.vocab_size}; pp <= layers="
            f"{profile.num_layers}; dp must divide global_batch_size={global_batch_size}. Change world_size or the "
            "batch size")
    if not out:
        raise ValueError(
            f"plan: nothing fits in memory_per_device={memory_per_device:.6g} bytes; the smallest configuration needs "
            f"{least_needed:.6g} bytes per device: raise the memory, add devices or shrink the batch")
    out.sort(key=_sort_key)
    return out


def why_best(cands: Sequence[Candidate]) -> str:
    """One line on why the first candidate wins."""
    if not cands:
        return ""
    top = cands[0]
    text = (f"{top.layout} {top.schedule} m={top.num_microbatches} recompute={top.recompute}: predicted "
            f"{top.step_time_s * 1e3:.3f} ms (pipeline {top.pipeline_s * 1e3:.3f} ms + DP all-reduce "
            f"{top.dp_allreduce_s * 1e3:.3f} ms), peak {max(top.peak_memory_bytes) / 2**20:.1f} MiB")
    other = next((c for c in cands[1:] if c.layout != top.layout), None)
    if other is not None:
        gain = 100 * (other.step_time_s / top.step_time_s - 1) if top.step_time_s > 0 else 0.0
        text += f"; {gain:.1f}% faster than the best other layout ({other.layout}, {other.schedule})"
    else:
        text += "; the only layout that fits"
    return text


def format_plan(cands: Sequence[Candidate], top: int = 10) -> str:
    """A ranked table of the first ``top`` candidates, then why the first wins."""
    lines = [f"{'#':>3} {'layout':<14} {'schedule':<22} {'m':>3} {'mbs':>4} {'recompute (per stage)':<28} "
             f"{'step ms':>9}  peak MiB per stage"]
    for i, c in enumerate(cands[:top], 1):
        rc = c.recompute if c.recompute != "stage_aware" else "sa:" + ",".join(f"{f:.2f}" for f in c.recompute_fractions)
        peaks = ",".join(f"{p / 2**20:.1f}" for p in c.peak_memory_bytes)
        lines.append(f"{i:>3} {c.layout:<14} {c.schedule:<22} {c.num_microbatches:>3} {c.micro_batch_size:>4} "
                     f"{rc:<28} {c.step_time_s * 1e3:>9.3f}  {peaks}")
    lines.append("why: " + why_best(cands))
    return "\n".join(lines)
