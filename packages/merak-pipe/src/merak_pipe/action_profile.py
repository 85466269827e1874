"""Where a runner step's host time goes, action by action: a profile written as a pipeline trace.

``with runner.profiling() as profile:`` makes every ``step``/``evaluate`` inside the block
record (in :attr:`ActionProfile.spans` once the block has closed), per entry of this rank's issue order ([Note: issue order] in ``p2p_order.py``), one
:class:`ProfiledSpan`: its host time (``perf_counter``), the part of it spent blocked in the
transport's waits, and (with ``torch_ops=True``) the part spent inside torch operators, taken
from ``torch.profiler`` (the total of the top-level operators run under the span: autograd's
backward nodes, aten ops, c10d calls). What is left, ``python_s``, is the runtime's own Python:
bookkeeping, dispatch, building batches. Besides the schedule's actions, the runner's other
work has spans of its own: ``release`` (after each compute action: reaping completed sends,
handing receive buffers back), ``control`` (a p2p unit that carries only a header or a spec),
``end sends`` (the round's final wait on sends), ``shared grads`` (the all-reduce of shared
parameters' gradients). The runner calls no optimizer, so optimizer time is not in a step.

[Note: profile cost]
Off, the profile costs the runner one check per round, none per action. On, it measures
itself too: ``perf_counter`` twice per entry, and with ``torch_ops`` the profiler's per-operator
record (of the order of a microsecond per op), which inflates the host time it reports. For
the runtime's undisturbed fixed cost per action, time steps with the profile off (the
``actions`` section of ``benchmarks/bench_pipe_runtime.py`` does both); use the profile for the
split. A SEND/RECV unit that issues several actions is one batch: its time is shared equally
among them. On CUDA the spans are host time (launches, not kernels).

:meth:`ActionProfile.chrome_trace` writes spans of one or several ranks (see
:func:`gather_spans`) in the layout of the simulator's trace (:func:`merak_pipe.trace.chrome_trace`:
one thread per rank, compute actions named like ``1F3`` with the same categories), so a
measured step and its simulation open side by side in chrome://tracing or ui.perfetto.dev.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from merak_pipe.ir import Action
from merak_pipe.trace import KIND_CATEGORY, trace_document

# The runner is passed in (it imports this module): typed as Any so no import, not even under
# TYPE_CHECKING, goes back to merak_pipe.runner.
PipelineRunner = Any

__all__ = ["ActionProfile", "ProfiledSpan", "gather_spans", "profiling"]

_MARK = "merak_pipe#"


@dataclass(frozen=True)
class ProfiledSpan:
    """One entry of a profiled round on one rank."""

    rank: int
    name: str
    """The action (``"1F3"``, ``"0SEND_F2"``) or the runner's work (``"release"``, ...)."""
    category: str
    """forward, backward, backward_input, backward_weight, recompute, send, recv, or the name of the runner's work."""
    start_s: float
    end_s: float
    wait_s: float
    """Blocked in the transport's waits."""
    torch_s: float
    """Inside torch operators (0 without ``torch_ops``)."""
    step: int
    kind: str = ""
    """The schedule action's kind value (``"F"``, ``"SEND_F"``, ...); empty for the runner's own work."""

    @property
    def host_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def python_s(self) -> float:
        """Host time neither waiting nor inside torch operators."""
        return max(0.0, self.host_s - self.wait_s - self.torch_s)


