"""Measured per-action timings of a real pipeline step, as simulator costs and as a Chrome trace.

With ``PipelineRunner(..., record_timing=True)`` every action of a step is recorded as an
:class:`ActionTiming`: when it started, when its inputs were ready (a compute action may first
wait for a receive), when it ended, and how much of a ``B``/``I`` was spent recomputing
(recompute inside the backward). Times are ``time.perf_counter()`` seconds; on one host that
clock is shared by every process, so timings from several ranks line up on one timeline
(across hosts they do not: each rank's trace is then only internally consistent). On CUDA
the runner marks each point with a CUDA event on the current stream (:class:`RoundClock`) and
converts after the round's end is synchronised: device time, anchored at the host clock read
right after a synchronize at the start of the round. (The recompute part of a B/I is still
host time; on CUDA it counts launches, not kernels.)

- :func:`gather_timings` collects every rank's records over the pipeline group;
- :func:`measured_costs` turns them into the :class:`~merak_pipe.sim.CostModel` that
  :func:`~merak_pipe.sim.simulate` consumes (per-stage medians of F, B, I, W and the
  whole-stage recompute time), so a measured step can be compared with its prediction;
- :func:`measured_chrome_trace` writes the measured timeline as Chrome trace / Perfetto JSON.

Apart from :class:`RoundClock` this module measures nothing itself.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from merak_pipe.ir import Schedule

__all__ = ["ActionTiming", "measured_chrome_trace", "gather_timings", "measured_costs", "measured_step_time"]

_COMPUTE = ("F", "B", "I", "W", "R")


class RoundClock:
    """Time points of one round: host seconds on CPU, CUDA events (device time) on CUDA.

    :meth:`mark` returns a token; :meth:`seconds` turns it into ``perf_counter`` seconds. On CUDA
    a token is an event recorded on the current stream, and reading it waits for that event, so
    only reading the number synchronises, never marking it.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.device = torch.device(device)
        self._host0 = 0.0
        self._event0: Any = None

    def start_round(self, *, anchor: bool) -> None:
        """Start this round's device clock; with ``anchor`` align it to the host clock (one
        synchronize on CUDA, so that several ranks' timings line up), else only differences of
        its seconds are meaningful."""
        if self.cuda:
            if anchor:
                torch.cuda.synchronize(self.device)
                self._host0 = time.perf_counter()
            self._event0 = torch.cuda.Event(enable_timing=True)
            self._event0.record()

    def mark(self) -> Any:
        """A time point now (a float, or a recorded CUDA event)."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, token: Any) -> float:
        """The ``perf_counter`` seconds of a token from :meth:`mark` (waits for a CUDA event)."""
        if isinstance(token, float):
            return token
        token.synchronize()
        return self._host0 + self._event0.elapsed_time(token) / 1000.0


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
    step: int = 0
    """Index of the runner's step (or evaluate) call this action belongs to."""

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


def resolve_marks(
    marks: Sequence[tuple[Any, Any, Any, Any, float]], seconds: Any, rank: int, step: int
) -> list[ActionTiming]:
    """A round's marks ``(action, start, ready, end, implicit recompute s)`` as :class:`ActionTiming`,
    the clock tokens turned into seconds by ``seconds`` (:meth:`RoundClock.seconds`); a ``ready`` of
    None is the start (no inputs to wait for)."""
    return [
        ActionTiming(
            rank=rank,
            stage=a.stage,
            kind=a.kind.value,
            microbatch=a.microbatch,
            start_s=seconds(start),
            ready_s=seconds(start if ready is None else ready),
            end_s=seconds(end),
            recompute_s=recompute,
            step=step,
        )
        for a, start, ready, end, recompute in marks
    ]


