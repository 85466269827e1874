"""merak-tp's version-dependent collective names (issue 25, item 2).

torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``all_gather_single`` /
``reduce_scatter_single``; torch 2.11 has only the old names. With the new names removed, merak-tp's
dim-0 all-gather and reduce-scatter (and a TP layer's forward and backward built on them) give the
same results at tp=2 as with them.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from merak_tp import _compat
from tests.support.dist import run_on_ranks

NEW_NAMES = ("all_gather_single", "reduce_scatter_single")


def _collectives(remove_new_names: bool) -> tuple[torch.Tensor, torch.Tensor]:
    saved = {name: getattr(dist, name) for name in NEW_NAMES if hasattr(dist, name)}
    if remove_new_names:
        for name in saved:
            delattr(dist, name)
    try:
        rank = dist.get_rank()
        x = torch.arange(6, dtype=torch.float64).reshape(3, 2) + 10 * rank
        gathered = torch.empty(6, 2, dtype=torch.float64)
        _compat.all_gather_dim0(gathered, x, None)
        scattered = torch.empty(3, 2, dtype=torch.float64)
        work = _compat.reduce_scatter_dim0(scattered, torch.cat([x, 2 * x]), None, async_op=True)
        assert work is not None
        work.wait()
        return gathered, scattered
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def test_dim0_collectives_without_the_new_names() -> None:
    if not any(hasattr(dist, name) for name in NEW_NAMES):
        pytest.skip("this torch has only the old names: the fallback is what always runs")
    with_new = run_on_ranks(2, _collectives, False)
    with_old = run_on_ranks(2, _collectives, True)
    base = torch.arange(6, dtype=torch.float64).reshape(3, 2)
    for rank, ((g_new, s_new), (g_old, s_old)) in enumerate(zip(with_new, with_old, strict=True)):
        assert torch.equal(g_new, g_old) and torch.equal(s_new, s_old), f"rank {rank}"
        assert torch.equal(g_old, torch.cat([base, base + 10]))
        assert torch.equal(s_old, (1 + rank) * (2 * base + 10))  # rank r keeps block r of sum(x_r, 2 x_r)


def test_neither_name_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*NEW_NAMES, "all_gather_into_tensor"):
        monkeypatch.delattr(dist, name, raising=False)
    with pytest.raises(
        RuntimeError, match=r"neither torch.distributed.all_gather_single nor all_gather_into_tensor"
    ):
        _compat.all_gather_dim0(torch.empty(2), torch.empty(1), None)
