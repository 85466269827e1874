"""Version-dependent torch.distributed entry points, in one place.

torch 2.13 renamed ``all_gather_into_tensor``/``reduce_scatter_tensor`` to
``all_gather_single``/``reduce_scatter_single`` (the old names warn). Both
gather or scatter along dim 0 of contiguous tensors.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


def _collective(new_name: str, old_name: str) -> Any:
    """torch.distributed's collective under its new name, else under the old one (looked up per call)."""
    fn = getattr(dist, new_name, None) or getattr(dist, old_name, None)
    if fn is None:
        raise RuntimeError(
            f"torch {torch.__version__} has neither torch.distributed.{new_name} nor {old_name}: "
            "merak-tp needs one of them (torch >= 2.11)"
        )
    return fn


def all_gather_dim0(
    out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup | None, async_op: bool = False
) -> dist.Work | None:
    """All-gather ``inp`` from every rank of ``group`` into ``out`` along dim 0."""
    return _collective("all_gather_single", "all_gather_into_tensor")(
        out, inp, group=group, async_op=async_op
    )


def reduce_scatter_dim0(
    out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup | None, async_op: bool = False
) -> dist.Work | None:
    """Sum ``inp`` over ``group`` and keep this rank's dim-0 slice in ``out``."""
    return _collective("reduce_scatter_single", "reduce_scatter_tensor")(
        out, inp, group=group, async_op=async_op
    )


def register_grad_hook(param: torch.Tensor, hook: Any) -> None:
    """``param.register_hook(hook)``, also recorded in ``param._merak_grad_hooks``.

    merak-graph makes tensors in a parameter's place (materialising a meta model, building a stage's
    copy) and carries its hooks over from torch's private hook table; where a torch lacks that table,
    it re-registers the recorded ones (``merak_graph._compat.RECORDED_GRAD_HOOKS``, the same name).
    """
    param.register_hook(hook)
    param.__dict__.setdefault("_merak_grad_hooks", []).append(hook)
