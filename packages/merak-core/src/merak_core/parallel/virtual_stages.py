"""Virtual pipeline stages: whether a schedule runs v stages per rank (the registry says), and where.

``training.virtual_stages: v`` cuts the model into ``pp * v`` stages; the schedule places them on
the ``pp`` pipeline ranks (its generator decides: interleaved-1F1B round-robin, ZB-V in a V). How
many stages a schedule places on a rank is merak-pipe's registry's fact (``ScheduleInfo.stages_per_rank``);
nothing here lists schedules. :func:`check_virtual_stages` refuses a combination the schedule cannot
run (the value, the expectation, the fix): for the job's arguments, in the launching process, and in
:func:`stage_placement`, which gives the schedule's placement that
:func:`merak_core.parallel.compose.build_parallel_model` partitions by.

Not done here: partitioning (``compose``) and running the schedule (``engine``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["block_count", "check_layer_count", "check_virtual_stages", "stage_placement", "stage_data_roles"]


def _schedule(schedule: str) -> Any:
    """The registry's :class:`merak_pipe.ScheduleInfo` of ``schedule``; None for ``auto`` (a one-stage-per-rank
    schedule chosen at start-up)."""
    from merak_pipe import schedule_info

    key = schedule.strip().lower()
    return None if key == "auto" else schedule_info(key)


def _schedules_running(count: int) -> list[str]:
    """The registered schedules that place several stages on a rank and can place ``count`` (by key)."""
    from merak_pipe import schedule_infos

    return [
        info.key
        for info in schedule_infos()
        if not info.one_stage_per_rank and info.runs_stages_per_rank(count)
    ]


def check_virtual_stages(schedule: str, pp: int, virtual_stages: int) -> None:
    """ValueError unless ``schedule`` (merak-pipe name or config key; ``auto`` is one stage per rank)
    runs ``virtual_stages`` stages per pipeline rank at ``pp`` (the registry's ``stages_per_rank``)."""
    if not isinstance(virtual_stages, int) or isinstance(virtual_stages, bool) or virtual_stages < 1:
        raise ValueError(
            f"virtual_stages={virtual_stages!r}; expected an int >= 1 (pipeline stages per rank)"
        )
    if virtual_stages > 1 and pp < 2:
        raise ValueError(
            f"virtual_stages={virtual_stages} needs a pipeline, but pp={pp}: set pp >= 2 or virtual_stages=1"
        )
    info = _schedule(schedule)
    if info.runs_stages_per_rank(virtual_stages) if info is not None else virtual_stages == 1:
        return
    needs = 1 if info is None else info.stages_per_rank
    others = " or ".join(_schedules_running(virtual_stages)) or "a registered one that places them"
    if needs == 1:
        fix = f"use schedule {others} (they run {virtual_stages} stages per rank), or virtual_stages=1"
    else:
        fix = f"set virtual_stages={needs} or use schedule {others}"
    raise ValueError(
        f"schedule {schedule!r} runs {needs} stage(s) per pipeline rank but virtual_stages={virtual_stages}: {fix}"
    )


def stage_placement(schedule: str, pp: int, virtual_stages: int = 1) -> tuple[int, ...]:
    """The pipeline rank of each of the ``pp * virtual_stages`` stages, as ``schedule`` places them."""
    check_virtual_stages(schedule, pp, virtual_stages)
    info = _schedule(schedule)
    if info is None or info.one_stage_per_rank:
        return tuple(range(pp))
    from merak_pipe import build_schedule

    name = info.name
    return build_schedule(
        name, num_stages=pp * virtual_stages, num_microbatches=pp, num_ranks=pp, check=False
    ).stage_to_rank


def block_count(model: Any) -> int:
    """The model's repeated blocks, as the partitioner cuts between them: the longest ``nn.ModuleList``, or
    the most entries of one class in an ``nn.ModuleDict`` (blocks keyed by name, e.g. ``str(i)`` as in
    torchtitan's Llama); 0 for a model with neither.

    A dict of a model's named parts (nanoGPT's ``transformer``: embeddings, the block list, the final norm)
    counts its largest group of one class only, so the parts are not taken for layers."""
    from collections import Counter

    from torch import nn

    counts = [0]
    for m in model.modules():
        if isinstance(m, nn.ModuleList):
            counts.append(len(m))
        elif isinstance(m, nn.ModuleDict) and len(m):
            counts.append(max(Counter(type(block) for block in m.values()).values()))
    return max(counts)


def check_layer_count(model: Any, pp: int, virtual_stages: int) -> None:
    """ValueError when the model has fewer blocks (:func:`block_count`) than ``pp * virtual_stages``
    stages: every virtual stage must hold at least one block."""
    if virtual_stages == 1:
        return
    layers = block_count(model)
    stages = pp * virtual_stages
    if layers < stages:
        most = max(1, layers // pp)
        raise ValueError(
            f"virtual_stages={virtual_stages} at pp={pp} cuts the model into pp * virtual_stages = {stages} stages, "
            f"but it has {layers} layers (its blocks: the longest nn.ModuleList, or the most blocks of one "
            f"class in an nn.ModuleDict): every stage needs a layer at least; use virtual_stages <= {most}"
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
