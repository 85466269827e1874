"""TP regions: sub-pipelined (overlapped) blocks and sequence-parallel entry points.

A *region* is a module whose forward is "column layers -> local compute -> one
row layer" (an attention or MLP block of any model family). ``make_region``
turns a module into one in place: its class is swapped for a subclass that
adds the region behaviour (so module names and attributes are unchanged, and
``isinstance(module, TPRegion)`` makes it an opaque leaf for an fx tracer).

[Note: block-level overlap] With ``chunks = k > 1`` the region runs its forward
once per sub-microbatch (split along dim 0 of the first input and of every
other tensor input with 3+ dims and the same leading size). The row layer of
chunk j launches its all-reduce and returns without waiting; chunk j+1's
column layers and local compute run while it is in flight; the region waits
for all of them before concatenating the outputs. Backward mirrors it: each
chunk's entry all-reduces the (summed) input gradient of all its column layers
asynchronously, while the autograd engine computes the previous chunk; the
region's split waits for all before the gradient leaves the region.

Returning a tensor whose reduction is still in flight is only safe when nothing
inside the region reads it, i.e. when the row layer's output *is* the region's
output (or the first item of a tuple output). The first call checks this
("probe" mode: layers run on their own, with their layer-level overlap); a
region whose output is something else (say, dropout after the row layer) is
logged and keeps running whole, with layer-level overlap only.

Sequence parallel regions (``sequence_parallel=True``) all-gather the first
input along the sequence on entry (reduce-scatter of its gradient); their row
layers reduce-scatter. Sub-pipelined, each chunk is gathered on entry, its
row reduce-scatter is left in flight, and its entry's gradient reduce-scatter
runs asynchronously in backward. ``make_sequence_scatter`` marks the module
where the residual stream enters sequence parallelism.

What a region or a boundary needs per module (group, sequence dim, run-time state) is its
``ModuleSpec`` (see [Note: module specs]), never an attribute written into the user's module.

A region's own bookkeeping runs untraced under torch.compile ([Note: region bookkeeping is not
traced] in ``merak_tp._untraced``).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from merak_tp import _compat
from merak_tp._events import _GroupRef, _record, _RegionState
from merak_tp._untraced import _not_traced
from merak_tp.collectives import (
    _all_gather,
    amp_backward,
    amp_forward,
    gather_from_sequence_region,
    gather_from_tp_region,
    scatter_to_sequence_region,
)
from merak_tp.linear import ColumnParallelLinear, RowParallelLinear
from merak_tp.module_spec import SequenceBoundary, deepcopy_module, get_module_spec, set_module_spec

logger = logging.getLogger(__name__)

__all__ = [
    "SequenceGather",
    "SequenceScatter",
    "TPRegion",
    "make_region",
    "make_sequence_gather",
    "make_sequence_scatter",
    "remove_region",
]


class _RegionEntry(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient asynchronously (block mode)."""

    @staticmethod
    @amp_forward
    def forward(ctx: Any, x: torch.Tensor, state: _RegionState, chunk: int) -> torch.Tensor:
        ctx.state, ctx.chunk = state, chunk
        return x.view_as(x)

    @staticmethod
    @amp_backward
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        st: _RegionState = ctx.state
        grad = grad.contiguous().clone()
        handle = torch.distributed.all_reduce(grad, group=st.group, async_op=True)
        st.pending_bwd.append((handle, st.name, ctx.chunk))
        _record("launch", "bwd", st.name, ctx.chunk)
        return grad, None, None


