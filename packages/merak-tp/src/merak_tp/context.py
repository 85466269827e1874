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

``ring_attention``: the key/value block of every rank passes around the ring (send to ``rank + 1``,
receive from ``rank - 1``, one ``batch_isend_irecv`` per step, the same issue order on every rank);
each block's attention is merged into the result by the online softmax (log-sum-exp), in float32
or wider. Causal attention cuts the sequence into ``2 * cp`` chunks; rank ``r`` holds chunks ``r``
and ``2cp - 1 - r`` (:func:`shard_positions` with ``balanced=True``), so that every rank does the
same work: its own block (causal), then from each earlier rank's block the first chunk for all
local queries, and from each later rank's block everything for its second chunk. Without a causal
mask any contiguous split works and every block is whole.

[Note: ring backward] The backward is exact by construction: each step's key/value pass is an
autograd function whose backward passes the gradient the other way round the ring (send to
``rank - 1``, receive from ``rank + 1``), and each block's attention is recomputed in the backward
(``torch.utils.checkpoint``), so a rank keeps the received key/value blocks and the per-block
log-sum-exp, never a block's score matrix. Autograd runs the backward of the identical graph on
every rank in the same order, so the reverse passes pair up. In the forward the pass of the next
block is started before the current block is computed and waited for only before the next block is
read (overlap of communication and compute); the backward's passes wait at once.

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
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup
from torch.utils.checkpoint import checkpoint

from merak_tp.collectives import amp_backward, amp_forward

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


class _SeqToHeads(torch.autograd.Function):
    """Forward: sequence-split -> head-split (all-to-all); backward: the mirror all-to-all."""

    @staticmethod
    @amp_forward
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _all_to_all(x, group, scatter_dim=1, gather_dim=2)

    @staticmethod
    @amp_backward
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_to_all(grad, ctx.group, scatter_dim=2, gather_dim=1), None


class _HeadsToSeq(torch.autograd.Function):
    """Forward: head-split -> sequence-split (all-to-all); backward: the mirror all-to-all."""

    @staticmethod
    @amp_forward
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _all_to_all(x, group, scatter_dim=2, gather_dim=1)

    @staticmethod
    @amp_backward
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_to_all(grad, ctx.group, scatter_dim=1, gather_dim=2), None


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
    q = _SeqToHeads.apply(q_bhsd, group)
    k = _SeqToHeads.apply(k_bgsd, group)
    v = _SeqToHeads.apply(v_bgsd, group)
    out = _sdpa(q, k, v, causal=causal, scale=scale)
    return _HeadsToSeq.apply(out, group)


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float | None
) -> torch.Tensor:
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


# ---------------------------------------------------------------------------- ring


def _start_pass(kv: torch.Tensor, group: ProcessGroup, step: int) -> tuple[torch.Tensor, list[Any]]:
    """Start sending ``kv`` ``step`` places forward round the ring and receiving from ``step`` places
    back (one batch, send then receive on every rank); the receive buffer and the batch's works."""
    size = dist.get_world_size(group)
    me = dist.get_group_rank(group, dist.get_rank())
    to = dist.get_global_rank(group, (me + step) % size)
    frm = dist.get_global_rank(group, (me - step) % size)
    recv = torch.empty_like(kv)
    ops = [dist.P2POp(dist.isend, kv, to, group), dist.P2POp(dist.irecv, recv, frm, group)]
    return recv, list(dist.batch_isend_irecv(ops))


def _pass_along(kv: torch.Tensor, group: ProcessGroup, step: int) -> torch.Tensor:
    """:func:`_start_pass` and wait for it."""
    recv, works = _start_pass(kv, group, step)
    for work in works:
        work.wait()
    return recv


class _PendingPass:
    """The works of a pass started in a forward, waited for before the received block is read."""

    def __init__(self) -> None:
        self.works: list[Any] = []

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works = []


