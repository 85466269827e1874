"""One planned configuration (:class:`Candidate`), how candidates rank, and the ranked table.

A candidate carries what the job file needs to run it (:meth:`Candidate.training_fields`) and
what the planner predicted for it (step time and its parts, per-stage times and peak memory).

Not done here: the prediction itself (:mod:`.pricing`) and the search (:mod:`.search`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from merak_core.planner.choices import RECOMPUTE_MODES, schedule_order
from merak_core.planner.memory import usable_memory

__all__ = ["Candidate", "format_plan", "recompute_label", "sort_key", "training_fields", "why_best"]


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

    @property
    def schedule_label(self) -> str:
        """The schedule, with ``v=N`` when it runs N > 1 stages per pipeline rank."""
        return self.schedule + (f" v={self.virtual_stages}" if self.virtual_stages > 1 else "")

    def training_fields(self) -> dict[str, Any]:
        """The job file's ``training`` fields for this choice."""
        return training_fields(self, memory_budget=usable_memory(self.memory_per_device))


def training_fields(c: Any, *, memory_budget: float) -> dict[str, Any]:
    """The job file's ``training`` fields of a planned configuration ``c`` (a :class:`Candidate` or a
    cluster candidate: the same attribute names); ``memory_budget`` goes with stage-aware recomputation."""
    out: dict[str, Any] = {
        "dp": c.dp,
        "tp": c.tp,
        "pp": c.pp,
        "schedule": c.schedule,
        "per_device_train_batch_size": c.micro_batch_size,
        "gradient_accumulation_steps": c.num_microbatches,
        "recompute": c.recompute,
        "virtual_stages": c.virtual_stages,
    }
    if c.recompute == "stage_aware":
        out["memory_budget"] = int(memory_budget)
    return out


def sort_key(c: Candidate) -> tuple[Any, ...]:
    """The ranking: step time (to 9 digits), then fewer TP ranks, the layout string, the schedule's
    registry order, fewer microbatches and the recompute mode's order."""
    return (
        float(f"{c.step_time_s:.9g}"),
        c.tp,
        c.layout,
        schedule_order(c.schedule),
        c.num_microbatches,
        RECOMPUTE_MODES.index(c.recompute),
    )


def why_best(cands: Sequence[Candidate]) -> str:
    """One line on why the first candidate wins."""
    if not cands:
        return ""
    top = cands[0]
    text = (
        f"{top.layout} {top.schedule_label} m={top.num_microbatches} recompute={top.recompute}: predicted "
        f"{top.step_time_s * 1e3:.3f} ms (pipeline {top.pipeline_s * 1e3:.3f} ms + DP all-reduce "
        f"{top.dp_allreduce_s * 1e3:.3f} ms + optimizer/clip/loss {top.overhead_s * 1e3:.3f} ms), peak {max(top.peak_memory_bytes) / 2**20:.1f} MiB"
    )
    other = next((c for c in cands[1:] if c.layout != top.layout), None)
    if other is not None:
        gain = 100 * (other.step_time_s / top.step_time_s - 1) if top.step_time_s > 0 else 0.0
        text += f"; {gain:.1f}% faster than the best other layout ({other.layout}, {other.schedule_label})"
    else:
        text += "; the only layout that fits"
    return text


def recompute_label(c: Any) -> str:
    """The recompute mode of a planned configuration ``c``; stage-aware with its per-stage fractions."""
    if c.recompute != "stage_aware":
        return str(c.recompute)
    return "sa:" + ",".join(f"{f:.2f}" for f in c.recompute_fractions)


def format_plan(cands: Sequence[Candidate], top: int = 10) -> str:
    """A ranked table of the first ``top`` candidates, then why the first wins."""
    lines = [
        f"{'#':>3} {'layout':<14} {'schedule':<22} {'m':>3} {'mbs':>4} {'recompute (per stage)':<28} "
        f"{'step ms':>9}  peak MiB per stage"
    ]
    for i, c in enumerate(cands[:top], 1):
        rc = recompute_label(c)
        peaks = ",".join(f"{p / 2**20:.1f}" for p in c.peak_memory_bytes)
        lines.append(
            f"{i:>3} {c.layout:<14} {c.schedule_label:<22} {c.num_microbatches:>3} {c.micro_batch_size:>4} "
            f"{rc:<28} {c.step_time_s * 1e3:>9.3f}  {peaks}"
        )
    lines.append("why: " + why_best(cands))
    return "\n".join(lines)
