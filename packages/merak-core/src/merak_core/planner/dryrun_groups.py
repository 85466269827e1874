"""The dry run's process groups: every rank's (dp, tp, pp, cp) group ranks, built by the real layout
code over torch's fake process group and checked against the rank formula
(``rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank``, [Note: rank order]).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

__all__ = ["Groups", "build_groups", "computed_groups", "sample_ranks"]

Groups = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]
"""A rank's (dp, tp, pp, cp) group ranks; the cp group is empty at cp=1."""


def computed_groups(rank: int, dp: int, tp: int, pp: int, cp: int = 1) -> Groups:
    """``rank``'s groups from the rank formula."""
    from merak_core.parallel.rank_grid import coords_of, cp_rank_of, rank_of

    p, d, t = coords_of(rank, dp=dp, tp=tp, cp=cp)
    c = cp_rank_of(rank, tp=tp, cp=cp)
    return (
        tuple(rank_of(p, x, t, dp=dp, tp=tp, cp=cp, cp_rank=c) for x in range(dp)),
        tuple(rank_of(p, d, x, dp=dp, tp=tp, cp=cp, cp_rank=c) for x in range(tp)),
        tuple(rank_of(x, d, t, dp=dp, tp=tp, cp=cp, cp_rank=c) for x in range(pp)),
        tuple(rank_of(p, d, t, dp=dp, tp=tp, cp=cp, cp_rank=x) for x in range(cp)) if cp > 1 else (),
    )


def sample_ranks(world_size: int, dp: int, tp: int, pp: int, limit: int, cp: int = 1) -> list[int]:
    """Every rank up to ``limit``; beyond, the first node, the first and last rank of every stage, the last rank."""
    if world_size <= limit:
        return list(range(world_size))
    stride = dp * cp * tp
    picks = {*range(min(limit // 2, world_size)), world_size - 1}
    for s in range(pp):
        picks.update((s * stride, (s + 1) * stride - 1))
    return sorted(picks)


def build_groups(
    world_size: int, dp: int, tp: int, pp: int, ranks: Sequence[int], cp: int = 1
) -> tuple[dict[int, Groups], str]:
    """The (dp, tp, pp, cp) group ranks of ``ranks``, as the real layout code builds them over a fake process group.

    [Note: dry-run groups] Every rank creates every group (``new_group`` is collective), so building
    all N ranks costs O(N^2) group creations: 1024 ranks would take minutes. ``ranks`` may be a
    sample; the other ranks' groups come from the layout's rank formula, which the sampled ranks
    check against what the real code built.
    """
    import torch.distributed as dist

    from merak_core.parallel import _compat
    from merak_core.parallel.layout import ParallelLayout

    fake = _compat.fake_process_group_store()
    if fake is None or dist.is_initialized():
        return (
            {r: computed_groups(r, dp, tp, pp, cp) for r in range(world_size)},
            "computed from the rank formula (no fake process group available)",
        )
    out = {}
    previous = logging.getLogger("merak_core.parallel.layout").level
    logging.getLogger("merak_core.parallel.layout").setLevel(logging.WARNING)
    try:
        for r in ranks:
            dist.init_process_group("fake", rank=r, world_size=world_size, store=fake())
            try:
                lay = ParallelLayout.build(dp, tp, pp, cp=cp, device="cpu")
                out[r] = (
                    tuple(dist.get_process_group_ranks(lay.dp_group)),
                    tuple(dist.get_process_group_ranks(lay.tp_group)),
                    tuple(dist.get_process_group_ranks(lay.pp_group)),
                    tuple(dist.get_process_group_ranks(lay.cp_group)) if cp > 1 else (),
                )
            finally:
                dist.destroy_process_group()
    finally:
        logging.getLogger("merak_core.parallel.layout").setLevel(previous)
    for r, built in out.items():
        if built != computed_groups(r, dp, tp, pp, cp):
            raise RuntimeError(
                f"rank {r}: the layout built groups {built} but the rank formula gives "
                f"{computed_groups(r, dp, tp, pp, cp)}"
            )
    how = "torch fake process group"
    if len(out) < world_size:
        how += f" for {len(out)} sampled ranks, the rest from the rank formula they match"
    for r in range(world_size):
        out.setdefault(r, computed_groups(r, dp, tp, pp, cp))
    return out, how
