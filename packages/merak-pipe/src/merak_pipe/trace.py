"""Timeline export of a simulation: Chrome trace / Perfetto JSON, and a PNG picture.

The JSON opens in chrome://tracing or https://ui.perfetto.dev: one thread per rank, one slice
per action, and a memory counter per stage. The PNG needs matplotlib (``pip install
merak-pipe[plot]``); it is imported only when a picture is asked for.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from merak_pipe.ir import ActionKind

if TYPE_CHECKING:
    from merak_pipe.sim import SimResult

__all__ = ["chrome_trace", "plot_timeline", "trace_document"]

_COLORS = {
    ActionKind.FORWARD: "#4C72B0",
    ActionKind.FULL_BACKWARD: "#55A868",
    ActionKind.BACKWARD_INPUT: "#8FD694",
    ActionKind.BACKWARD_WEIGHT: "#2D6A4F",
    ActionKind.RECOMPUTE: "#DD8452",
}
_NAMES = {
    ActionKind.FORWARD: "forward",
    ActionKind.FULL_BACKWARD: "backward",
    ActionKind.BACKWARD_INPUT: "backward_input",
    ActionKind.BACKWARD_WEIGHT: "backward_weight",
    ActionKind.RECOMPUTE: "recompute",
}
KIND_CATEGORY: dict[ActionKind, str] = {
    **_NAMES,
    ActionKind.SEND_F: "send",
    ActionKind.SEND_B: "send",
    ActionKind.RECV_F: "recv",
    ActionKind.RECV_B: "recv",
}
"""The trace category (``cat``) of each action kind; a measured profile uses the same ones."""


def trace_document(
    title: str,
    ranks: list[int] | range,
    slices: list[dict[str, object]],
    other: dict[str, object],
    path: str | os.PathLike[str] | None = None,
) -> dict[str, object]:
    """The one layout of every pipeline trace Merak writes: process 0 named ``title``, one thread
    per rank, then ``slices`` (``ph`` X/C events with ``tid`` = rank); written to ``path`` if given.
    A simulated schedule (:func:`chrome_trace`) and a measured profile
    (:meth:`merak_pipe.action_profile.ActionProfile.chrome_trace`) thus open side by side."""
    events: list[dict[str, object]] = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": title}}]
    for rank in ranks:
        events.append(
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}}
        )
    events.extend(slices)
    trace: dict[str, object] = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}
    if path is not None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(trace, f)
    return trace


def chrome_trace(
    result: SimResult, path: str | os.PathLike[str] | None = None, *, us_per_unit: float = 1000.0
) -> dict[str, object]:
    """Build (and write to ``path`` if given) the trace; simulated time is scaled by ``us_per_unit``."""
    events: list[dict[str, object]] = []
    for t in result.timeline:
        if not t.action.kind.is_compute:
            continue
        events.append(
            {
                "name": str(t.action),
                "cat": _NAMES[t.action.kind],
                "ph": "X",
                "pid": 0,
                "tid": t.rank,
                "ts": t.start * us_per_unit,
                "dur": (t.end - t.start) * us_per_unit,
                "args": {"stage": t.action.stage, "microbatch": t.action.microbatch},
            }
        )
    for stage, curve in result.memory.items():
        for time, value in curve:
            events.append(
                {
                    "name": f"activation memory stage {stage}",
                    "ph": "C",
                    "pid": 0,
                    "ts": time * us_per_unit,
                    "args": {"bytes": value},
                }
            )
    return trace_document(
        f"pipeline: {result.schedule.name}",
        range(result.schedule.num_ranks),
        events,
        {"makespan": result.makespan, "schedule": result.schedule.name},
        path,
    )


def plot_timeline(result: SimResult, path: str | os.PathLike[str]) -> None:
    """Save a PNG: one row of coloured boxes per rank, and the activation memory per stage below."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as err:
        raise ImportError(
            "plot_timeline needs matplotlib; install it with `pip install merak-pipe[plot]` (or `pip install matplotlib`)"
        ) from err
    schedule = result.schedule
    num_ranks = schedule.num_ranks
    fig, (ax, ax_mem) = plt.subplots(
        2,
        1,
        figsize=(max(8.0, min(40.0, result.makespan * 0.4)), 1.0 + 0.6 * num_ranks + 2.5),
        gridspec_kw={"height_ratios": [max(1, num_ranks), 3]},
        sharex=True,
    )
    label_boxes = len(result.timeline) <= 2000
    for t in result.timeline:
        kind = t.action.kind
        if not kind.is_compute or t.end <= t.start:
            continue
        ax.broken_barh(
            [(t.start, t.end - t.start)], (t.rank - 0.4, 0.8), facecolors=_COLORS[kind], edgecolor="white"
        )
        if label_boxes:
            ax.text(
                (t.start + t.end) / 2,
                t.rank,
                str(t.action.microbatch),
                ha="center",
                va="center",
                fontsize=7,
                color="white",
            )
    ax.set_yticks(range(num_ranks), [f"rank {r}" for r in range(num_ranks)])
    ax.invert_yaxis()
    ax.set_title(
        f"{schedule.name}: {schedule.num_stages} stages, {schedule.num_microbatches} microbatches, makespan {result.makespan:.4g}"
    )
    ax.legend(
        handles=[Patch(color=c, label=_NAMES[k]) for k, c in _COLORS.items()], loc="upper right", fontsize=7
    )
    for stage, curve in result.memory.items():
        xs = [p[0] for p in curve] + [result.makespan]
        ys = [p[1] for p in curve] + [curve[-1][1]]
        ax_mem.step(xs, ys, where="post", label=f"stage {stage}")
    ax_mem.set_ylabel("activation memory")
    ax_mem.set_xlabel("time")
    if schedule.num_stages <= 16:
        ax_mem.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
