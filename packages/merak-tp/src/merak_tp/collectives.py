"""Differentiable collectives for tensor parallelism, with mirrored forward/backward.

Each is a small named ``torch.autograd.Function`` taking the TP process group:

=============================  ===================  ======================
function                       forward              backward
=============================  ===================  ======================
``copy_to_tp_region``          identity             all-reduce
``reduce_from_tp_region``      all-reduce           identity
``scatter_to_tp_region``       split (keep shard)   all-gather
``gather_from_tp_region``      all-gather           split (keep shard)
``scatter_to_sequence_region`` split along seq      all-gather along seq
``gather_from_sequence_region``all-gather along seq reduce-scatter along seq
``reduce_scatter_to_sequence`` reduce-scatter seq   all-gather along seq
=============================  ===================  ======================

Splits are contiguous equal blocks in rank order; a size that the group size
does not divide raises ``ValueError``. Not here: the chunked (overlapped)
linear functions, which live in ``_linear_fns.py`` / ``overlap.py``.

[Note: autocast in backward] Every autograd function of merak-tp wraps its
``forward`` in :func:`amp_forward` and its ``backward`` in :func:`amp_backward`:
torch's ``torch.amp.custom_fwd`` / ``custom_bwd`` for every autocast device type
at once (torch's decorators take one ``device_type``, and the layers run on CPU
and CUDA alike). The backward then runs under the autocast state of its forward,
wherever autograd runs it: on CUDA the backward runs on autograd's device thread,
outside the caller's ``torch.autocast``, and a bf16 gradient would otherwise meet
a float32 weight in a matmul.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from merak_tp import _compat

__all__ = [
    "amp_backward",
    "amp_forward",
    "copy_to_tp_region",
    "gather_from_sequence_region",
    "gather_from_tp_region",
    "reduce_from_tp_region",
    "reduce_scatter_to_sequence_region",
    "scatter_to_sequence_region",
    "scatter_to_tp_region",
    "tp_rank",
    "tp_size",
]


_AMP_DEVICE_TYPES = ("cuda", "cpu")
"""Device types whose autocast state :func:`amp_forward` records (see [Note: autocast in backward])."""

_F = TypeVar("_F", bound=Callable[..., Any])


def amp_forward(forward: _F) -> _F:
    """``torch.amp.custom_fwd`` for every autocast device type: record the autocast state on ``ctx``."""

    @functools.wraps(forward)
    def wrapped(ctx: Any, *args: Any, **kwargs: Any) -> Any:
        ctx._merak_autocast = tuple(
            (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
            for device_type in _AMP_DEVICE_TYPES
        )
        return forward(ctx, *args, **kwargs)

    wrapped._merak_amp = "forward"  # type: ignore[attr-defined]
    return wrapped  # type: ignore[return-value]


def amp_backward(backward: _F) -> _F:
    """``torch.amp.custom_bwd`` for every autocast device type: run backward under the forward's autocast state."""

    @functools.wraps(backward)
    def wrapped(ctx: Any, *grads: Any) -> Any:
        with contextlib.ExitStack() as stack:
            for device_type, enabled, dtype in ctx._merak_autocast:
                stack.enter_context(torch.autocast(device_type, enabled=enabled, dtype=dtype))
            return backward(ctx, *grads)

    wrapped._merak_amp = "backward"  # type: ignore[attr-defined]
    return wrapped  # type: ignore[return-value]


def tp_size(group: ProcessGroup | None) -> int:
    """Number of ranks in the TP group (1 when torch.distributed is not initialised)."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def tp_rank(group: ProcessGroup | None) -> int:
    """This process's rank inside the TP group (0 when not initialised)."""
    if not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def _check_divisible(size: int, world: int, what: str) -> None:
    if size % world:
        raise ValueError(
            f"{what}={size} is not divisible by the tensor-parallel size {world}: "
            f"choose a TP degree that divides {size}"
        )


