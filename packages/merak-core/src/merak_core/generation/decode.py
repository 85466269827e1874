"""KV-cached decoding on the training layout: prefill the prompts in one pass, then one token per step.

Shapes: ``b`` batch rows, ``t`` tokens, ``h`` hidden size, ``v`` vocabulary.

At pp > 1 the steps run through the stages by merak-pipe's decode schedule, steps overlapping
([Note: decoding under pipeline parallelism] in :mod:`merak_core.generation.pipeline`).

[Note: transformers' generate, exactly] As ``GenerationMixin.generate`` does: position ids are the
running count of attended tokens (``cumsum(mask) - 1``, 0 on padding); after each step the mask
gains a column of ones and the positions advance by one; a row that produced ``eos_token_id`` gets
``pad_token_id`` afterwards; decoding stops when every row has ended or after ``max_new_tokens``.

Not done here: the pipeline messages (:mod:`merak_core.generation.pipeline`), rebuilding the eager layers
(:mod:`merak_core.generation.decoders`), sampling (:mod:`merak_core.generation.sampling`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from merak_core.generation.decoders import StageDecoder, WholeModelDecoder, build_stage_decoder
from merak_core.generation.pipeline import agreed_stage_decoder, pipelined_decode
from merak_core.generation.sampling import SamplingOptions, next_tokens, row_generators
from merak_core.parallel.compose import ParallelModel


def generate(
    model: ParallelModel,
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
    """Continue every (left-padded) prompt of ``input_ids`` by up to ``max_new_tokens`` tokens.

    Collective over the world: every rank calls it with the same prompts and options. Returns the
    ``(b, t + new)`` sequences (prompt and new tokens, ``pad_token_id`` after a row's end) on every
    rank, as transformers' ``generate`` does. ``num_microbatches`` (pp > 1): how many microbatches
    the rows are split into (default: ``min(b, pp)``). See [Note: decoding under pipeline parallelism].
    """
    opts = SamplingOptions(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    layout = model.layout
    device = layout.device
    ids_bt, mask_bt = _check_prompts(input_ids, attention_mask)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    _refuse_unsupported(model)
    _check_positions(model, mask_bt, max_new_tokens)
    eos = _eos_set(eos_token_id)
    pad = pad_token_id if pad_token_id is not None else (min(eos) if eos else 0)
    chunks = _microbatches(ids_bt.shape[0], layout.pp, num_microbatches)
    decoder = _decoder(model, device)
    generators = (
        row_generators(_shared_seed(opts, device), ids_bt.shape[0], device) if opts.do_sample else None
    )
    modes = [(m, m.training) for m in model.module.modules()]
    model.module.eval()  # pp == 1 decodes with the module itself: no dropout (a training run's is in train mode)
    try:
        with torch.no_grad():
            return _decode_loop(
                model,
                decoder,
                ids_bt.to(device),
                mask_bt.to(device),
                chunks,
                opts,
                generators,
                eos,
                pad,
                max_new_tokens,
            )
    finally:
        for module, mode in modes:
            module.training = mode


def _check_prompts(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    if input_ids.ndim != 2 or input_ids.dtype not in (torch.int64, torch.int32) or input_ids.shape[1] == 0:
        raise ValueError(
            f"input_ids must be a (batch, tokens) integer tensor with at least one token, got shape "
            f"{tuple(input_ids.shape)} and dtype {input_ids.dtype}"
        )
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(torch.long)
    if mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask has shape {tuple(mask.shape)}, input_ids {tuple(input_ids.shape)}: they must match"
        )
    if bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (token)")
    right_padded = (mask[:, 1:] < mask[:, :-1]).any(dim=1)
    empty = mask.sum(dim=1) == 0
    if bool(right_padded.any()) or bool(empty.any()):
        rows = torch.nonzero(right_padded | empty).flatten().tolist()
        raise ValueError(
            f"rows {rows} of attention_mask are right-padded or empty: generation continues each prompt after "
            "its last token, so prompts must be left-padded (tokenizer.padding_side = 'left') and non-empty"
        )
    return input_ids.to(torch.long), mask


def _refuse_unsupported(model: ParallelModel) -> None:
    cp = getattr(model.layout, "cp", 1)
    if cp > 1:
        raise ValueError(
            f"generation at cp={cp} is not supported (a decoded token cannot be split over the cp ranks): "
            "generate from a model composed with cp=1 (the checkpoint loads at any cp)"
        )
    if model.source is not None and model.source.sequence_parallel:
        raise ValueError(
            "generation with sequence_parallel=true is not supported (one decoded token cannot be split over "
            "the TP ranks): generate from a model composed with sequence_parallel=false (the checkpoint loads "
            "at any layout)"
        )
    if len(model.stage_modules) > 1:
        raise ValueError(
            f"generation with virtual stages (this rank holds stages {sorted(model.stage_modules)}) is not "
            "supported: generate with virtual_stages=1"
        )
    if model.layout.pp > 1 and model.lora is not None:
        raise ValueError(
            "generation of a LoRA model under pipeline parallelism is not supported: generate at pp=1, or "
            "from the export with the adapters merged (merak export --merge)"
        )


def _check_positions(model: ParallelModel, mask_bt: torch.Tensor, max_new_tokens: int) -> None:
    """A model with a learned position table (``config.n_positions``, GPT-2) cannot go past it: refused
    here, before any message (an embedding lookup out of range would fail on one stage only)."""
    table = getattr(None if model.source is None else model.source.config, "n_positions", None)
    longest = int(mask_bt.sum(dim=1).max())
    if isinstance(table, int) and longest + max_new_tokens - 1 > table:  # the last new token is not fed
        raise ValueError(
            f"the longest prompt ({longest} tokens) plus max_new_tokens={max_new_tokens} exceeds the model's "
            f"position table (n_positions={table}): shorten the prompts or lower max_new_tokens to "
            f"{max(table - longest + 1, 0)}"
        )


def _eos_set(eos_token_id: int | Sequence[int] | None) -> list[int]:
    if eos_token_id is None:
        return []
    return [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(e) for e in eos_token_id]


def _microbatches(rows: int, pp: int, num_microbatches: int | None) -> list[slice]:
    count = min(rows, pp) if num_microbatches is None else num_microbatches
    if not 1 <= count <= rows:
        raise ValueError(f"num_microbatches={num_microbatches} must be between 1 and the batch's {rows} rows")
    if pp == 1:
        count = 1
    bounds = [rows * i // count for i in range(count + 1)]
    return [slice(bounds[i], bounds[i + 1]) for i in range(count)]


def _decoder(model: ParallelModel, device: torch.device) -> WholeModelDecoder | StageDecoder:
    if model.layout.pp == 1:
        config = None if model.source is None else model.source.config
        return WholeModelDecoder(model.module, config, getattr(config, "vocab_size", None))
    return agreed_stage_decoder(model, lambda: build_stage_decoder(model, device))


def _shared_seed(opts: SamplingOptions, device: torch.device) -> int:
    """The row streams' seed: the given one, else one drawn on rank 0 and broadcast to all ranks."""
    if opts.seed is not None:
        return opts.seed
    drawn = torch.randint(0, 2**62, (1,), dtype=torch.long).to(device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(drawn, src=0)
    return int(drawn.item())


def _decode_loop(
    model: ParallelModel,
    decoder: Any,
    ids_bt: torch.Tensor,
    mask_bt: torch.Tensor,
    chunks: list[slice],
    opts: SamplingOptions,
    generators: list[torch.Generator] | None,
    eos: list[int],
    pad: int,
    max_new_tokens: int,
) -> torch.Tensor:
    """Prefill, then one token per step ([Note: transformers' generate, exactly]); pp > 1: steps overlapping
    through the stages ([Note: decoding under pipeline parallelism])."""

    def choose(logits_bv: torch.Tensor, rows: slice) -> torch.Tensor:
        return next_tokens(logits_bv, opts, None if generators is None else generators[rows])

    if model.layout.pp > 1:
        return pipelined_decode(model, decoder, ids_bt, mask_bt, chunks, choose, eos, pad, max_new_tokens)
    caches = [decoder.new_cache() for _ in chunks]
    pos_bt = (mask_bt.cumsum(-1) - 1).masked_fill(mask_bt == 0, 0)
    sequences = ids_bt
    inputs_bt = ids_bt
    unfinished = torch.ones(ids_bt.shape[0], dtype=torch.bool, device=ids_bt.device)
    eos_t = torch.tensor(eos, dtype=torch.long, device=ids_bt.device)
    for _ in range(max_new_tokens):
        tokens_b = choose(decoder(inputs_bt, mask_bt, pos_bt, caches[0]), chunks[0])
        tokens_b = torch.where(unfinished, tokens_b, torch.full_like(tokens_b, pad))
        sequences = torch.cat([sequences, tokens_b[:, None]], dim=1)
        if eos:
            unfinished &= ~torch.isin(tokens_b, eos_t)
        if not bool(unfinished.any()):
            break
        inputs_bt = tokens_b[:, None]
        mask_bt = torch.cat([mask_bt, torch.ones_like(mask_bt[:, :1])], dim=1)
        pos_bt = pos_bt[:, -1:] + 1
    return sequences
