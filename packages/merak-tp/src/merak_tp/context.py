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

[Note: ring backward] The ring is one autograd function whose forward keeps only the local query,
key, value, output and per-row log-sum-exp (no received block, no block's partial output): a rank's
held activations fall as ``1 / cp``. In the forward the pass of the next block is started before the
current block is computed and waited for after (communication overlaps compute). The backward passes
the blocks round the ring again, in the forward's order (send to ``rank + 1``, receive from
``rank - 1``, one ``batch_isend_irecv`` per step, the same issue order on every rank), each block
travelling with the gradients of its key and value gathered so far: at each step a rank recomputes
the block's probabilities from the saved log-sum-exp, ``P = exp(Q K^T * scale - lse)``, adds
``dS K * scale`` to its query gradient and ``P^T dO`` and ``dS^T Q * scale`` to the travelling key/value
gradients, with ``dS = P * (dO V^T - rowsum(dO * O))`` and the same causal chunk pairing as the
forward. After the last step the gradients take one more step, to the block's owner. Exact: the
sums are those of one process's attention backward, grouped by block, in float32 or wider.

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


def _pairing(causal: bool, source: int, me: int, s: int) -> tuple[slice, slice, torch.Tensor | None]:
    """Which local query rows meet which keys of ``source``'s block, and the mask: ``(rows, keys, mask)``.

    Causal (balanced chunks): the own block with the causal mask (local order is global order within
    a rank's two chunks), an earlier rank's first chunk for all rows, a later rank's whole block for
    the second chunk's rows. Not causal: everything.
    """
    whole, half = slice(None), s // 2
    if not causal:
        return whole, whole, None
    if source == me:
        pos = torch.arange(s)
        return whole, whole, pos[:, None] >= pos[None, :]
    if source < me:
        return whole, slice(None, half), None
    return slice(half, None), whole, None


def _repeat_kv(x: torch.Tensor, rep: int) -> torch.Tensor:
    return x.repeat_interleave(rep, dim=1) if rep > 1 else x


def _block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention in the compute dtype: ``(out_bhsd, lse_bhs)``, out normalised within the block."""
    rep = q.shape[1] // k.shape[1]
    scores = torch.matmul(q, _repeat_kv(k, rep).transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask.to(scores.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), _repeat_kv(v, rep))
    return out, lse


def _block_grads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of one block's queries, keys and values given the rows' final log-sum-exp ``lse`` and
    ``delta = rowsum(dO * O)``: ``P = exp(S - lse)``, ``dS = P * (dO V^T - delta)`` (see [Note: ring backward])."""
    rep = q.shape[1] // k.shape[1]
    kr, vr = _repeat_kv(k, rep), _repeat_kv(v, rep)
    scores = torch.matmul(q, kr.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask.to(scores.device), float("-inf"))
    prob = torch.exp(scores - lse.unsqueeze(-1))
    dv = torch.matmul(prob.transpose(-1, -2), grad_out)
    ds = prob * (torch.matmul(grad_out, vr.transpose(-1, -2)) - delta.unsqueeze(-1))
    dq = torch.matmul(ds, kr) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q) * scale
    if rep > 1:  # the query heads sharing a key/value head add up
        dk = dk.unflatten(1, (k.shape[1], rep)).sum(2)
        dv = dv.unflatten(1, (k.shape[1], rep)).sum(2)
    return dq, dk, dv


