"""``Trainer.generate``: decoding on a run's composed model (the Trainer takes it as a base class).

It reads only the run's composed model and arguments (``self.model``, ``self.args``); it never
imports the Trainer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from merak_core.generation.decode import generate


def check_run_options(args: Any, pp: int) -> None:
    """Refuse the run options generation does not compute exactly yet (naming the key and the fix)."""
    zero_stage = getattr(args, "zero_stage", 0)
    if zero_stage >= 2:
        raise ValueError(
            f"zero_stage={zero_stage}: generation is not supported (the parameters are sharded over dp): "
            "generate with zero_stage <= 1 (a checkpoint loads at any setting)"
        )
    ep = getattr(args, "ep", 1)
    if ep > 1:
        raise ValueError(
            f"ep={ep}: generation is not supported (each decoding step's expert all-to-all needs every rank of "
            "the EP group, whose prompts stop at different steps): generate with ep: 1 (a checkpoint loads at any ep)"
        )
    cp = getattr(args, "cp", 1)
    if cp > 1:
        raise ValueError(
            f"cp={cp}: generation is not supported (a decoded token cannot be split over the cp ranks, and "
            "their attention runs over the whole sequence): generate with cp: 1 (a checkpoint loads at any cp)"
        )
    chunks = getattr(args, "overlap_chunks", 1)
    if chunks > 1 and pp == 1:
        raise ValueError(
            f"overlap_chunks={chunks}: generation at pp=1 is not supported (the TP layers split each batch "
            "into sub-batches): generate with overlap_chunks=1"
        )


class GenerateMixin:
    """The Trainer's ``generate`` (docs/generation.md)."""

    args: Any

    @property
    def model(self) -> Any:
        """The run's composed model (the Trainer's ``ParallelModel``)."""
        raise NotImplementedError

    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        max_new_tokens: int,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        seed: int | None = None,
        num_microbatches: int | None = None,
    ) -> torch.Tensor:
        """Continue the left-padded prompts on this run's layout; collective, every rank gets the sequences
        (:func:`merak_core.generation.generate`; ``num_microbatches`` defaults to the run's under pp > 1)."""
        check_run_options(self.args, self.model.layout.pp)
        if num_microbatches is None and self.model.layout.pp > 1:
            num_microbatches = min(int(self.args.num_microbatches), int(input_ids.shape[0]))
        return generate(
            self.model,
            input_ids,
            attention_mask,
            max_new_tokens=max_new_tokens,
            do_sample=do_sample,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            seed=seed,
            num_microbatches=num_microbatches,
        )
