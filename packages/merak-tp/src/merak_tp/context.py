"""Attention over a context-parallel (CP) group: ring attention and Ulysses, exact in forward and backward.

Each rank of a CP group holds ``S / cp`` tokens of every sample (``S`` the global sequence length) and
computes queries, keys and values for them. Attention is the one operator that needs the other ranks'
keys and values; the two functions here compute exactly what one process computes over the whole
sequence, for the local queries, and are differentiable (the backward moves the gradients back the
way the forward moved the data). Both take the CP process group as an argument.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` key/value heads (grouped-query attention: ``h``
a multiple of ``g``), ``s`` local sequence, ``d`` head dim. Inputs are ``q_bhsd``, ``k_bgsd``,
``v_bgsd``; the output is ``o_bhsd`` in the query's dtype.

``ulysses_attention``: an all-to-all turns the sequence-split ``(b, h, s, d)`` into a head-split
``(b, h/cp, S, d)`` (and ``g/cp`` key/value heads), attention runs over the whole sequence for those
heads, and a second all-to-all turns the result back. The local tokens must be the contiguous block
``cp_rank`` of the sequence (:func:`shard_positions` with ``balanced=False``); ``cp`` must divide
both head counts.

``ring_attention`` (:mod:`merak_tp.ring`, re-exported here): the key/value block of every rank
passes around the ring, each step's pass overlapped with the previous block's attention in forward
and backward, merged by the online softmax; causal attention load-balanced over ``2 * cp`` chunks
(:func:`shard_positions` with ``balanced=True``).

[Note: attention hook] A model whose attention should run over the CP group calls
:func:`cp_attention` (and, for rotary embeddings, :func:`cp_positions`) while
:func:`active_context` is set, i.e. inside ``with context_parallel(ContextParallel(group, mode))``:
Merak's trainer enters that context around every step at cp > 1, so the model's code needs no
group. Outside the context a model keeps its own single-process attention. The plain-PyTorch
reference models of the tests use exactly this hook; transformers models are routed through their
attention-function registry by merak-core instead.

Not here: choosing the mode, splitting the data and wiring into a model (merak-core); attention
masks other than causal, dropout inside attention, sliding windows.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from merak_tp.collectives import amp_backward, amp_forward
from merak_tp.ring import ring_attention

__all__ = [
    "CP_MODES",
    "ContextParallel",
    "active_context",
    "context_parallel",
    "cp_attention",
    "cp_positions",
    "ring_attention",
    "shard_positions",
    "ulysses_attention",
]

CP_MODES: tuple[str, str] = ("ring", "ulysses")
"""The attention modes over a CP group."""


def shard_positions(seq_len: int, cp: int, cp_rank: int, *, balanced: bool) -> torch.Tensor:
    """Global positions of the tokens rank ``cp_rank`` holds, in local order (a 1-D long tensor).

    ``balanced``: chunks ``cp_rank`` and ``2cp - 1 - cp_rank`` of ``2 * cp`` equal chunks (ring attention
    with a causal mask); else the contiguous block ``cp_rank`` of ``cp``. ``ValueError`` when the
    chunks are not whole, naming the length to use.
    """
    parts = 2 * cp if balanced else cp
    if seq_len % parts:
        fit = seq_len - seq_len % parts
        raise ValueError(
            f"sequence length {seq_len} does not divide into {parts} equal chunks "
            f"({'2*cp' if balanced else 'cp'} with cp={cp}): use a sequence length that is a multiple of "
            f"{parts} (e.g. {fit or parts})"
        )
    chunk = seq_len // parts
    if not balanced:
        return torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second_index = 2 * cp - 1 - cp_rank
    second = torch.arange(second_index * chunk, (second_index + 1) * chunk)
    return torch.cat([first, second])


# ---------------------------------------------------------------------------- Ulysses


def _all_to_all(x: torch.Tensor, group: ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split ``x`` along ``scatter_dim`` into ``cp`` blocks, block ``j`` to rank ``j``; concatenate what
    arrives along ``gather_dim`` in rank order."""
    size = dist.get_world_size(group)
    send = torch.stack(x.chunk(size, dim=scatter_dim)).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """Forward: the all-to-all from a ``scatter_dim`` split to a ``gather_dim`` split (sequence-split ->
    head-split is ``(1, 2)``, back is ``(2, 1)``); backward: the mirror all-to-all."""

    @staticmethod
    @amp_forward
    def forward(
        ctx: Any, x: torch.Tensor, group: ProcessGroup, scatter_dim: int, gather_dim: int
    ) -> torch.Tensor:
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim=scatter_dim, gather_dim=gather_dim)

    @staticmethod
    @amp_backward
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, ctx.group, scatter_dim=gather_dim, gather_dim=scatter_dim), None, None, None