class _SequenceRegionEntry(torch.autograd.Function):
    """All-gather along the sequence forward; backward reduce-scatters asynchronously (block mode + SP)."""

    @staticmethod
    @amp_forward
    def forward(ctx: Any, x: torch.Tensor, state: _RegionState, chunk: int) -> torch.Tensor:
        ctx.state, ctx.chunk = state, chunk
        return _all_gather(x, state.sequence_dim, state.group)

    @staticmethod
    @amp_backward
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        st: _RegionState = ctx.state
        world = dist.get_world_size(st.group)
        d = st.sequence_dim % grad.dim()
        g0 = grad.movedim(d, 0).contiguous()
        out0 = torch.empty((g0.size(0) // world, *g0.shape[1:]), dtype=g0.dtype, device=g0.device)
        handle = _compat.reduce_scatter_dim0(out0, g0, st.group, async_op=True)
        st.pending_bwd.append((handle, st.name, ctx.chunk))
        _record("launch", "bwd", st.name, ctx.chunk)
        # In flight: only the region's split reads it, after waiting (see [Note: block-level overlap]).
        return out0.movedim(0, d), None, None


class _RegionSplit(torch.autograd.Function):
    """Split dim 0 into chunks forward; backward waits the region's pending reductions, then cats."""

    @staticmethod
    @amp_forward
    def forward(ctx: Any, x: torch.Tensor, state: _RegionState, chunks: int) -> Any:
        ctx.state = state
        pieces = tuple(c.view_as(c) for c in x.chunk(chunks, dim=0))
        ctx.shapes, ctx.dtype, ctx.device = [p.shape for p in pieces], x.dtype, x.device
        return pieces

    @staticmethod
    @amp_backward
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        st: _RegionState = ctx.state
        with torch.no_grad():
            for handle, name, chunk in st.pending_bwd:
                handle.wait()
                _record("wait", "bwd", name, chunk)
        st.pending_bwd.clear()
        parts = [
            g if g is not None else torch.zeros(shape, dtype=ctx.dtype, device=ctx.device)
            for g, shape in zip(grads, ctx.shapes, strict=True)
        ]
        return torch.cat(parts, dim=0), None, None


@_not_traced
def _region_state(module: nn.Module) -> _RegionState:
    state = get_module_spec(module).region
    if state is None:
        raise RuntimeError(
            f"{type(module).__name__} is a TP region class but this module has no region state "
            "(a module is made a region by merak_tp.make_region, and copied with copy.deepcopy)"
        )
    return state


class TPRegion(nn.Module):
    """Marker base of region classes made by ``make_region`` (an fx leaf for tracers)."""

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return deepcopy_module(self, memo)

    @_not_traced
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        st = _region_state(self)
        if st.rng_tracker is not None:
            # [Note: region randomness] dropout inside the region acts on sharded activations:
            # each TP rank draws from its own tracked generator (see merak_tp.rng).
            with st.rng_tracker.fork("tp"):
                return self._region_forward(*args, **kwargs)
        return self._region_forward(*args, **kwargs)

    @_not_traced
    def _region_forward(self, *args: Any, **kwargs: Any) -> Any:
        st = _region_state(self)
        original_forward = super().forward  # the original class's forward (next in the MRO)
        # The first input may come by keyword (transformers: ``hidden_states=...``).
        key = None
        if not args and kwargs:
            key = _first_parameter(type(self))
            if key not in kwargs:
                raise TypeError(f"TP region {st.name}: its first input {key!r} was not passed")
            args = (kwargs.pop(key),)

        def base_forward(x: Any, *rest: Any, **kw: Any) -> Any:
            return original_forward(**{key: x}, **kw) if key is not None else original_forward(x, *rest, **kw)

        chunked = st.chunks > 1 and st.deferrable is not False and _chunkable(args, kwargs, st.chunks)
        if st.sequence_parallel and not (chunked and st.deferrable):
            if args and isinstance(args[0], torch.Tensor):
                args = (gather_from_sequence_region(args[0], st.group, st.sequence_dim), *args[1:])
            st.mode, st.calls = "sp", []
            try:
                out = base_forward(*args, **kwargs)
            finally:
                st.mode = None
            if chunked and st.deferrable is None:
                self._check_shape(out)
            return out
        if not chunked:
            return base_forward(*args, **kwargs)
        if st.deferrable is None:
            return self._probe(base_forward, args, kwargs)
        return self._sub_pipelined(base_forward, args, kwargs)

    @_not_traced
    def _probe(self, base_forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        st = _region_state(self)
        st.mode, st.calls = "probe", []
        try:
            out = base_forward(*args, **kwargs)
        finally:
            st.mode = None
        self._check_shape(out)
        return out

    @_not_traced
    def _check_shape(self, out: Any) -> None:
        """Decide once whether the region is 'columns -> local -> one row layer -> output'."""
        st = _region_state(self)
        kinds = [k for k, _ in st.calls]
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        ok = (
            kinds.count("row") == 1
            and kinds[-1] == "row"
            and first is st.calls[-1][1]
            and all(
                not getattr(m, "gather_output", False) and not getattr(m, "sequence_parallel", False)
                for k, m in st.calls
                if k == "column"
            )
        )
        st.deferrable = ok
        st.calls = []
        if not ok:
            logger.info(
                "TP region %s is not 'columns -> local -> one row layer -> output' (%s): it runs "
                "whole, with layer-level overlap only",
                st.name,
                kinds,
            )

    @_not_traced
    def _sub_pipelined(self, base_forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        st = _region_state(self)
        k = st.chunks
        batch = args[0].size(0)
        pieces = _RegionSplit.apply(args[0], st, k)
        k = len(pieces)
        sizes = [p.size(0) for p in pieces]
        rest = [_split_like(a, batch, sizes) for a in args[1:]]
        kw = {n: _split_like(v, batch, sizes) for n, v in kwargs.items()}
        outs = []
        st.pending_fwd = []
        try:
            for j in range(k):
                st.mode, st.chunk, st.calls = "block", j, []
                entry = _SequenceRegionEntry if st.sequence_parallel else _RegionEntry
                x_j = entry.apply(pieces[j], st, j)
                out = base_forward(x_j, *(r[j] for r in rest), **{n: v[j] for n, v in kw.items()})
                first = out[0] if isinstance(out, (tuple, list)) and out else out
                if not st.calls or st.calls[-1][0] != "row" or first is not st.calls[-1][1]:
                    raise RuntimeError(
                        f"TP region {st.name} changed shape after its first call; "
                        "the row layer's output is no longer the region's output"
                    )
                outs.append(out)
        finally:
            st.mode, st.chunk, st.calls = None, 0, []
            # no_grad: waiting may count as an in-place write of the output, which autograd
            # would otherwise record (and then see no gradient flowing into the buffer).
            with torch.no_grad():
                for handle, name, chunk in st.pending_fwd:
                    handle.wait()
                    _record("wait", "fwd", name, chunk)
            st.pending_fwd = []
        return _cat_outputs(outs)


_PLAIN = (bool, int, float, str, type(None))


_FIRST_INPUT: dict[type, str] = {}


@_not_traced
def _first_parameter(cls: type) -> str:
    """Name of the first parameter of the original class's ``forward`` (after ``self``), cached per class."""
    cached = _FIRST_INPUT.get(cls)
    if cached is not None:
        return cached
    base: Any = _base_class(cls) or cls
    params = list(inspect.signature(base.forward).parameters.values())[1:]
    if not params or params[0].kind not in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.KEYWORD_ONLY,
    ):
        raise TypeError(f"{base.__name__}.forward has no named first input; pass it positionally")
    _FIRST_INPUT[cls] = params[0].name
    return params[0].name


@_not_traced
def _chunkable(args: tuple[Any, ...], kwargs: dict[str, Any], chunks: int) -> bool:
    """A batch-major first input and only stateless other inputs (a KV cache object is not)."""
    if not args or not isinstance(args[0], torch.Tensor) or args[0].dim() < 2 or args[0].size(0) < chunks:
        return False
    for value in (*args[1:], *kwargs.values()):
        if isinstance(value, tuple) and all(isinstance(v, torch.Tensor) for v in value):
            continue
        if not isinstance(value, (torch.Tensor, *_PLAIN)):
            return False
    return True


@_not_traced
def _split_like(value: Any, batch: int, sizes: list[int]) -> list[Any]:
    """Split a batch-major tensor (3+ dims, leading size ``batch``) like the first input; repeat the rest."""
    if isinstance(value, torch.Tensor) and value.dim() >= 3 and value.size(0) == batch:
        return list(value.split(sizes, dim=0))
    if isinstance(value, tuple) and value and all(isinstance(v, torch.Tensor) for v in value):
        parts = [_split_like(v, batch, sizes) for v in value]
        return [tuple(p[j] for p in parts) for j in range(len(sizes))]
    return [value] * len(sizes)


@_not_traced
def _cat_outputs(outs: list[Any]) -> Any:
    first = outs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outs, dim=0)
    if isinstance(first, (tuple, list)):
        items = [_cat_outputs([o[i] for o in outs]) for i in range(len(first))]
        return type(first)(items)
    if first is None:
        return None
    raise TypeError(f"cannot concatenate region outputs of type {type(first).__name__}")


_ENTER = {"scatter": scatter_to_sequence_region, "gather": gather_from_tp_region}


class _SequenceBoundary(nn.Module):
    """The module's first input crosses a sequence-parallel boundary (its ``SequenceBoundary``) on entry."""

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return deepcopy_module(self, memo)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if args:
            args = (_cross_boundary(self, args[0]), *args[1:])
        return super().forward(*args, **kwargs)


@torch.compiler.disable
def _cross_boundary(module: nn.Module, x: Any) -> Any:
    """``x`` scattered or gathered as ``module``'s boundary says; never traced, so a compiled block
    that starts at a boundary compiles the rest of its forward ([Note: region bookkeeping is not traced])."""
    boundary = get_module_spec(module).sequence
    if boundary is None:
        raise RuntimeError(
            f"{type(module).__name__} is a sequence-parallel boundary class but this module has no "
            "boundary (made by merak_tp.make_sequence_scatter / make_sequence_gather)"
        )
    return _ENTER[boundary.kind](x, boundary.group, boundary.sequence_dim)


class SequenceScatter(_SequenceBoundary):
    """Marker base: the module's first input is split along the sequence on entry."""


class SequenceGather(_SequenceBoundary):
    """Marker base: the module's first input leaves sequence parallelism (all-gathered on entry).

    Everything from this module on runs on the full sequence, replicated; its gradient
    arrives identical on every rank, so the backward keeps this rank's block (no sum).
    """


_CLASS_CACHE: dict[tuple[type, type], type] = {}
_BASE_CLASS: dict[type, type] = {}  # a class made by _swap_class -> the class it was made from


def _base_class(cls: type) -> type | None:
    """The class ``cls`` (or the nearest of its bases made by ``_swap_class``) was made from."""
    return next((_BASE_CLASS[c] for c in cls.__mro__ if c in _BASE_CLASS), None)


def _swap_class(module: nn.Module, mixin: type) -> None:
    base = type(module)
    if issubclass(base, mixin):
        return
    key = (mixin, base)
    cls = _CLASS_CACHE.get(key)
    if cls is None:
        cls = type(f"{mixin.__name__}[{base.__name__}]", (mixin, base), {})
        _CLASS_CACHE[key] = cls
        _BASE_CLASS[cls] = base
    module.__class__ = cls


def make_region(
    module: nn.Module,
    *,
    group: ProcessGroup | None,
    chunks: int = 1,
    sequence_parallel: bool = False,
    sequence_dim: int = 1,
    name: str = "region",
    rng_tracker: Any = None,
) -> nn.Module:
    """Make ``module`` (columns -> local compute -> row layer) a TP region, in place.

    ``chunks > 1`` sub-pipelines it (see [Note: block-level overlap]);
    ``sequence_parallel`` all-gathers its first input along ``sequence_dim``;
    ``rng_tracker`` (an ``RNGTracker`` with a "tp" state) runs its forward inside
    ``rng_tracker.fork("tp")``, for dropout on sharded activations.
    """
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    state = _RegionState(
        group_ref=_GroupRef(group),
        chunks=chunks,
        name=name,
        sequence_parallel=sequence_parallel,
        sequence_dim=sequence_dim,
        rng_tracker=rng_tracker,
    )
    for sub in module.modules():
        if isinstance(sub, (ColumnParallelLinear, RowParallelLinear)):
            sub.join_region(state)
    _swap_class(module, TPRegion)
    set_module_spec(module, get_module_spec(module).replace(region=state))
    return module


def _sequence_boundary(
    module: nn.Module, kind: Literal["scatter", "gather"], group: ProcessGroup | None, sequence_dim: int
) -> nn.Module:
    _swap_class(module, SequenceScatter if kind == "scatter" else SequenceGather)
    boundary = SequenceBoundary(_GroupRef(group), sequence_dim, kind)
    set_module_spec(module, get_module_spec(module).replace(sequence=boundary))
    return module


def make_sequence_scatter(
    module: nn.Module, *, group: ProcessGroup | None, sequence_dim: int = 1
) -> nn.Module:
    """Split ``module``'s first input along ``sequence_dim`` on entry (start of sequence parallelism)."""
    return _sequence_boundary(module, "scatter", group, sequence_dim)


def make_sequence_gather(
    module: nn.Module, *, group: ProcessGroup | None, sequence_dim: int = 1
) -> nn.Module:
    """All-gather ``module``'s first input along ``sequence_dim`` on entry (end of sequence parallelism)."""
    return _sequence_boundary(module, "gather", group, sequence_dim)


def remove_region(module: nn.Module) -> nn.Module:
    """Undo ``make_region`` / ``make_sequence_scatter`` / ``make_sequence_gather`` (restore the
    class the last of them was applied to, and forget what it recorded)."""
    made = type(module)
    base = _base_class(made)
    if base is None:
        return module
    spec = get_module_spec(module)
    if issubclass(made, TPRegion) and not issubclass(base, TPRegion):
        spec = spec.replace(region=None)
        for sub in module.modules():
            if isinstance(sub, (ColumnParallelLinear, RowParallelLinear)):
                sub.join_region(None)
    elif issubclass(made, _SequenceBoundary) and not issubclass(base, _SequenceBoundary):
        spec = spec.replace(sequence=None)
    module.__class__ = base
    set_module_spec(module, spec)
    return module
