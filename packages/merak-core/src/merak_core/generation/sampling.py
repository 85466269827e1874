"""Choosing the next token from the last position's logits: greedy, or sampled with temperature,
top-k and top-p from one random stream per prompt row.

[Note: sampling streams] Row ``r`` of the batch (its index in the whole batch given to
``generate``) draws from its own generator seeded from ``(seed, r)``. The draw of a row therefore
does not depend on how the batch is split into pipeline microbatches, and every TP rank (which
holds the same gathered logits) draws the same token without a collective. Logits are cast to
float32 first, as transformers' ``generate`` does, so greedy choices agree with it bit for bit
on equal logits.

Not done here: the model's forward and the cache (:mod:`merak_core.generation.decode`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_ROW_STRIDE = 1_000_003
_SEED_MOD = 2**63 - 1


@dataclass(frozen=True, kw_only=True)
class SamplingOptions:
    """How the next token is chosen."""

    do_sample: bool = False
    """False: the most likely token (greedy); True: drawn from the filtered distribution."""
    temperature: float = 1.0
    """Logits are divided by it before top-k/top-p (sampling only); must be > 0."""
    top_k: int = 0
    """Keep only the k most likely tokens (0: all)."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability reaches top_p (1.0: all)."""
    seed: int | None = None
    """Seed of the row streams ([Note: sampling streams]); None: drawn once and shared by all ranks."""

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature} must be > 0 (use do_sample=False for greedy)")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 keeps every token)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1] (1.0 keeps every token)")


def row_generators(seed: int, rows: int, device: torch.device) -> list[torch.Generator]:
    """One generator per batch row ([Note: sampling streams])."""
    out = []
    for row in range(rows):
        gen = torch.Generator(device=device)
        gen.manual_seed((seed * _ROW_STRIDE + row) % _SEED_MOD)
        out.append(gen)
    return out


def filter_scores(scores_bv: torch.Tensor, opts: SamplingOptions) -> torch.Tensor:
    """Temperature, then top-k, then top-p (as transformers' logits warpers, keeping at least one token)."""
    scores_bv = scores_bv / opts.temperature
    if 0 < opts.top_k < scores_bv.shape[-1]:
        kth = torch.topk(scores_bv, opts.top_k, dim=-1).values[..., -1:]
        scores_bv = scores_bv.masked_fill(scores_bv < kth, float("-inf"))
    if opts.top_p < 1.0:
        sorted_scores, sorted_index = torch.sort(scores_bv, descending=False, dim=-1)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1 - opts.top_p)
        remove_sorted[..., -1:] = False
        remove = remove_sorted.scatter(-1, sorted_index, remove_sorted)
        scores_bv = scores_bv.masked_fill(remove, float("-inf"))
    return scores_bv


def next_tokens(
    logits_bv: torch.Tensor, opts: SamplingOptions, generators: list[torch.Generator] | None
) -> torch.Tensor:
    """The chosen token of each row (``generators``: one per row of ``logits_bv``, for sampling)."""
    scores_bv = logits_bv.to(torch.float32)
    if not opts.do_sample:
        return scores_bv.argmax(dim=-1)
    assert generators is not None and len(generators) == scores_bv.shape[0]
    probs_bv = filter_scores(scores_bv, opts).softmax(dim=-1)
    drawn = [torch.multinomial(probs_bv[r], 1, generator=g) for r, g in enumerate(generators)]
    return torch.cat(drawn)