def _split(x: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
    world = tp_size(group)
    if world == 1:
        return x
    _check_divisible(x.size(dim), world, f"size of dim {dim}")
    return x.chunk(world, dim=dim)[tp_rank(group)].contiguous()


def _all_gather(x: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
    world = tp_size(group)
    if world == 1:
        return x
    d = dim % x.dim()
    x0 = x.movedim(d, 0).contiguous()
    out = torch.empty((world * x0.size(0), *x0.shape[1:]), dtype=x.dtype, device=x.device)
    _compat.all_gather_dim0(out, x0, group)
    return out.movedim(0, d).contiguous() if d else out


def _reduce_scatter(x: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
    world = tp_size(group)
    if world == 1:
        return x
    d = dim % x.dim()
    _check_divisible(x.size(d), world, f"size of dim {d}")
    x0 = x.movedim(d, 0).contiguous()
    out = torch.empty((x0.size(0) // world, *x0.shape[1:]), dtype=x.dtype, device=x.device)
    _compat.reduce_scatter_dim0(out, x0, group)
    return out.movedim(0, d).contiguous() if d else out


def _all_reduce(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    if tp_size(group) == 1:
        return x
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    @amp_forward
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    @amp_backward
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    @amp_forward
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    @amp_backward
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return grad, None


_DimOp = Callable[[torch.Tensor, int, ProcessGroup | None], torch.Tensor]


def _mirrored(name: str, forward_op: _DimOp, backward_op: _DimOp) -> type[torch.autograd.Function]:
    """An autograd function along one dim: ``forward_op`` forward, its mirror ``backward_op`` backward."""

    @amp_forward
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return forward_op(x, dim, group)

    @amp_backward
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return backward_op(grad, ctx.dim, ctx.group), None, None

    namespace = {"forward": staticmethod(forward), "backward": staticmethod(backward), "__module__": __name__}
    return type(name, (torch.autograd.Function,), namespace)


# forward op, backward op: each pair is the other's mirror.
_ScatterToRegion = _mirrored("_ScatterToRegion", _split, _all_gather)
_GatherFromRegion = _mirrored("_GatherFromRegion", _all_gather, _split)
_GatherFromSequence = _mirrored("_GatherFromSequence", _all_gather, _reduce_scatter)
_ReduceScatterToSequence = _mirrored("_ReduceScatterToSequence", _reduce_scatter, _all_gather)


def copy_to_tp_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Identity forward, all-reduce of the gradient backward (entry of a column layer)."""
    return _CopyToRegion.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """All-reduce forward, identity backward (exit of a row layer)."""
    return _ReduceFromRegion.apply(x, group)


def scatter_to_tp_region(x: torch.Tensor, group: ProcessGroup | None, dim: int = -1) -> torch.Tensor:
    """Keep this rank's block of ``dim`` forward; all-gather the gradient backward."""
    return _ScatterToRegion.apply(x, dim, group)


def gather_from_tp_region(x: torch.Tensor, group: ProcessGroup | None, dim: int = -1) -> torch.Tensor:
    """All-gather along ``dim`` forward; keep this rank's block of the gradient backward."""
    return _GatherFromRegion.apply(x, dim, group)


def scatter_to_sequence_region(x: torch.Tensor, group: ProcessGroup | None, dim: int = 1) -> torch.Tensor:
    """Enter sequence parallelism: keep this rank's sequence block; all-gather backward."""
    return _ScatterToRegion.apply(x, dim, group)


def gather_from_sequence_region(x: torch.Tensor, group: ProcessGroup | None, dim: int = 1) -> torch.Tensor:
    """All-gather the sequence forward; reduce-scatter the (partial) gradient backward."""
    return _GatherFromSequence.apply(x, dim, group)


def reduce_scatter_to_sequence_region(
    x: torch.Tensor, group: ProcessGroup | None, dim: int = 1
) -> torch.Tensor:
    """Sum partial results and keep this rank's sequence block; all-gather backward."""
    return _ReduceScatterToSequence.apply(x, dim, group)
