"""The chunked autograd functions behind the column and row parallel linears.

[Note: layer-level overlap] With ``chunks = k > 1`` the batch (dim 0) is cut
into k sub-microbatches:

- row forward: chunk j's partial product is computed, its all-reduce (or
  reduce-scatter) is launched asynchronously, and chunk j+1 is computed while
  it is in flight; all handles are waited at the end;
- column backward: chunk j's input gradient is computed and its all-reduce
  launched, chunk j+1's input gradient is computed while it is in flight, and
  the weight gradient (one matmul over all chunks) runs while the last ones
  are in flight.

k = 1 is the plain Megatron math. The numbers equal k = 1 up to the summation
order of a matmul split by rows (bit-identical on most BLAS builds).

Shape legend: ``*`` leading dims (batch first), i in-features, o out-features.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from merak_tp import _compat
from merak_tp._events import _record, _RegionState
from merak_tp.collectives import _all_gather, amp_backward, amp_forward


@dataclass(frozen=True)
class _LinearCall:
    """What one forward of a parallel linear asks of :class:`_ParallelLinearFn`: the layer's options and its
    region's state for this call."""

    kind: str
    """``"column"`` or ``"row"``."""
    group: ProcessGroup | None
    chunks: int
    """Sub-microbatches along dim 0 whose collectives overlap the next one's compute (1: none)."""
    name: str
    """The layer's name in overlap events."""
    region_chunk: int
    """The enclosing block-mode region's chunk (events); 0 elsewhere."""
    reduce_input_grad: bool = False
    """Column: all-reduce the input gradient here (else the region, the sequence gather, or nobody at tp=1)."""
    mode: str = "all_reduce"
    """Row: ``"all_reduce"`` or ``"reduce_scatter"`` (along ``seq_dim``) of the partial products."""
    seq_dim: int = 1
    """Row: the sequence dim the reduce-scatter splits."""
    defer: _RegionState | None = None
    """Row in a block-mode region: the last wait is left to the region (handles to ``defer.pending_fwd``)."""


def _chunks(x: torch.Tensor, k: int) -> list[torch.Tensor]:
    if k <= 1 or x.dim() < 2 or x.size(0) < 2:
        return [x]
    return list(x.chunk(k, dim=0))


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.size(-1))


class _ParallelLinearFn(torch.autograd.Function):
    """``y = x W^T + b`` with a column layer's collectives (the input gradient all-reduced over the group,
    chunked, in backward) or a row layer's (``y = reduce(x W^T) + b``, chunked, in forward), by ``call.kind``."""

    @staticmethod
    @amp_forward
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, call: _LinearCall
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.call = bias is not None, call
        if call.kind == "row":
            return _row_forward(x, weight, bias, call)
        y = F.linear(x, weight, bias)
        _record("compute", "fwd", call.name, call.region_chunk)
        return y

    @staticmethod
    @amp_backward
    def backward(ctx: Any, grad_y: torch.Tensor) -> Any:
        x, weight = ctx.saved_tensors
        backward = _row_backward if ctx.call.kind == "row" else _column_backward
        return (*backward(ctx, grad_y, x, weight), None)


def _weight_grads(ctx: Any, grad_y: torch.Tensor, x: torch.Tensor) -> tuple[Any, Any]:
    grad_w = _flat(grad_y).t().matmul(_flat(x)) if ctx.needs_input_grad[1] else None
    grad_b = _flat(grad_y).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return grad_w, grad_b


def _column_backward(
    ctx: Any, grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor
) -> tuple[Any, ...]:
    """The column layer's gradients: chunk j's input gradient all-reduced while chunk j+1's is computed."""
    call: _LinearCall = ctx.call
    grad_x = grad_w = grad_b = None
    handles: list[tuple[Any, int]] = []
    if ctx.needs_input_grad[0]:
        parts = []
        for j, g in enumerate(_chunks(grad_y, call.chunks)):
            gx = g.matmul(weight)
            chunk = call.region_chunk + j
            _record("compute", "bwd", call.name, chunk)
            if call.reduce_input_grad:
                handles.append((dist.all_reduce(gx, group=call.group, async_op=True), chunk))
                _record("launch", "bwd", call.name, chunk)
            parts.append(gx)
        if handles:
            # Weight gradients overlap with the last input-gradient all-reduces.
            grad_w, grad_b = _weight_grads(ctx, grad_y, x)
            for h, chunk in handles:
                h.wait()
                _record("wait", "bwd", call.name, chunk)
        grad_x = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    if not handles:
        grad_w, grad_b = _weight_grads(ctx, grad_y, x)
    return grad_x, grad_w, grad_b


def _row_forward(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, call: _LinearCall
) -> torch.Tensor:
    """The row layer's output: chunk j's partial product reduced while chunk j+1's is computed; with
    ``call.defer`` the output is returned while its reduction may still be in flight (the region waits
    before anything reads it)."""
    group, defer, name = call.group, call.defer, call.name
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    outs: list[torch.Tensor] = []
    handles: list[tuple[Any, int]] = []
    for j, xj in enumerate(_chunks(x, call.chunks)):
        chunk = call.region_chunk + j
        # The bias is added once, on rank 0, before the sum: the sum then holds it once.
        yj = F.linear(xj, weight, bias if rank == 0 else None)
        _record("compute", "fwd", name, chunk)
        if call.mode == "all_reduce":
            handles.append((dist.all_reduce(yj, group=group, async_op=True), chunk))
            outs.append(yj)
        else:
            d = call.seq_dim % yj.dim()
            if yj.size(d) % world:
                raise ValueError(
                    f"sequence length {yj.size(d)} (dim {d}) is not divisible by the tensor-parallel "
                    f"size {world}: sequence parallelism needs a multiple of {world}"
                )
            y0 = yj.movedim(d, 0).contiguous()
            out0 = torch.empty((y0.size(0) // world, *y0.shape[1:]), dtype=y0.dtype, device=y0.device)
            handles.append((_compat.reduce_scatter_dim0(out0, y0, group, async_op=True), chunk))
            # Deferred: return the buffer itself (a view of a buffer written in flight is refused
            # by autograd); the caller moves the sequence dim back (see RowParallelLinear.forward).
            outs.append(out0 if defer is not None else out0.movedim(0, d))
        _record("launch", "fwd", name, chunk)
    if defer is not None:
        defer.pending_fwd.extend((h, name, c) for h, c in handles)
    else:
        for h, chunk in handles:
            h.wait()
            _record("wait", "fwd", name, chunk)
    y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
    return y if defer is not None or call.mode == "all_reduce" else y.contiguous()


def _row_backward(ctx: Any, grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> tuple[Any, ...]:
    """The row layer's gradients: the output gradient gathered back along the sequence first (sequence parallel)."""
    call: _LinearCall = ctx.call
    if call.defer is not None and call.mode == "reduce_scatter":  # the output was left sequence-first
        grad_y = _all_gather(grad_y, 0, call.group).movedim(0, call.seq_dim % x.dim())
    elif call.mode == "reduce_scatter":
        grad_y = _all_gather(grad_y, call.seq_dim, call.group)
    grad_x = grad_y.matmul(weight) if ctx.needs_input_grad[0] else None
    grad_w, grad_b = _weight_grads(ctx, grad_y, x)
    _record("compute", "bwd", call.name, call.region_chunk)
    return grad_x, grad_w, grad_b