class ActionProfile:
    """The spans of the profiled rounds of one runner (see the module docstring)."""

    def __init__(self, rank: int, schedule_name: str, *, torch_ops: bool = True) -> None:
        self.rank = rank
        self.schedule_name = schedule_name
        self.torch_ops = torch_ops
        self.spans: list[ProfiledSpan] = []
        self._waited = 0.0
        self._step = 0
        self._open: list[tuple[str, str, str, float, float, float, int, int, int]] = []
        """Per entry so far: (name, category, kind, start, end, waited, label, parts, step): ``label``
        indexes the profiler's record of the call it was part of, shared by ``parts`` entries."""
        self._labels = 0
        self._profiler: Any = None

    def start(self) -> None:
        """Start measuring (with ``torch_ops``: one torch profiler session for the whole block)."""
        if self.torch_ops:
            self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self._profiler.__enter__()

    def finish(self) -> None:
        """Stop measuring and turn the entries into :attr:`spans`."""
        op_seconds: dict[int, float] = {}
        if self._profiler is not None:
            self._profiler.__exit__(None, None, None)
            op_seconds = _op_seconds(self._profiler)
            self._profiler = None
        for name, category, kind, start, end, waited, label, parts, step in self._open:
            self.spans.append(
                ProfiledSpan(
                    rank=self.rank,
                    name=name,
                    category=category,
                    start_s=start,
                    end_s=end,
                    wait_s=waited,
                    torch_s=op_seconds.get(label, 0.0) / parts,
                    step=step,
                    kind=kind,
                )
            )
        self._open = []

    # ------------------------------------------------------------------ measuring

    def timed_wait(self, wait: Callable[[list[Any], str], None]) -> Callable[[list[Any], str], None]:
        """``wait`` that adds its blocked seconds to the current entry."""

        def waited(works: list[Any], what: str) -> None:
            start = time.perf_counter()
            try:
                wait(works, what)
            finally:
                self._waited += time.perf_counter() - start

        return waited

    def _entry(self, name: str, category: str, kind: str, fn: Callable[[], Any]) -> Any:
        label = self._labels
        self._labels += 1
        self._waited = 0.0
        start = time.perf_counter()
        if self.torch_ops:
            with torch.profiler.record_function(f"{_MARK}{label}"):
                result = fn()
        else:
            result = fn()
        self._open.append(
            (name, category, kind, start, time.perf_counter(), self._waited, label, 1, self._step)
        )
        return result

    def run_round(self, runner: PipelineRunner, plan: Sequence[Any], step: int) -> None:
        """The runner's round loop with every entry measured (the same calls, in the same order)."""
        self._step = step
        for entry in plan:
            if isinstance(entry, Action):
                self._entry(
                    str(entry),
                    KIND_CATEGORY[entry.kind],
                    entry.kind.value,
                    partial(runner._run_compute, entry),
                )
                self._entry("release", "release", "", partial(runner._let_go, entry))
                continue
            issued: list[Action] = self._entry("", "", "", partial(runner.exchange.run_unit, entry))
            self._split_unit(issued)
        self._entry("end sends", "end sends", "", runner.transport.wait_sends)

    def timed(self, name: str, fn: Callable[[], Any], step: int) -> Any:
        """Run ``fn`` as one span of the runner's own work (after the round, e.g. ``shared grads``)."""
        self._step = step
        return self._entry(name, name, "", fn)

    def _split_unit(self, issued: list[Action]) -> None:
        """Name the last entry (one p2p unit) after the actions it issued, its time shared among them."""
        _, _, _, start, end, waited, label, _, step = self._open.pop()
        if not issued:
            self._open.append(("control", "control", "", start, end, waited, label, 1, step))
            return
        parts = len(issued)
        share = (end - start) / parts
        for i, action in enumerate(issued):
            begin = start + i * share
            category = KIND_CATEGORY[action.kind]
            kind = action.kind.value
            self._open.append(
                (str(action), category, kind, begin, begin + share, waited / parts, label, parts, step)
            )

    # ------------------------------------------------------------------ reading

    def summary(self, spans: Sequence[ProfiledSpan] | None = None) -> dict[str, dict[str, float]]:
        """Per category: count, and total host / wait / torch-op / Python seconds."""
        out: dict[str, dict[str, float]] = {}
        for span in self.spans if spans is None else spans:
            row = out.setdefault(
                span.category, {"count": 0, "host_s": 0.0, "wait_s": 0.0, "torch_s": 0.0, "python_s": 0.0}
            )
            row["count"] += 1
            row["host_s"] += span.host_s
            row["wait_s"] += span.wait_s
            row["torch_s"] += span.torch_s
            row["python_s"] += span.python_s
        return out

    def chrome_trace(
        self, path: str | os.PathLike[str] | None = None, spans: Sequence[ProfiledSpan] | None = None
    ) -> dict[str, object]:
        """The spans (this rank's, or ``spans`` of several ranks) as a pipeline trace."""
        chosen = list(self.spans if spans is None else spans)
        if not chosen:
            raise ValueError("no profiled spans: run a step inside `with runner.profiling():` first")
        origin = min(s.start_s for s in chosen)
        slices: list[dict[str, object]] = [
            {
                "name": s.name,
                "cat": s.category,
                "ph": "X",
                "pid": 0,
                "tid": s.rank,
                "ts": (s.start_s - origin) * 1e6,
                "dur": s.host_s * 1e6,
                "args": {
                    "step": s.step,
                    "wait_us": s.wait_s * 1e6,
                    "torch_ops_us": s.torch_s * 1e6,
                    "python_us": s.python_s * 1e6,
                },
            }
            for s in chosen
        ]
        return trace_document(
            f"pipeline: {self.schedule_name} (measured)",
            sorted({s.rank for s in chosen}),
            slices,
            {"schedule": self.schedule_name, "measured": True, "torch_ops": self.torch_ops},
            path,
        )


@contextmanager
def profiling(runner: PipelineRunner, *, torch_ops: bool = True) -> Iterator[ActionProfile]:
    """``runner.profiling()``: the runner's rounds inside the block are profiled into the yielded profile."""
    if runner._profile is not None:
        raise RuntimeError(
            "this PipelineRunner is already profiling; open no second profiling() block inside it"
        )
    profile = ActionProfile(runner.rank, runner.schedule.name, torch_ops=torch_ops)
    transport = runner.transport
    own_wait = vars(transport).get("wait")
    transport.wait = profile.timed_wait(transport.wait)  # type: ignore[method-assign,assignment]
    runner._profile = profile
    profile.start()
    try:
        yield profile
    finally:
        runner._profile = None
        profile.finish()
        if own_wait is None:
            del transport.wait
        else:
            transport.wait = own_wait  # type: ignore[method-assign]


def gather_spans(spans: Sequence[ProfiledSpan], group: dist.ProcessGroup | None = None) -> list[ProfiledSpan]:
    """Every rank's spans on every rank of ``group`` (collective)."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, [asdict(s) for s in spans], group=group)
    return [ProfiledSpan(**s) for part in gathered for s in part]


def _op_seconds(prof: Any) -> dict[int, float]:
    """Label index -> seconds of the top-level operators recorded under it."""
    out: dict[int, float] = {}
    for event in prof.events():
        if not event.name.startswith(_MARK):
            continue
        index = int(event.name[len(_MARK) :])
        out[index] = sum(child.cpu_time_total for child in event.cpu_children) / 1e6
    return out
