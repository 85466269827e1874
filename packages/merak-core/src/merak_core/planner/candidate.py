"""One planned configuration (:class:`Candidate`), how candidates rank, and the ranked table.

A candidate is a :class:`~merak_core.planner.layout_choice.LayoutChoice` (what the job file needs
to run it, :meth:`Candidate.training_fields`) with what the planner predicted for it (step time and its parts, per-stage times and peak memory).

Not done here: the prediction itself (:mod:`.pricing`) and the search (:mod:`.search`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from merak_core.config.layout_choice import LayoutChoice
from merak_core.planner.choices import RECOMPUTE_MODES, schedule_order
from merak_core.planner.memory import usable_memory

__all__ = ["Candidate", "format_plan", "ranked_rows", "recompute_label", "sort_key", "why_best"]


@dataclass(frozen=True, kw_only=True)
class Candidate(LayoutChoice):
    """One planned configuration (its :class:`LayoutChoice` fields) with its predictions."""

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
    device_peak_bytes: tuple[float, ...] = ()
    """Per pipeline rank: its stages' static bytes plus the simulated activation peak of the rank
    (what ``memory_per_device`` bounds); the per-stage peaks when each rank holds one stage."""

    def training_fields(self, memory_budget: float | None = None) -> dict[str, Any]:
        """The job file's ``training`` fields for this choice (stage-aware: the usable memory as the budget)."""
        budget = usable_memory(self.memory_per_device) if memory_budget is None else memory_budget
        return super().training_fields(budget)


def sort_key(c: Candidate) -> tuple[Any, ...]:
    """The ranking: step time (to 9 digits), then fewer TP ranks, fewer cp then ep ranks (an axis is
    turned on only when it is predicted faster or must: memory), the layout string, the schedule's
    registry order, fewer microbatches and the recompute mode's order."""
    return (
        float(f"{c.step_time_s:.9g}"),
        c.tp,
        c.cp,
        c.ep,
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


def ranked_rows(cands: Sequence[Any], top: int, head: str, row: Callable[[Any, str], str]) -> list[str]:
    """A planner's ranked table: the header (``#``, ``layout`` and ``head``), then one line per candidate of
    the first ``top`` (its rank, layout and ``row(candidate, its recompute label)``)."""
    lines = [f"{'#':>3} {'layout':<14} {head}"]
    lines += [f"{i:>3} {c.layout:<14} {row(c, recompute_label(c))}" for i, c in enumerate(cands[:top], 1)]
    return lines


def format_plan(cands: Sequence[Candidate], top: int = 10) -> str:
    """A ranked table of the first ``top`` candidates, then why the first wins."""

    def row(c: Candidate, rc: str) -> str:
        peaks = ",".join(f"{p / 2**20:.1f}" for p in c.peak_memory_bytes)
        return (
            f"{c.schedule_label:<22} {c.num_microbatches:>3} {c.micro_batch_size:>4} "
            f"{rc:<28} {c.step_time_s * 1e3:>9.3f}  {peaks}"
        )

    head = f"{'schedule':<22} {'m':>3} {'mbs':>4} {'recompute (per stage)':<28} {'step ms':>9}  peak MiB per stage"
    lines = ranked_rows(cands, top, head, row)
    lines.append("why: " + why_best(cands))
    return "\n".join(lines)