def _ring_forward(
    q: torch.Tensor, kv: torch.Tensor, group: ProcessGroup, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ring's forward in the compute dtype, no autograd: ``(out_bhsd, lse_bhs)`` of the local queries."""
    cp = dist.get_world_size(group)
    me = dist.get_group_rank(group, dist.get_rank())
    b, h, s, _ = q.shape
    out = torch.zeros_like(q)
    lse = torch.full((b, h, s), float("-inf"), dtype=q.dtype, device=q.device)
    for step in range(cp):
        # The next block's pass runs while this block is computed; waited for before it is read.
        upcoming, works = _start_pass(kv, group, 1) if step < cp - 1 else (kv, [])
        rows, keys, mask = _pairing(causal, (me - step) % cp, me, s)
        new = _block(q[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys], scale, mask)
        out[:, :, rows], lse[:, :, rows] = _merge((out[:, :, rows], lse[:, :, rows]), new)
        for work in works:
            work.wait()
        kv = upcoming
    return out, lse


def _merge(
    acc: tuple[torch.Tensor, torch.Tensor], new: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Online-softmax merge of two partial results over disjoint key sets (``acc``'s lse may be -inf: empty)."""
    out_a, lse_a = acc
    out_b, lse_b = new
    lse = torch.logaddexp(lse_a, lse_b)
    out = out_a * torch.exp(lse_a - lse).unsqueeze(-1) + out_b * torch.exp(lse_b - lse).unsqueeze(-1)
    return out, lse


class _RingAttention(torch.autograd.Function):
    """Ring attention whose backward passes the key/value blocks round the ring again ([Note: ring backward]):
    the forward keeps the local query, key, value, output and log-sum-exp only."""

    @staticmethod
    @amp_forward
    def forward(
        ctx: Any,
        q_bhsd: torch.Tensor,
        k_bgsd: torch.Tensor,
        v_bgsd: torch.Tensor,
        group: ProcessGroup,
        causal: bool,
        scale: float,
    ) -> torch.Tensor:
        compute = torch.promote_types(q_bhsd.dtype, torch.float32)
        kv = torch.stack([k_bgsd, v_bgsd]).to(compute).contiguous()
        out, lse = _ring_forward(q_bhsd.to(compute), kv, group, causal, scale)
        result = out.to(q_bhsd.dtype)
        ctx.group, ctx.causal, ctx.scale = group, causal, scale
        ctx.save_for_backward(q_bhsd, k_bgsd, v_bgsd, result, lse)
        return result

    @staticmethod
    @amp_backward
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        q_in, k_in, v_in, out, lse = ctx.saved_tensors
        group, causal, scale = ctx.group, ctx.causal, ctx.scale
        cp = dist.get_world_size(group)
        me = dist.get_group_rank(group, dist.get_rank())
        q, grad_out = q_in.to(lse.dtype), grad.to(lse.dtype)
        delta = (grad_out * out.to(lse.dtype)).sum(-1)
        dq = torch.zeros_like(q)
        k, v = k_in.to(lse.dtype), v_in.to(lse.dtype)
        # The travelling block: its key, value and the gradients gathered for them so far.
        block = torch.stack([k, v, torch.zeros_like(k), torch.zeros_like(v)]).contiguous()
        for step in range(cp):
            rows, keys, mask = _pairing(causal, (me - step) % cp, me, q.shape[2])
            g = _block_grads(
                q[:, :, rows], block[0][:, :, keys], block[1][:, :, keys],
                grad_out[:, :, rows], lse[:, :, rows], delta[:, :, rows], scale, mask,
            )  # fmt: skip
            dq[:, :, rows] += g[0]
            block[2][:, :, keys] += g[1]
            block[3][:, :, keys] += g[2]
            if step < cp - 1:
                block = _pass_along(block, group, 1)
        # The block that was computed last is the next rank's: its gradients go one step on, home.
        dkv = _pass_along(block[2:].contiguous(), group, 1) if cp > 1 else block[2:]
        return dq.to(q_in.dtype), dkv[0].to(k_in.dtype), dkv[1].to(v_in.dtype), None, None, None


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
    if q_bhsd.shape[1] % k_bgsd.shape[1] or k_bgsd.shape != v_bgsd.shape:
        raise ValueError(
            f"q {tuple(q_bhsd.shape)} and k/v {tuple(k_bgsd.shape)}/{tuple(v_bgsd.shape)} do not fit"
        )
    s = q_bhsd.shape[2]
    if causal and s % 2:
        raise ValueError(f"causal ring attention needs two equal chunks per rank, got {s} local tokens")
    scale = 1.0 / math.sqrt(q_bhsd.shape[-1]) if scale is None else scale
    out: torch.Tensor = _RingAttention.apply(q_bhsd, k_bgsd, v_bgsd, group, causal, scale)
    return out


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