def gather_timings(
    timings: Sequence[ActionTiming], group: dist.ProcessGroup | None = None
) -> list[ActionTiming]:
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


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def measured_costs(timings: Iterable[ActionTiming], schedule: Schedule) -> Any:
    """A :class:`~merak_pipe.sim.CostModel` from measured timings (all ranks, one or more steps).

    [Note: measured costs]
    The simulator knows only compute actions and a per-message delay, so each compute action is
    charged with everything its rank did since its previous compute action ended, except waiting:
    posting sends/receives, the runner's own bookkeeping, and the compute itself
    (``end - previous end - wait``). Per stage, ``forward``/``backward``/``backward_input``/
    ``backward_weight`` are means of those charges (the recompute part of a B/I is taken out);
    ``recompute`` is the whole-stage recompute time (mean R, or recompute part of B/I, divided by
    the plan's fraction). ``p2p_latency`` is the median delay from a send being posted to the
    waiting receiver resuming, over the transfers where the receiver was already waiting.
    Kinds a stage never ran fall back to the simulator's defaults.
    """
    from merak_pipe.sim import CostModel

    num_stages = schedule.num_stages
    per: dict[tuple[int, str], list[float]] = {}
    rec: dict[int, list[float]] = {}
    by_rank_step: dict[tuple[int, int], list[ActionTiming]] = {}
    for t in timings:
        by_rank_step.setdefault((t.rank, t.step), []).append(t)
    sends: dict[tuple[int, str, int, int], float] = {}
    for (_, step), records in by_rank_step.items():
        for t in records:
            if t.kind in ("SEND_F", "SEND_B"):
                sends[(step, t.kind, t.stage, t.microbatch)] = t.end_s
    latencies: list[float] = []
    for (_, step), records in by_rank_step.items():
        previous_end = records[0].start_s if records else 0.0
        for t in records:
            if t.kind not in _COMPUTE:
                continue
            charge = (t.start_s - previous_end) + (t.end_s - t.ready_s)  # see [Note: measured costs]
            previous_end = t.end_s
            per.setdefault((t.stage, t.kind), []).append(charge - t.recompute_s)
            if t.kind == "R":
                rec.setdefault(t.stage, []).append(charge)
            elif t.recompute_s > 0:
                rec.setdefault(t.stage, []).append(t.recompute_s)
            if t.wait_s > 0:
                key = (
                    (step, "SEND_F", t.stage - 1, t.microbatch)
                    if t.kind == "F"
                    else (step, "SEND_B", t.stage + 1, t.microbatch)
                )
                sent = sends.get(key)
                if sent is not None and t.start_s < sent < t.ready_s:
                    latencies.append(t.ready_s - sent)
    fractions = schedule.recompute.fractions if schedule.recompute is not None else (0.0,) * num_stages
    forward, backward, b_in, b_w, recompute = [], [], [], [], []
    split = False
    for s in range(num_stages):
        f = _mean(per.get((s, "F"), []))
        if per.get((s, "B")):
            b = _mean(per[(s, "B")])
            i, w = b / 2, b / 2
        else:
            i = _mean(per.get((s, "I"), []))
            w = _mean(per.get((s, "W"), []))
            b = i + w
            split = split or bool(per.get((s, "I")))
        r_meas = _mean(rec.get(s, []))
        recompute.append(r_meas / fractions[s] if fractions[s] > 0 and r_meas > 0 else f)
        forward.append(f)
        backward.append(b if b > 0 else 2 * f)
        b_in.append(i)
        b_w.append(w)
    return CostModel(
        forward=forward,
        backward=backward,
        recompute=recompute,
        backward_input=b_in if split else None,
        backward_weight=b_w if split else None,
        p2p_latency=statistics.median(latencies) if latencies else 0.0,
    )


def measured_chrome_trace(timings: Sequence[ActionTiming], path: str | None = None) -> dict[str, Any]:
    """The measured timeline as Chrome trace JSON (one process per rank, one thread per stage).

    Waiting for inputs is drawn as a separate ``wait`` slice before the action. Returns the
    trace dict; with ``path`` also writes it there (open in chrome://tracing or ui.perfetto.dev).
    """
    if not timings:
        raise ValueError("no timings: run a step with record_timing=True first")
    origin = min(t.start_s for t in timings)
    events: list[dict[str, Any]] = []
    for rank in sorted({t.rank for t in timings}):
        events.append(
            {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"pipeline rank {rank}"}}
        )
    for t in timings:
        us = 1e6
        if t.kind in _COMPUTE and t.wait_s > 0:
            events.append(
                {
                    "name": f"wait {t.action}",
                    "cat": "wait",
                    "ph": "X",
                    "pid": t.rank,
                    "tid": t.stage,
                    "ts": (t.start_s - origin) * us,
                    "dur": t.wait_s * us,
                }
            )
        events.append(
            {
                "name": t.action,
                "cat": "compute" if t.kind in _COMPUTE else "comm",
                "ph": "X",
                "pid": t.rank,
                "tid": t.stage,
                "ts": (t.ready_s - origin) * us,
                "dur": max(t.end_s - t.ready_s, 0.0) * us,
                "args": {"microbatch": t.microbatch, "recompute_s": t.recompute_s},
            }
        )
    trace = {"traceEvents": events, "displayTimeUnit": "ms"}
    if path is not None:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(trace, handle)
    return trace
