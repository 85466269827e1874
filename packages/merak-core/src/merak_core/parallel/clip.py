"""Global gradient-norm clipping that is correct across DP, TP and PP.

The global norm is the norm of the gradient of the *logical* (unsharded,
single-process) model, so every logical parameter must be counted exactly once:

- **TP**: a parameter whose ``merak_tp.ShardSpec`` has a ``dim`` (the dim it is sharded
  along over the TP group, set by merak-tp) contributes its local shard on every TP
  rank, and the shards' partial sums are added over the TP group. A parameter
  without the tag (or with ``None``) is replicated over TP, so it is counted on
  TP rank 0 only (counting once exactly, instead of dividing by ``tp``, keeps the
  float result identical to the single-process one).
- **PP**: each stage holds different parameters, so partial sums are added over
  the PP group; a parameter shared by several stages (a tied embedding) is named
  by the caller in ``shared_params`` with the one stage that counts it.
- **DP**: gradients are already averaged over DP (identical on every DP rank), so
  nothing is reduced over DP; under ZeRO-2/3 a gradient is a ``DTensor`` sharded over
  the DP mesh, each DP rank holds a distinct part, and the partial sums of those shards
  are added over that mesh's group too.
- **EP**: an expert is held by one rank of each EP group; its term is summed over the EP
  group (``expert_params``). Under ZeRO-2/3 an expert's gradient is sharded over its
  replica group instead (or whole at ``dp == ep``), so each of its elements is on one rank
  of the DP group and the DP sum above counts it once
  ([Note: ZeRO-2/3 with experts] in ``merak_core.parallel.zero_experts``).

Then every local gradient is scaled by ``min(1, max_norm / (norm + 1e-6))``,
exactly as ``torch.nn.utils.clip_grad_norm_`` does. Norms and scaling run as multi-tensor
kernels, one per device and dtype (``torch._foreach_norm`` / ``_foreach_mul_`` through
``merak_core.parallel._compat``), not a few kernels per parameter.

Not done here: synchronising shared parameters' gradients (the trainer does it
before clipping) or clipping per parameter group.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from merak_core.parallel import _compat
from merak_core.parallel.fsdp import is_sharded, local_tensor
from merak_core.parallel.layout import ParallelLayout
from merak_tp.shard_spec import get_shard_spec

logger = logging.getLogger(__name__)

SharedParams = Mapping[torch.Tensor, int] | Mapping[nn.Parameter, int]
"""Parameter held by several pipeline stages -> the stage (rank in the PP group) that counts it."""

_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s epsilon


def is_tp_sharded(param: torch.Tensor) -> bool:
    """True when ``param`` is a TP shard (its ``ShardSpec`` names a sharded dim)."""
    return get_shard_spec(param).sharded


def global_grad_norm(
    parameters: Iterable[torch.Tensor],
    *,
    norm_type: float = 2.0,
    tp_group: ProcessGroup | None = None,
    pp_group: ProcessGroup | None = None,
    layout: ParallelLayout | None = None,
    shared_params: SharedParams | None = None,
    expert_params: Iterable[torch.Tensor] = (),
    grad_shard_group: ProcessGroup | None = None,
) -> torch.Tensor:
    """The norm of the logical model's gradient (see the module docstring for the counting rules).

    ``expert_params`` (with a ``layout`` at ep > 1): parameters sharded over the EP group (each rank
    holds other experts, merak_core.parallel.expert_parallel); their terms are summed over ``layout.ep_group``.

    Collective over ``tp_group`` and ``pp_group`` (or ``layout``'s groups); a group of
    ``None`` without a layout means that axis has size 1. ``shared_params`` maps a
    parameter held by several pipeline stages to the stage index (rank in
    ``pp_group``) whose copy is counted. ``grad_shard_group``: each of its ranks holds the gradients
    of a disjoint subset of the parameters (ZeRO-1's reduce-scatter), the others are ``None``:
    the terms are summed over it too.
    """
    if layout is not None:
        if tp_group is not None or pp_group is not None:
            raise ValueError("pass either layout or tp_group/pp_group, not both")
        tp_group, pp_group = layout.tp_group, layout.pp_group
    norm_type = float(norm_type)
    if not (norm_type > 0 or math.isinf(norm_type)):
        raise ValueError(f"norm_type must be > 0 or inf, got {norm_type}")
    tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
    pp_rank = dist.get_rank(pp_group) if pp_group is not None else 0
    shared = {id(p): stage for p, stage in (shared_params or {}).items()}
    params = _unique(parameters)
    grads = []
    kept: list[torch.Tensor] = []  # the parameter of each entry of grads
    for p in params:
        if p.grad is None:
            continue
        if not is_tp_sharded(p) and tp_rank != 0:
            continue  # replicated over TP: counted on TP rank 0
        owner = shared.get(id(p))
        if owner is not None and owner != pp_rank:
            continue  # shared across stages: counted on its owner stage
        grads.append(p.grad.detach())
        kept.append(p)
    dp_sharded = _sharded_group(
        [p.grad for p in params if p.grad is not None], layout
    )  # before the TP/PP filter
    grads = [local_tensor(g) for g in grads]
    op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
    # ZeRO-2/3: each expert element is on one DP rank ([Note: ZeRO-2/3 with experts]): the DP sum counts it
    by_ep = layout is not None and layout.ep > 1 and dp_sharded is None
    experts = {id(p) for p in expert_params} if by_ep else set()
    if experts:  # every rank of an EP group holds the same blocks: all of them or none reduce here
        expert_grads = [g for p, g in zip(kept, grads, strict=True) if id(p) in experts]
        grads = [g for p, g in zip(kept, grads, strict=True) if id(p) not in experts]
        expert_term = _local_norm_term(expert_grads, norm_type, _device_of(params, layout))
        assert layout is not None and layout.ep_group is not None
        dist.all_reduce(expert_term, op=op, group=layout.ep_group)
    local = _local_norm_term(grads, norm_type, _device_of(params, layout))
    if experts:
        local = torch.maximum(local, expert_term) if math.isinf(norm_type) else local + expert_term
    for group in (tp_group, pp_group, dp_sharded or grad_shard_group):
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(local, op=op, group=group)
    return local if math.isinf(norm_type) else local ** (1.0 / norm_type)


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    *,
    norm_type: float = 2.0,
    tp_group: ProcessGroup | None = None,
    pp_group: ProcessGroup | None = None,
    layout: ParallelLayout | None = None,
    shared_params: SharedParams | None = None,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Scale this rank's gradients so the logical model's gradient norm is at most ``max_norm``.

    Returns the global norm before clipping (float64, the same value on every rank).
    ``torch.nn.utils.clip_grad_norm_`` semantics: coefficient
    ``min(1, max_norm / (norm + 1e-6))``; see :func:`global_grad_norm` for the arguments.
    """
    if not max_norm > 0:
        raise ValueError(
            f"max_norm must be > 0, got {max_norm}; to disable clipping do not call clip_grad_norm_"
        )
    params = _unique(parameters)
    total = global_grad_norm(
        params,
        norm_type=norm_type,
        tp_group=tp_group,
        pp_group=pp_group,
        layout=layout,
        shared_params=shared_params,
    )
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()}), so it cannot "
            "be clipped; pass error_if_nonfinite=False to scale by the non-finite coefficient anyway"
        )
    scale_gradients_(params, max_norm, total)
    return total


