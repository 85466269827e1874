"""Ring attention over a context-parallel (CP) group, exact in forward and backward.

Shape legend as in :mod:`merak_tp.context`: ``b`` batch, ``h`` query heads, ``g`` key/value heads,
``s`` local sequence, ``d`` head dim; ``kv`` is the stacked key and value, ``(2, b, g, s, d)``.

The key/value block of every rank passes around the ring (send to ``rank + 1``, receive from
``rank - 1``, one ``batch_isend_irecv`` per step, the same issue order on every rank, every op on
tag 0); each block's attention is merged into the result by the online softmax (log-sum-exp), in
float32 or wider. Causal attention cuts the sequence into ``2 * cp`` chunks; rank ``r`` holds chunks
``r`` and ``2cp - 1 - r`` (``shard_positions`` with ``balanced=True``), so that every rank does the
same work: its own block (causal), then from each earlier rank's block the first chunk for all
local queries, and from each later rank's block everything for its second chunk. Without a causal
mask any contiguous split works and every block is whole.

[Note: ring backward] The ring is one autograd function whose forward keeps only the local query,
key, value, output and per-row log-sum-exp (no received block, no block's partial output): a rank's
held activations fall as ``1 / cp``. The backward passes the blocks round the ring again, in the
forward's order: at each step a rank recomputes the block's probabilities from the saved
log-sum-exp, ``P = exp(Q K^T * scale - lse)``, adds ``dS K * scale`` to its query gradient and
``P^T dO`` and ``dS^T Q * scale`` to the block's key/value gradients, with
``dS = P * (dO V^T - rowsum(dO * O))`` and the same causal chunk pairing as the forward. Exact: the
sums are those of one process's attention backward, grouped by block, in float32 or wider.

[Note: ring overlap] Forward and backward post each step's pass before the step's block is computed
and wait for it after, so the messages travel while the block computes. A block's key and value are
known ahead, its gradients only once the rank has added its share, so in the backward the gradients
travel one step behind their block: the batch posted at step ``i`` sends the next rank the block of
step ``i`` (key, value) and the finished gradients of the block of step ``i - 1`` (those the earlier
ranks gathered plus this rank's share), and receives the block of step ``i + 1`` and the gathered
gradients of the block of step ``i``, to which this rank adds its share once the batch is waited for.
After the last step one more batch takes each block's gradients, complete, to their owner (the next
rank). Every rank issues the same batches in the same order, each a send to ``rank + 1`` and a
receive from ``rank - 1`` (several tensors: in the same order on both sides), so under NCCL's rules
(matching by issue order, one in-order stream) batch ``n`` of every rank completes together.
The posts, block computes and waits are recorded by ``record_overlap_events`` (``what="ring"``).

Not here: the hook a model calls, Ulysses, shard positions (:mod:`merak_tp.context`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from merak_tp._events import _record
from merak_tp.collectives import amp_backward, amp_forward

__all__ = ["ring_attention"]


def _post(
    tensors: list[torch.Tensor], group: ProcessGroup, phase: str, step: int
) -> tuple[list[torch.Tensor], list[Any]]:
    """Start sending ``tensors`` to the next rank of the ring and receiving as many from the previous
    one (one batch: the sends, then the receives, in the same order on every rank); the receive
    buffers and the batch's works. Nothing to send: no batch."""
    if not tensors:
        return [], []
    size = dist.get_world_size(group)
    me = dist.get_group_rank(group, dist.get_rank())
    to = dist.get_global_rank(group, (me + 1) % size)
    frm = dist.get_global_rank(group, (me - 1) % size)
    recvs = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, to, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, frm, group) for r in recvs]
    works = list(dist.batch_isend_irecv(ops))
    _record("launch", phase, "ring", step)
    return recvs, works


def _wait(works: list[Any], phase: str, step: int) -> None:
    for work in works:
        work.wait()
    if works:
        _record("wait", phase, "ring", step)


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


