"""Log-likelihoods of continuations on the training layout: what lm-evaluation-harness' ``loglikelihood``
requests ask (``cli/lm_eval_model.py``).

[Note: scoring on the layout] Each request is ``(context tokens, continuation tokens)``. As
lm-evaluation-harness' ``hf`` model does, the scored row is ``(context + continuation)`` truncated
on the left to ``max_length + 1`` tokens, without its last token; the continuation's tokens are
the targets of its last ``len(continuation)`` positions. Rows are right-padded to the batch's
longest (causal attention: a real position never sees the padding after it), positions count
from 0. The batch runs one forward through the same eager decoders as generation (the TP-sharded
model at pp = 1, the rebuilt stages under pp, microbatches through the stages in the forward-only
round of merak-pipe's GPipe schedule, [Note: decoding under pipeline parallelism]), keeping the
logits of every position. The last stage takes the float32 log-softmax and, per row and
position, the target's log-probability and whether it is the most likely token, and broadcasts
them over the pipeline group; every rank returns the same ``(sum of log-probabilities, greedy)``.
Collective over the world: every rank passes the same requests.

Not done here: tokenizing (the lm-eval model), generation (``decode``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from merak_core.generation.decode import _decoder, _microbatches, _refuse_unsupported
from merak_core.generation.pipeline import forward_round
from merak_core.parallel.compose import ParallelModel


def score_continuations(
    model: ParallelModel,
    requests: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    max_length: int,
    num_microbatches: int | None = None,
) -> list[tuple[float, bool]]:
    """``(log-probability of the continuation, it is the greedy continuation)`` of each
    ``(context, continuation)`` token pair ([Note: scoring on the layout]); collective."""
    if not requests:
        return []
    _refuse_unsupported(model)
    rows, targets = [], []
    for context, continuation in requests:
        if not continuation or not context:
            raise ValueError("each request needs at least one context token and one continuation token")
        whole = [*context, *continuation][-(max_length + 1) :]
        rows.append(whole[:-1])
        targets.append(len(continuation))
    width = max(len(r) for r in rows)
    device = model.layout.device
    ids_bt = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids_bt[i, : len(r)] = torch.tensor(r)
    next_bt = torch.zeros_like(ids_bt)  # the token each position predicts (its successor in the row)
    for i, (context, continuation) in enumerate(requests):
        whole = [*context, *continuation][-(max_length + 1) :]
        next_bt[i, : len(whole) - 1] = torch.tensor(whole[1:])
    modes = [(m, m.training) for m in model.module.modules()]
    model.module.eval()
    try:
        with torch.no_grad():
            per_token = _token_scores(model, ids_bt.to(device), next_bt.to(device), num_microbatches)
    finally:
        for module, mode in modes:
            module.training = mode
    out = []
    for i, r in enumerate(rows):
        span = slice(len(r) - targets[i], len(r))
        out.append((float(per_token[i, span, 0].sum()), bool((per_token[i, span, 1] > 0).all())))
    return out


def _token_scores(
    model: ParallelModel, ids_bt: torch.Tensor, next_bt: torch.Tensor, num_microbatches: int | None
) -> torch.Tensor:
    """``(b, t, 2)`` float64 on every rank: the log-probability of ``next_bt`` and whether it is the argmax."""
    layout = model.layout
    chunks = _microbatches(ids_bt.shape[0], layout.pp, num_microbatches)
    decoder = _decoder(model, ids_bt.device)
    mask_bt = torch.ones_like(ids_bt)
    pos_bt = torch.arange(ids_bt.shape[1], device=ids_bt.device).expand_as(ids_bt)
    scores = torch.zeros((*ids_bt.shape, 2), dtype=torch.float64, device=ids_bt.device)

    def score(logits_btv: torch.Tensor, rows: slice) -> None:
        logp = torch.log_softmax(logits_btv.to(torch.float32), dim=-1)
        target = next_bt[rows]
        scores[rows, :, 0] = logp.gather(-1, target[..., None])[..., 0].to(torch.float64)
        scores[rows, :, 1] = (logp.argmax(dim=-1) == target).to(torch.float64)

    if layout.pp == 1:
        score(decoder(ids_bt, mask_bt, pos_bt, decoder.new_cache(), all_positions=True), chunks[0])
        return scores

    def forward(x: torch.Tensor, m: int, rows: slice) -> torch.Tensor:
        return decoder(x, mask_bt[rows], pos_bt[rows], decoder.new_cache(), all_positions=True)

    peers = forward_round(model, decoder, ids_bt, chunks, forward, score)
    dist.broadcast(scores, src=peers.last, group=peers.group)
    return scores


__all__ = ["score_continuations"]
