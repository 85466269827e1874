"""Where a rank's pipeline work lives: the one device of its stages, and its runs of consecutive stages.

Helpers of :class:`~merak_pipe.runner.PipelineRunner`, computed once when it is built.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from merak_pipe.ir import Schedule
from merak_pipe.stage import PipelineStage


def _common_device(stages: Sequence[PipelineStage], device: torch.device | str | None) -> torch.device:
    """The one device of this rank's stages and messages; refuses a disagreement."""
    devices = {torch.device(s.device) for s in stages}
    if device is not None:
        wanted = torch.device(device)
        if wanted.type == "cuda" and wanted.index is None:
            wanted = torch.device("cuda", torch.cuda.current_device())
        if any(_differs(d, wanted) for d in devices):
            raise ValueError(
                f"PipelineRunner(device={wanted}) but the stages are on {sorted(map(str, devices))}; "
                "build every PipelineStage with the same device as the runner"
            )
        return wanted
    if len(devices) != 1:
        raise ValueError(
            f"this rank's PipelineStages are on several devices {sorted(map(str, devices))}; "
            "use one device per rank (pass device= to every PipelineStage)"
        )
    return next(iter(devices))


def _local_runs(schedule: Schedule) -> dict[int, tuple[int, ...]]:
    """Stage -> the run of consecutive stages on its rank that it belongs to (itself alone, mostly)."""
    runs: dict[int, tuple[int, ...]] = {}
    run: list[int] = []
    for s in range(schedule.num_stages):
        if run and schedule.rank_of(s) != schedule.rank_of(run[-1]):
            runs.update(dict.fromkeys(run, tuple(run)))
            run = []
        run.append(s)
    runs.update(dict.fromkeys(run, tuple(run)))
    return runs


def _differs(a: torch.device, b: torch.device) -> bool:
    return a.type != b.type or (a.index is not None and b.index is not None and a.index != b.index)
