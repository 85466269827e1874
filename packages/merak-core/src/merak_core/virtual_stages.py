"""Virtual pipeline stages: whether a schedule runs v stages per rank (the registry says), and where.

``training.virtual_stages: v`` cuts the model into ``pp * v`` stages; the schedule places them on
the ``pp`` pipeline ranks (interleaved-1F1B round-robin, stage s on rank s % pp; ZB-V in a V, rank
r holding stages r and 2pp - 1 - r). :func:`check_virtual_stages` refuses a combination the
schedule cannot run (the value, the expectation, the fix), in the launching process (the job
file's arguments) and again where the Trainer builds its pipeline; :func:`stage_placement` gives
the schedule's placement, which :func:`merak_core.compose.build_parallel_model` partitions by.

Not done here: partitioning (``compose``) and running the schedule (``engine``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["check_layer_count", "check_virtual_stages", "stage_placement", "stage_data_roles"]


def _stages_per_rank(schedule: str) -> int | None:
    """What the schedule registry says (``auto`` resolves to a one-stage-per-rank schedule)."""
    from merak_pipe import schedule_info

    if schedule.strip().lower() == "auto":
        return 1
    return schedule_info(schedule.strip().lower()).stages_per_rank


def check_virtual_stages(schedule: str, pp: int, virtual_stages: int) -> None:
    """ValueError unless ``schedule`` (merak-pipe name or config key; ``auto`` is one stage per rank)
    runs ``virtual_stages`` stages per pipeline rank at ``pp``."""
    if not isinstance(virtual_stages, int) or isinstance(virtual_stages, bool) or virtual_stages < 1:
        raise ValueError(
            f"virtual_stages={virtual_stages!r}; expected an int >= 1 (pipeline stages per rank)"
        )
    if virtual_stages > 1 and pp < 2:
        raise ValueError(
            f"virtual_stages={virtual_stages} needs a pipeline, but pp={pp}: set pp >= 2 or virtual_stages=1"
        )
    needs = _stages_per_rank(schedule)
    if needs is not None and virtual_stages != needs:
        if needs == 1:
            fix = "use schedule interleaved_1f1b (any v) or zb_v (v=2), or virtual_stages=1"
        else:
            fix = f"set virtual_stages={needs} or use schedule interleaved_1f1b"
        raise ValueError(
            f"schedule {schedule!r} runs {needs} stage(s) per pipeline rank but virtual_stages="
            f"{virtual_stages}: {fix}"
        )


def stage_placement(schedule: str, pp: int, virtual_stages: int = 1) -> tuple[int, ...]:
    """The pipeline rank of each of the ``pp * virtual_stages`` stages, as ``schedule`` places them."""
    check_virtual_stages(schedule, pp, virtual_stages)
    if _stages_per_rank(schedule) == 1:
        return tuple(range(pp))
    from merak_pipe import build_schedule, schedule_info

    name = schedule_info(schedule.strip().lower()).name
    return build_schedule(
        name, num_stages=pp * virtual_stages, num_microbatches=pp, num_ranks=pp, check=False
    ).stage_to_rank


def check_layer_count(model: Any, pp: int, virtual_stages: int) -> None:
    """ValueError when the model has fewer layers (its longest ``nn.ModuleList``) than ``pp * virtual_stages``
    stages: every virtual stage must hold at least one layer."""
    if virtual_stages == 1:
        return
    from torch import nn

    lists = [len(m) for m in model.modules() if isinstance(m, nn.ModuleList)]
    layers = max(lists, default=0)
    stages = pp * virtual_stages
    if layers < stages:
        most = max(1, layers // pp)
        raise ValueError(
            f"virtual_stages={virtual_stages} at pp={pp} cuts the model into pp * virtual_stages = {stages} stages, "
            f"but it has {layers} layers (its longest nn.ModuleList): every stage needs a layer at least; use "
            f"virtual_stages <= {most}"
            + (f" or pp <= {layers // virtual_stages}" if layers >= virtual_stages else "")
        )


def stage_data_roles(args: Any, layout: Any) -> dict[str, Any]:
    """``StageAwareDataLoader`` keywords for this rank: it reads the inputs when it holds stage 0 and the
    labels when it holds the last stage (with ZB-V both are on pipeline rank 0)."""
    placement = stage_placement(args.schedule, layout.pp, args.virtual_stages)
    mine = {s for s, r in enumerate(placement) if r == layout.pp_rank}
    return {
        "dp_rank": layout.dp_rank,
        "dp_size": layout.dp,
        "needs_inputs": 0 in mine,
        "needs_labels": len(placement) - 1 in mine,
    }
