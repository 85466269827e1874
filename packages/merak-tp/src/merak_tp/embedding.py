"""The vocab-parallel embedding: an embedding table split along the vocabulary over a TP group.

The layer takes its TP process group as a constructor argument; its weight carries a
:class:`~merak_tp.shard_spec.ShardSpec` (dim 0), the same layout as a ``ColumnParallelLinear``
over the vocabulary, so a tied output projection shares the very same local shard. The
vocab-parallel loss lives in ``loss.py``.

Shape legend: ``*`` leading dims (batch first, then sequence), v vocabulary, h hidden.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from merak_tp._tp_module import _divide, _mark, _shard, _shard_param, _TPModule
from merak_tp.collectives import reduce_from_tp_region

__all__ = ["VocabParallelEmbedding"]


class VocabParallelEmbedding(_TPModule):
    """An embedding table split along the vocabulary (dim 0) over ``group``.

    Each rank looks up the ids in its block of the vocabulary (others give zero)
    and the partial results are all-reduced. The weight has the same layout as a
    ``ColumnParallelLinear`` over the vocabulary, so a tied output projection can
    share the very same local shard. ``embed_scale`` multiplies the looked-up rows (an
    embedding scaled by sqrt(hidden), as Gemma's), kept as a non-persistent buffer.

    At TP > 1 every forward checks that the ids lie in the vocabulary (masked, an id outside would
    embed as zeros on every rank): a host read of the ids, which on a GPU waits for the device. A
    caller that checks every batch itself before it reaches the device (Merak's trainer, on the
    loader's CPU batch) sets ``check_ids = False`` for those forwards.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        group: ProcessGroup | None,
        padding_idx: int | None = None,
        embed_scale: float | torch.Tensor | None = None,
        device: Any = None,
        dtype: torch.dtype | None = None,
        _skip_init: bool = False,
    ) -> None:
        super().__init__()
        self._bind_group(group)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_per_rank = _divide(
            num_embeddings, self.tp_size, "num_embeddings", type(self).__name__
        )
        self.vocab_start = self.tp_rank * self.num_embeddings_per_rank
        self.vocab_end = self.vocab_start + self.num_embeddings_per_rank
        self.padding_idx = padding_idx
        self.check_ids = True
        """Check the ids of every forward at TP > 1 (a host read); off where the caller checked them."""
        self.weight = _mark(
            nn.Parameter(
                torch.empty(self.num_embeddings_per_rank, embedding_dim, device=device, dtype=dtype)
            ),
            0,
        )
        self.embed_scale: torch.Tensor | None
        if embed_scale is None:
            self.embed_scale = None
        else:
            scale = (
                embed_scale.detach().clone()
                if isinstance(embed_scale, torch.Tensor)
                else torch.tensor(float(embed_scale), device=device)
            )
            self.register_buffer("embed_scale", scale, persistent=False)
        if not _skip_init:
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Embedding``'s init (standard normal, zero padding row) on the full table, sliced."""
        if self.weight.device.type == "meta":
            return
        full = torch.empty(
            self.num_embeddings, self.embedding_dim, dtype=self.weight.dtype, device=self.weight.device
        )
        nn.init.normal_(full)
        if self.padding_idx is not None:
            full[self.padding_idx].zero_()
        with torch.no_grad():
            self.weight.copy_(_shard(full, 0, self.tp_size, self.tp_rank))

    @classmethod
    def from_embedding(
        cls,
        embedding: nn.Embedding,
        *,
        group: ProcessGroup | None,
        embed_scale: float | torch.Tensor | None = None,
    ) -> VocabParallelEmbedding:
        """Slice an existing ``nn.Embedding`` (real or meta weights) into this rank's vocab shard.

        ``embed_scale``: the factor the source module's forward multiplies its rows by, if any.
        """
        if getattr(embedding, "max_norm", None) is not None or getattr(embedding, "sparse", False):
            raise ValueError("VocabParallelEmbedding supports neither max_norm nor sparse embeddings")
        num, dim = embedding.weight.shape
        if embed_scale is not None and not isinstance(embed_scale, torch.Tensor):
            embed_scale = torch.tensor(float(embed_scale), device=embedding.weight.device)
        layer = cls(
            num,
            dim,
            group=group,
            padding_idx=embedding.padding_idx,
            embed_scale=embed_scale,
            device="meta",
            dtype=embedding.weight.dtype,
            _skip_init=True,
        )
        layer.weight = _shard_param(embedding.weight, 0, layer.tp_size, layer.tp_rank)
        return layer

    def _local_padding_idx(self) -> int | None:
        p = self.padding_idx
        if p is None:
            return None
        p = p % self.num_embeddings
        return p - self.vocab_start if self.vocab_start <= p < self.vocab_end else None

    def _check_ids(self, ids: torch.Tensor) -> None:
        """An id outside the vocabulary is an error (masked, it would embed as a row of zeros on every rank).

        Every TP rank holds the same ids, so every rank raises the same error before the all-reduce.
        """
        if ids.is_meta or torch.compiler.is_compiling() or torch.compiler.is_exporting():
            return
        bad = (ids < 0) | (ids >= self.num_embeddings)
        if bool(bad.any()):
            value = int(ids[bad].flatten()[0])
            raise ValueError(
                f"token id {value} is outside the vocabulary of {self.num_embeddings} (ids 0.."
                f"{self.num_embeddings - 1}) of this vocab-parallel embedding; fix the tokenizer or "
                "the data, or build the model with a vocabulary that covers every id"
            )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            out = nn.functional.embedding(ids, self.weight, self.padding_idx)
        else:
            if self.check_ids:
                self._check_ids(ids)
            outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
            local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
            out = nn.functional.embedding(local_ids, self.weight, self._local_padding_idx())
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
            out = reduce_from_tp_region(out, self.group)
        if self.embed_scale is not None:
            # One non-zero row per token in the sum: scaling after the reduction is exact.
            out = out * self.embed_scale.to(self.weight.dtype)
        return out

    def extra_repr(self) -> str:
        scale = (
            ""
            if self.embed_scale is None
            else f", embed_scale={float(self.embed_scale):g}"
            if self.embed_scale.device.type != "meta"
            else ", embed_scale=(meta)"
        )
        return (
            f"{self.num_embeddings} (per rank {self.num_embeddings_per_rank}), {self.embedding_dim}, "
            f"tp={self.tp_size}{scale}"
        )
