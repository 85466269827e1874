"""Process groups for parameters shared by several pipeline stages (e.g. tied embeddings).

A logical parameter (``"wte.weight"``) may have a copy on several pipeline ranks: the input
embedding on the first stage and the tied output projection on the last. Each copy
accumulates only its own stage's gradient; the full gradient is their sum, so the runner
all-reduces (sum) each copy's gradient over exactly the ranks that hold a copy, at the end of
``PipelineRunner.step`` and before any optimizer step.

:func:`shared_parameter_groups` creates those groups correctly in a 3D layout, where many
pipelines run side by side and ``dist.new_group`` must be called by *every* rank of the world
for *every* group, in the same order: it learns every pipeline's global ranks with one
``all_gather_object`` and then creates one group per (logical name, pipeline), in sorted
order. Two copies on the same rank need no group: share the ``nn.Parameter`` object between
the two stage modules instead.

This module does not find shared parameters by itself (merak-graph detects them).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch import nn

__all__ = ["shared_parameter_groups", "shared_parameters_list"]

logger = logging.getLogger(__name__)


def shared_parameter_groups(
    copies: Mapping[str, Sequence[int]],
    *,
    group: dist.ProcessGroup | None = None,
    timeout: timedelta | None = None,
) -> dict[str, dist.ProcessGroup | None]:
    """Create the all-reduce groups of shared parameters; collective over the whole world.

    Args:
        copies: logical name -> the pipeline ranks (ranks within ``group``) that hold a copy.
            Every rank of the world passes the same mapping (all pipelines share one layout).
        group: this rank's pipeline process group (``None``: the default group, one pipeline).
        timeout: timeout of the created groups (default: the default group's).

    Returns:
        logical name -> the group to all-reduce this rank's copy over, or ``None`` when this
        rank holds no copy or every copy sits on one rank. Pass ``(param, group)`` pairs to
        ``PipelineRunner(shared_parameters=...)`` (see :func:`shared_parameters_list`).
    """
    pipe_size = dist.get_world_size(group)
    normalized: dict[str, tuple[int, ...]] = {}
    for name in sorted(copies):
        ranks = tuple(sorted({int(r) for r in copies[name]}))
        bad = [r for r in ranks if not 0 <= r < pipe_size]
        if bad or not ranks:
            raise ValueError(
                f"shared parameter {name!r}: pipeline ranks {list(copies[name])} must be non-empty and within "
                f"0..{pipe_size - 1} (the pipeline group has {pipe_size} ranks)"
            )
        normalized[name] = ranks
    my_pipeline = tuple(dist.get_global_rank(group, r) if group is not None else r for r in range(pipe_size))
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (my_pipeline, normalized))
    mappings = {repr(m) for _, m in gathered}
    if len(mappings) != 1:
        raise ValueError(
            "shared_parameter_groups was called with different mappings on different ranks: "
            f"{sorted(mappings)}; every rank of the world must pass the same mapping"
        )
    pipelines = sorted({p for p, _ in gathered})
    me = dist.get_rank()
    result: dict[str, dist.ProcessGroup | None] = {}
    for name, ranks in normalized.items():
        result[name] = None
        if len(ranks) < 2:
            continue
        for pipeline in pipelines:
            members = [pipeline[r] for r in ranks]
            created = (
                dist.new_group(members, timeout=timeout) if timeout is not None else dist.new_group(members)
            )
            if me in members:
                result[name] = created
        logger.debug(
            "shared parameter %s: groups over pipeline ranks %s in %d pipelines", name, ranks, len(pipelines)
        )
    return result


def shared_parameters_list(
    params: Mapping[str, nn.Parameter],
    groups: Mapping[str, dist.ProcessGroup | None],
) -> list[tuple[nn.Parameter, dist.ProcessGroup]]:
    """``[(param, group)]`` for ``PipelineRunner(shared_parameters=...)``: this rank's copies by name."""
    out = []
    for name, param in params.items():
        if name not in groups:
            raise ValueError(f"shared parameter {name!r} has no group; known names: {sorted(groups)}")
        grp = groups[name]
        if grp is not None:
            out.append((param, grp))
    return out
