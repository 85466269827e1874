"""Measured per-action timings of a real pipeline step, as simulator costs and as a Chrome trace.

With ``PipelineRunner(..., record_timing=True)`` every action of a step is recorded as an
:class:`ActionTiming`: when it started, when its inputs were ready (a compute action may first
wait for a receive), when it ended, and how much of a ``B``/``I`` was spent recomputing
(recompute inside the backward). Times are ``time.perf_counter()`` seconds; on one host that
clock is shared by every process, so timings from several ranks line up on one timeline
(across hosts they do not: each rank's trace is then only internally consistent).

- :func:`gather_timings` collects every rank's records over the pipeline group;
- :func:`measured_costs` turns them into the :class:`~merak_pipe.sim.CostModel` that
  :func:`~merak_pipe.sim.simulate` consumes (per-stage medians of F, B, I, W and the
  whole-stage recompute time), so a measured step can be compared with its prediction;
- :func:`chrome_trace` writes the measured timeline as Chrome trace / Perfetto JSON.

This module measures nothing itself and never synchronises devices: on CUDA, time only what
the host sees (call ``torch.cuda.synchronize`` in the stage if device time matters).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch.distributed as dist

from merak_pipe.ir import Schedule

__all__ = ["ActionTiming", "chrome_trace", "gather_timings", "measured_costs", "measured_step_time"]

_COMPUTE = ("F", "B", "I", "W", "R")


@dataclass(frozen=True)
class ActionTiming:
    """One executed action: ``start_s`` <= ``ready_s`` (inputs received) <= ``end_s``."""

    rank: int
    stage: int
    kind: str
    microbatch: int
    start_s: float
    ready_s: float
    end_s: float
    recompute_s: float = 0.0
    """Seconds of a B/I spent recomputing the checkpointed units (no explicit R action)."""

    @property
    def action(self) -> str:
        """The compact action string, e.g. ``"1F3"``."""
        return f"{self.stage}{self.kind}{self.microbatch}"

    @property
    def compute_s(self) -> float:
        """Time from inputs ready to the end (the action's own cost)."""
        return self.end_s - self.ready_s

    @property
    def wait_s(self) -> float:
        """Time waiting for inputs before computing."""
        return self.ready_s - self.start_s


def gather_timings(timings: Sequence[ActionTiming], group: dist.ProcessGroup | None = None) -> list[ActionTiming]:
    """Every rank's timings of the last step, on every rank of ``group`` (collective)."""
    world = dist.get_world_size(group)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, [asdict(t) for t in timings], group=group)
    return [ActionTiming(**t) for part in gathered for t in part]


def measured_step_time(timings: Sequence[ActionTiming]) -> float:
    """Seconds from the first action's start to the last action's end (over all ranks given)."""
    if not timings:
        raise ValueError("no timings: run a step with record_timing=True first")
    return max(t.end_s for t in timings) - min(t.start_s for t in timings)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def measured_costs(timings: Iterable[ActionTiming], schedule: Schedule) -> Any:
    """A :class:`~merak_pipe.sim.CostModel` from measured timings (all ranks, one or more steps).

    Per stage: ``forward`` = median F, ``backward`` = median B minus its recompute part,
    ``backward_input``/``backward_weight`` = median I (minus recompute) / W, ``recompute`` = the
    whole-stage recompute time (median R, or the recompute part of B/I, divided by the plan's
    fraction). The host time of posting sends/receives is added to the compute action it
    belongs to (SEND_F/RECV_F to F, SEND_B/RECV_B to the backward), since the simulator treats
    communication actions as free for the rank. Kinds a stage never ran fall back to the
    simulator's defaults (B = 2 F, I = W = B / 2, recompute = F).
    """
    from merak_pipe.sim import CostModel

    num_stages = schedule.num_stages
    per: dict[tuple[int, str], list[float]] = {}
    rec: dict[int, list[float]] = {}
    comm: dict[tuple[int, str], list[float]] = {}
    for t in timings:
        if t.kind in _COMPUTE:
            per.setdefault((t.stage, t.kind), []).append(t.compute_s - t.recompute_s)
            if t.kind == "R":
                rec.setdefault(t.stage, []).append(t.compute_s)
            elif t.recompute_s > 0:
                rec.setdefault(t.stage, []).append(t.recompute_s)
        else:
            side = "F" if t.kind in ("SEND_F", "RECV_F") else "B"
            comm.setdefault((t.stage, side), []).append(t.end_s - t.start_s)
    microbatches = schedule.num_microbatches
    steps = max(1, len(per.get((0, "F"), [])) // microbatches)

    def comm_per_mb(stage: int, side: str) -> float:
        return sum(comm.get((stage, side), [])) / (microbatches * steps)

    fractions = schedule.recompute.fractions if schedule.recompute is not None else (0.0,) * num_stages
    forward, backward, b_in, b_w, recompute = [], [], [], [], []
    split = False
    for s in range(num_stages):
        f = _median(per.get((s, "F"), [])) + comm_per_mb(s, "F")
        b_comm = comm_per_mb(s, "B")
        if per.get((s, "B")):
            b = _median(per[(s, "B")]) + b_comm
            i, w = b / 2, b / 2
        else:
            i = _median(per.get((s, "I"), [])) + b_comm
            w = _median(per.get((s, "W"), []))
            b = i + w
            split = split or bool(per.get((s, "I")))
        r_meas = _median(rec.get(s, []))
        recompute.append(r_meas / fractions[s] if fractions[s] > 0 and r_meas > 0 else f)
        forward.append(f)
        backward.append(b if b > 0 else 2 * f)
        b_in.append(i)
        b_w.append(w)
    return CostModel(
        forward=forward, backward=backward, recompute=recompute,
        backward_input=b_in if split else None, backward_weight=b_w if split else None,
    )


def chrome_trace(timings: Sequence[ActionTiming], path: str | None = None) -> dict[str, Any]:
    """The measured timeline as Chrome trace JSON (one process per rank, one thread per stage).

    Waiting for inputs is drawn as a separate ``wait`` slice before the action. Returns the
    trace dict; with ``path`` also writes it there (open in chrome://tracing or ui.perfetto.dev).
    """
    if not timings:
        raise ValueError("no timings: run a step with record_timing=True first")
    origin = min(t.start_s for t in timings)
    events: list[dict[str, Any]] = []
    for rank in sorted({t.rank for t in timings}):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"pipeline rank {rank}"}})
    for t in timings:
        us = 1e6
        if t.kind in _COMPUTE and t.wait_s > 0:
            events.append({"name": f"wait {t.action}", "cat": "wait", "ph": "X", "pid": t.rank, "tid": t.stage,
                           "ts": (t.start_s - origin) * us, "dur": t.wait_s * us})
        events.append({
            "name": t.action, "cat": "compute" if t.kind in _COMPUTE else "comm", "ph": "X",
            "pid": t.rank, "tid": t.stage, "ts": (t.ready_s - origin) * us,
            "dur": max(t.end_s - t.ready_s, 0.0) * us,
            "args": {"microbatch": t.microbatch, "recompute_s": t.recompute_s},
        })
    trace = {"traceEvents": events, "displayTimeUnit": "ms"}
    if path is not None:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(trace, handle)
    return trace
