"""Cross-entropy over vocabulary-sharded logits, without gathering the full logits.

Each rank holds ``logits_local[..., v/tp]`` (this rank's contiguous block of the
vocabulary, as a ``ColumnParallelLinear`` LM head with ``gather_output=False``
produces). Per token, one all-reduce(MAX) of the local maxima and one
all-reduce(SUM) of three stacked statistics (sum of exponentials, the target
logit, and the sum of logits for label smoothing) give the exact loss; the
backward needs no communication. Same semantics as ``F.cross_entropy`` with
``ignore_index`` and ``label_smoothing``; ``reduction="mean"`` averages over
the tokens that are not ignored.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from merak_tp.collectives import amp_backward, amp_forward, tp_rank, tp_size

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    @amp_forward
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        labels: torch.Tensor,
        group: ProcessGroup | None,
        ignore_index: int,
        smoothing: float,
    ) -> torch.Tensor:
        world, rank = tp_size(group), tp_rank(group)
        v_local = logits.size(-1)
        vocab = v_local * world
        start = rank * v_local
        logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        local_max = logits.detach().amax(dim=-1)
        if world > 1:
            dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - local_max.unsqueeze(-1)
        ignored = labels == ignore_index
        outside = (labels < start) | (labels >= start + v_local) | ignored
        local_label = (labels - start).masked_fill(outside, 0)
        target = shifted.gather(-1, local_label.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        stats = torch.stack([exp.sum(-1), target, shifted.sum(-1)])
        if world > 1:
            dist.all_reduce(stats, group=group)
        sum_exp, target_logit, sum_logits = stats[0], stats[1], stats[2]
        log_z = sum_exp.log()
        loss = log_z - target_logit
        if smoothing > 0.0:
            loss = (1.0 - smoothing) * loss + smoothing * (log_z - sum_logits / vocab)
        loss = loss.masked_fill(ignored, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_label, outside, ignored)
        ctx.smoothing, ctx.vocab = smoothing, vocab
        return loss

    @staticmethod
    @amp_backward
    def backward(ctx: Any, grad_loss: torch.Tensor) -> Any:
        softmax, local_label, outside, ignored = ctx.saved_tensors
        grad = softmax.clone()
        onehot_scale = 1.0 - ctx.smoothing
        hit = (~outside).to(grad.dtype) * onehot_scale
        grad.scatter_add_(-1, local_label.unsqueeze(-1), -hit.unsqueeze(-1))
        if ctx.smoothing > 0.0:
            grad.sub_(ctx.smoothing / ctx.vocab)
        grad.mul_((grad_loss.masked_fill(ignored, 0.0)).unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(
    logits_local: torch.Tensor,
    labels: torch.Tensor,
    *,
    group: ProcessGroup | None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy of vocabulary-sharded logits ``[..., v/tp]`` against ``labels[...]``.

    Equals ``F.cross_entropy(full_logits.reshape(-1, v), labels.reshape(-1),
    ignore_index=..., label_smoothing=..., reduction=...)`` on every rank.
    ``reduction``: ``"mean"`` (over non-ignored tokens), ``"sum"`` or ``"none"``
    (per-token losses, shaped like ``labels``).
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r}: expected 'mean', 'sum' or 'none'")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing}: expected a value in [0, 1]")
    if logits_local.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits shape {tuple(logits_local.shape)} and labels shape {tuple(labels.shape)} differ "
            "before the vocabulary dim: pass logits [..., v/tp] and labels [...]"
        )
    losses = _VocabParallelCE.apply(logits_local, labels, group, ignore_index, float(label_smoothing))
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    count = (labels != ignore_index).sum()
    return losses.sum() / count.to(losses.dtype)  # 0/0 = nan when every label is ignored, as torch