class _RingPass(torch.autograd.Function):
    """Forward: pass the key/value block one rank on (started, waited by the caller through ``pending``:
    the pass overlaps the current block's compute); backward: its gradient one rank back (see
    [Note: ring backward])."""

    @staticmethod
    @amp_forward
    def forward(ctx: Any, kv: torch.Tensor, group: ProcessGroup, pending: _PendingPass) -> torch.Tensor:
        ctx.group = group
        recv, pending.works = _start_pass(kv, group, 1)
        return recv

    @staticmethod
    @amp_backward
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _pass_along(grad.contiguous(), ctx.group, -1), None, None


def _block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention in the compute dtype: ``(out_bhsd, lse_bhs)``, out normalised within the block."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v)
    return out, lse


def _merge(
    acc: tuple[torch.Tensor, torch.Tensor] | None, new: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Online-softmax merge of two partial results over disjoint key sets."""
    if acc is None:
        return new
    out_a, lse_a = acc
    out_b, lse_b = new
    lse = torch.logaddexp(lse_a, lse_b)
    out = out_a * torch.exp(lse_a - lse).unsqueeze(-1) + out_b * torch.exp(lse_b - lse).unsqueeze(-1)
    return out, lse


def _checkpointed_block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    if not torch.is_grad_enabled():
        return _block(q, k, v, scale, mask)
    result = checkpoint(_block, q, k, v, scale, mask, use_reentrant=False)
    return result[0], result[1]


def ring_attention(
    q_bhsd: torch.Tensor,
    k_bgsd: torch.Tensor,
    v_bgsd: torch.Tensor,
    group: ProcessGroup,
    *,
    causal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """Exact attention of the local tokens over the whole sequence of the CP ``group`` (ring, online softmax).

    With ``causal`` the local tokens must be the two balanced chunks :func:`shard_positions` gives
    (``balanced=True``); without, a contiguous block.
    """
    cp = dist.get_world_size(group)
    if q_bhsd.shape[1] % k_bgsd.shape[1] or k_bgsd.shape != v_bgsd.shape:
        raise ValueError(
            f"q {tuple(q_bhsd.shape)} and k/v {tuple(k_bgsd.shape)}/{tuple(v_bgsd.shape)} do not fit"
        )
    s = q_bhsd.shape[2]
    if causal and s % 2:
        raise ValueError(f"causal ring attention needs two equal chunks per rank, got {s} local tokens")
    scale = 1.0 / math.sqrt(q_bhsd.shape[-1]) if scale is None else scale
    compute = torch.promote_types(q_bhsd.dtype, torch.float32)
    q = q_bhsd.to(compute)
    kv = torch.stack([k_bgsd, v_bgsd]).to(compute)
    me = dist.get_group_rank(group, dist.get_rank())
    half = s // 2
    # Partial results for the first and second local chunk (causal) or all local queries (not).
    first: tuple[torch.Tensor, torch.Tensor] | None = None
    second: tuple[torch.Tensor, torch.Tensor] | None = None
    kv = kv.contiguous()
    pending = _PendingPass()
    for step in range(cp):
        # The next block's pass runs while this block is computed; waited before it is read.
        upcoming = _RingPass.apply(kv, group, pending) if step < cp - 1 else None
        source = (me - step) % cp
        k, v = kv[0], kv[1]
        if not causal:
            first = _merge(first, _checkpointed_block(q, k, v, scale, None))
        elif source == me:
            pos = torch.arange(s, device=q.device)
            mask = pos[:, None] >= pos[None, :]  # local order is global order within each rank's two chunks
            out, lse = _checkpointed_block(q, k, v, scale, mask)
            first = _merge(first, (out[:, :, :half], lse[:, :, :half]))
            second = _merge(second, (out[:, :, half:], lse[:, :, half:]))
        elif source < me:
            out, lse = _checkpointed_block(q, k[:, :, :half], v[:, :, :half], scale, None)
            first = _merge(first, (out[:, :, :half], lse[:, :, :half]))
            second = _merge(second, (out[:, :, half:], lse[:, :, half:]))
        else:
            second = _merge(second, _checkpointed_block(q[:, :, half:], k, v, scale, None))
        if upcoming is not None:
            pending.wait()
            kv = upcoming
    assert first is not None
    out = first[0] if second is None else torch.cat([first[0], second[0]], dim=2)
    return out.to(q_bhsd.dtype)


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