def _check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: int) -> None:
    heads, kv_heads = q.shape[1], k.shape[1]
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} are not (b, h, s, d)")
    if heads % kv_heads:
        raise ValueError(f"query heads {heads} are not a multiple of key/value heads {kv_heads}")
    if heads % cp or kv_heads % cp:
        raise ValueError(
            f"cp_mode='ulysses' splits the heads over cp={cp} ranks, but this attention has {heads} query "
            f"and {kv_heads} key/value heads per rank (after TP): use cp_mode='ring', or a cp dividing both"
        )


def ulysses_attention(
    q_bhsd: torch.Tensor,
    k_bgsd: torch.Tensor,
    v_bgsd: torch.Tensor,
    group: ProcessGroup,
    *,
    causal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """Exact attention of the local (contiguous) tokens over the whole sequence of the CP ``group``."""
    cp = dist.get_world_size(group)
    _check_heads(q_bhsd, k_bgsd, v_bgsd, cp)
    if cp == 1:
        return _sdpa(q_bhsd, k_bgsd, v_bgsd, causal=causal, scale=scale)
    q, k, v = (_AllToAll.apply(t, group, 1, 2) for t in (q_bhsd, k_bgsd, v_bgsd))
    out = _sdpa(q, k, v, causal=causal, scale=scale)
    result: torch.Tensor = _AllToAll.apply(out, group, 2, 1)
    return result


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float | None
) -> torch.Tensor:
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


# ---------------------------------------------------------------------------- the hook


@dataclass(frozen=True)
class ContextParallel:
    """A CP group and its attention mode: what :func:`cp_attention` consults (see [Note: attention hook])."""

    group: ProcessGroup
    mode: str = "ring"

    def __post_init__(self) -> None:
        if self.mode not in CP_MODES:
            raise ValueError(f"cp_mode={self.mode!r} is not one of {CP_MODES}: set cp_mode to one of them")

    @property
    def size(self) -> int:
        """The CP degree."""
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        """This rank's index in the CP group."""
        return dist.get_group_rank(self.group, dist.get_rank())

    @property
    def balanced(self) -> bool:
        """Whether the local tokens are the load-balanced chunk pair (ring) or a contiguous block (Ulysses)."""
        return self.mode == "ring"

    def positions(self, seq_len: int) -> torch.Tensor:
        """Global positions of this rank's tokens of a ``seq_len``-token sequence (:func:`shard_positions`)."""
        return shard_positions(seq_len, self.size, self.rank, balanced=self.balanced)

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float | None
    ) -> torch.Tensor:
        """This mode's attention over the group."""
        fn = ring_attention if self.mode == "ring" else ulysses_attention
        return fn(q, k, v, self.group, causal=causal, scale=scale)


_ACTIVE: contextvars.ContextVar[ContextParallel | None] = contextvars.ContextVar("merak_cp", default=None)


@contextlib.contextmanager
def context_parallel(cp: ContextParallel | None) -> Iterator[None]:
    """Make ``cp`` the context :func:`cp_attention` and :func:`cp_positions` consult (None: none)."""
    token = _ACTIVE.set(cp)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_context() -> ContextParallel | None:
    """The context set by :func:`context_parallel`, or None."""
    return _ACTIVE.get()


def cp_attention(
    q_bhsd: torch.Tensor,
    k_bgsd: torch.Tensor,
    v_bgsd: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of the local tokens over the active CP group's whole sequence (see [Note: attention hook])."""
    cp = active_context()
    if cp is None:
        raise RuntimeError(
            "cp_attention was called outside context_parallel(...): check active_context() first"
        )
    return cp.attention(q_bhsd, k_bgsd, v_bgsd, causal=causal, scale=scale)


def cp_positions(local_len: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions of the ``local_len`` local tokens in the active context (``arange`` without one)."""
    cp = active_context()
    if cp is None:
        return torch.arange(local_len, device=device)
    return cp.positions(local_len * cp.size).to(device)