def _scores(q: torch.Tensor, k_rep: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    """``Q K^T * scale`` with the masked-out pairs at -inf (``k_rep`` repeated to the query heads)."""
    scores = torch.matmul(q, k_rep.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask.to(scores.device), float("-inf"))
    return scores


def _block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention in the compute dtype: ``(out_bhsd, lse_bhs)``, out normalised within the block."""
    rep = q.shape[1] // k.shape[1]
    scores = _scores(q, _repeat_kv(k, rep), scale, mask)
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
    prob = torch.exp(_scores(q, kr, scale, mask) - lse.unsqueeze(-1))
    dv = torch.matmul(prob.transpose(-1, -2), grad_out)
    ds = prob * (torch.matmul(grad_out, vr.transpose(-1, -2)) - delta.unsqueeze(-1))
    dq = torch.matmul(ds, kr) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q) * scale
    if rep > 1:  # the query heads sharing a key/value head add up
        dk = dk.unflatten(1, (k.shape[1], rep)).sum(2)
        dv = dv.unflatten(1, (k.shape[1], rep)).sum(2)
    return dq, dk, dv


def _merge(
    acc: tuple[torch.Tensor, torch.Tensor], new: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Online-softmax merge of two partial results over disjoint key sets (``acc``'s lse may be -inf: empty)."""
    out_a, lse_a = acc
    out_b, lse_b = new
    lse = torch.logaddexp(lse_a, lse_b)
    out = out_a * torch.exp(lse_a - lse).unsqueeze(-1) + out_b * torch.exp(lse_b - lse).unsqueeze(-1)
    return out, lse


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
        # The next block travels while this one is computed ([Note: ring overlap]).
        recvs, works = _post([kv] if step < cp - 1 else [], group, "fwd", step)
        rows, keys, mask = _pairing(causal, (me - step) % cp, me, s)
        new = _block(q[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys], scale, mask)
        _record("compute", "fwd", "ring", step)
        out[:, :, rows], lse[:, :, rows] = _merge((out[:, :, rows], lse[:, :, rows]), new)
        _wait(works, "fwd", step)
        kv = recvs[0] if recvs else kv
    return out, lse


def _ring_backward(
    q: torch.Tensor,
    kv: torch.Tensor,
    grad_out: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    group: ProcessGroup,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ring's backward in the compute dtype: ``(dq_bhsd, dkv)`` of the local tokens ([Note: ring overlap])."""
    cp = dist.get_world_size(group)
    me = dist.get_group_rank(group, dist.get_rank())
    s = q.shape[2]
    delta = (grad_out * out).sum(-1)
    dq = torch.zeros_like(q)
    finished: torch.Tensor | None = (
        None  # the gradients of the previous step's block, complete up to this rank
    )
    for step in range(cp):
        sends = ([kv] if step < cp - 1 else []) + ([finished] if finished is not None else [])
        recvs, works = _post(sends, group, "bwd", step)
        rows, keys, mask = _pairing(causal, (me - step) % cp, me, s)
        dq_part, dk_part, dv_part = _block_grads(
            q[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys],
            grad_out[:, :, rows], lse[:, :, rows], delta[:, :, rows], scale, mask,
        )  # fmt: skip
        _record("compute", "bwd", "ring", step)
        dq[:, :, rows] += dq_part
        _wait(works, "bwd", step)
        # What the earlier ranks gathered for this block (none at step 0: the block's owner is first).
        grads = recvs[-1] if finished is not None else torch.zeros_like(kv)
        grads[0][:, :, keys] += dk_part
        grads[1][:, :, keys] += dv_part
        kv = recvs[0] if step < cp - 1 else kv
        finished = grads
    assert finished is not None
    if cp == 1:
        return dq, finished
    # The last step's block is the next rank's: its complete gradients go home.
    recvs, works = _post([finished], group, "bwd", cp)
    _wait(works, "bwd", cp)
    return dq, recvs[0]


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
        compute = lse.dtype
        kv = torch.stack([k_in, v_in]).to(compute).contiguous()
        dq, dkv = _ring_backward(
            q_in.to(compute), kv, grad.to(compute), out.to(compute), lse, ctx.group, ctx.causal, ctx.scale
        )
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

    With ``causal`` the local tokens must be the two balanced chunks ``shard_positions`` gives
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
