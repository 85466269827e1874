"""The rank grid's arithmetic and its extra process groups, apart from the :class:`ParallelLayout`.

Owns the pure rank formulas of [Note: rank order] (in :mod:`merak_core.parallel.layout`): validating the
degrees (:func:`resolve_degrees`, :func:`check_ep`), a rank from its mesh coordinates and back
(:func:`rank_of`, :func:`coords_of`, :func:`cp_rank_of`), and the construction of the groups that are
not mesh axes: the DP x CP gradient-sync groups and the expert-parallel / expert-replica groups (see
[Note: expert-parallel groups]). :mod:`merak_core.parallel.layout` builds the layout from these and re-exports
the public names.
"""

from __future__ import annotations

from datetime import timedelta

import torch
from torch.distributed import ProcessGroup

from merak_core.parallel import _compat


def resolve_degrees(
    world_size: int, dp: int | None = None, tp: int = 1, pp: int = 1, *, cp: int = 1
) -> tuple[int, int, int]:
    """Validate ``dp*cp*tp*pp == world_size`` (inferring ``dp`` when it is None); return ``(dp, tp, pp)``.

    A pure function: no process group is touched, so a bad layout fails before any collective.
    ``cp`` is keyword-only (the context-parallel degree, default 1) so every 3-degree caller is unchanged.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"WORLD_SIZE must be a positive integer, got {world_size!r}")
    for name, value in (("tp", tp), ("pp", pp), ("cp", cp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}; pass e.g. {name}=1")
    others = tp * pp * cp
    names = "tp*pp" if cp == 1 else "cp*tp*pp"
    values = f"{tp}*{pp}" if cp == 1 else f"{cp}*{tp}*{pp}"
    if dp is None:
        if world_size % others:
            raise ValueError(
                f"{names}={values}={others} does not divide WORLD_SIZE={world_size}, so dp cannot be "
                f"inferred: choose {names.replace('*', ', ', names.count('*') - 1).replace('*', ' and ')} "
                f"whose product divides {world_size}"
            )
        dp = world_size // others
    elif isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp must be a positive integer or None (inferred), got {dp!r}")
    if dp * others != world_size:
        raise ValueError(
            f"dp*{names} must equal WORLD_SIZE={world_size} (got {dp}*{values}={dp * others}): "
            f"change the degrees, pass dp=None to infer it, or launch {dp * others} processes"
        )
    return dp, tp, pp


def rank_of(
    pp_rank: int, dp_rank: int, tp_rank: int, *, dp: int, tp: int, cp: int = 1, cp_rank: int = 0
) -> int:
    """Global rank at mesh coordinates ``(pp_rank, dp_rank, cp_rank, tp_rank)`` (see [Note: rank order])."""
    return ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank


def coords_of(rank: int, *, dp: int, tp: int, cp: int = 1) -> tuple[int, int, int]:
    """Mesh coordinates ``(pp_rank, dp_rank, tp_rank)`` of global ``rank`` (see [Note: rank order]).

    The CP coordinate is :func:`cp_rank_of`; kept apart so 3-D callers read the same triple.
    """
    tp_rank = rank % tp
    dp_rank = (rank // (tp * cp)) % dp
    pp_rank = rank // (tp * cp * dp)
    return pp_rank, dp_rank, tp_rank


def cp_rank_of(rank: int, *, tp: int, cp: int) -> int:
    """The context-parallel coordinate of global ``rank`` (see [Note: rank order])."""
    return (rank // tp) % cp


def _dp_cp_groups(grid: torch.Tensor, rank: int, timeout: timedelta) -> ProcessGroup:
    """Create every DP x CP group (same pp and tp coordinates; collective); return this rank's."""
    pp, dp, cp, tp = grid.shape
    mine = None
    for ranks_t in grid.permute(0, 3, 1, 2).reshape(pp * tp, dp * cp):
        ranks = [int(r) for r in ranks_t]
        group = _compat.new_group(ranks, timeout, None)
        if rank in ranks:
            mine = group
    assert mine is not None
    return mine


# [Note: expert-parallel groups] EP ranks are DP ranks of one stage/cp/tp coordinate: the DP axis is
# cut into dp / ep blocks of ep consecutive DP indices. The ep ranks of a block form an EP group
# (they exchange tokens; ep rank = dp_rank % ep holds experts [ep_rank * E / ep, (ep_rank + 1) * E / ep));
# the ranks with the same ep rank in every block hold the same experts: the expert-replica group
# (dp / ep ranks) over which expert gradients are summed. Dense parameters stay replicated over DP.


def check_ep(dp: int, ep: int) -> None:
    """ValueError unless ``ep`` is a positive integer dividing ``dp`` (pure: before any collective)."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"ep must be a positive integer, got {ep!r}; pass e.g. ep=1 (no expert parallelism)")
    if dp % ep:
        raise ValueError(
            f"ep={ep} does not divide dp={dp}: expert-parallel ranks are carved out of the data-parallel ranks "
            f"of a stage, so choose an ep dividing {dp} (or launch dp = a multiple of {ep})"
        )


def _ep_groups(
    grid: torch.Tensor, rank: int, ep: int, timeout: timedelta
) -> tuple[ProcessGroup, ProcessGroup]:
    """Create every EP group, then every expert-replica group (collective); return this rank's two."""
    pp, dp, cp, tp = grid.shape
    # (pp, cp, tp, blocks, ep): the last axis is an EP group, the blocks axis an expert-replica group.
    blocks = grid.permute(0, 2, 3, 1).reshape(pp, cp, tp, dp // ep, ep)
    mine: list[ProcessGroup] = []
    for rows in (blocks.reshape(-1, ep), blocks.transpose(-1, -2).reshape(-1, dp // ep)):
        for ranks_t in rows:
            ranks = [int(r) for r in ranks_t]
            group = _compat.new_group(ranks, timeout, None)
            if rank in ranks:
                mine.append(group)
    assert len(mine) == 2
    return mine[0], mine[1]


__all__ = ["check_ep", "coords_of", "cp_rank_of", "rank_of", "resolve_degrees"]