def scale_gradients_(parameters: Iterable[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """The scaling half of :func:`clip_grad_norm_`: multiply every gradient by ``min(1, max_norm / (norm + 1e-6))``.

    For callers that computed ``total_norm`` with :func:`global_grad_norm` and checked it first.
    """
    coef = torch.clamp(max_norm / (total_norm + _EPS), max=1.0)
    grads = [local_tensor(p.grad.detach()) for p in _unique(parameters) if p.grad is not None]
    for (device, dtype), group in _by_device_and_dtype(grads).items():
        _compat.foreach_mul_(group, coef.to(device=device, dtype=dtype))


def _by_device_and_dtype(
    tensors: list[torch.Tensor],
) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return groups


def _local_norm_term(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """This rank's part of the global norm: the sum of ``|g|_p ** p`` over ``grads`` (the max for inf).

    Per-tensor norms in the gradient's precision (at least float32), one multi-tensor kernel per
    device and dtype (``_compat.foreach_norm``); combined and returned in float64 on ``device`` so
    every rank reduces the same dtype whatever its stage holds.
    """
    parts = [
        torch.stack(_compat.foreach_norm(group, norm_type, torch.promote_types(dtype, torch.float32)))
        for (_, dtype), group in _by_device_and_dtype(grads).items()
    ]
    if not parts:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch.cat([part.to(device=device, dtype=torch.float64) for part in parts])
    return norms.max() if math.isinf(norm_type) else (norms**norm_type).sum()


def _sharded_group(grads: list[torch.Tensor], layout: ParallelLayout | None) -> ProcessGroup | None:
    """The DP group of ZeRO-2/3 gradients (DTensors on a 1-D mesh), or None for plain gradients.

    With a layout: its ``grad_sync_group`` (the dense parameters' mesh; an expert's gradient is on its
    replica group's mesh, a part of that group). Without: the mesh of the first sharded gradient.
    """
    for g in grads:
        if is_sharded(g):
            return layout.grad_sync_group if layout is not None else g.device_mesh.get_group(0)  # type: ignore[attr-defined]
    return None


def _unique(parameters: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    seen: set[int] = set()
    out = []
    for p in parameters:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _device_of(params: list[torch.Tensor], layout: ParallelLayout | None) -> torch.device:
    if layout is not None:
        return layout.device
    for p in params:
        return p.device
    return torch.device("cpu")


__all__ = ["SharedParams", "clip_grad_norm_", "global_grad_norm", "is_tp_sharded", "scale_gradients_"]
