"""KV-cached decoding on the training layout: prefill the prompts in one pass, then one token per step.

Shapes: ``b`` batch rows, ``t`` tokens, ``h`` hidden size, ``v`` vocabulary.

[Note: decoding under pipeline parallelism] The batch's rows are split into microbatches; each
stage keeps one cache per microbatch. A step is the forward-only round of merak-pipe's GPipe
schedule, lowered and validated under NCCL's rules (:func:`decode_round`), which this module
interprets: every stage runs the microbatches in order:
receive the hidden states of microbatch ``m`` from the previous stage (the first stage embeds its
tokens instead), run its layers, send the result to the next stage; the last stage chooses the
tokens of ``m``. Stage ``s`` works on microbatch ``m`` while stage ``s - 1`` works on ``m + 1``.
At the end of the step the last stage broadcasts the step's tokens over the pipeline group, so the
first stage can embed them and every stage knows which rows have ended. Each pair of neighbouring
ranks issues its messages in the same order (one send/receive per microbatch, in microbatch order),
and no rank posts a receive ahead of a send its peer waits for, so the order is valid under NCCL's
rules (no tags, one in-order stream); the broadcast comes after every point-to-point message of the
step on every rank. Data parallel replicas decode the same batch independently.

[Note: transformers' generate, exactly] As ``GenerationMixin.generate`` does: position ids are the
running count of attended tokens (``cumsum(mask) - 1``, 0 on padding); after each step the mask
gains a column of ones and the positions advance by one; a row that produced ``eos_token_id`` gets
``pad_token_id`` afterwards; decoding stops when every row has ended or after ``max_new_tokens``.

Not done here: rebuilding the eager layers (:mod:`merak_core.generation.decoders`), sampling
(:mod:`merak_core.generation.sampling`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from merak_core.generation.decoders import StageDecoder, WholeModelDecoder, build_stage_decoder
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
    return build_stage_decoder(model, device)


def _shared_seed(opts: SamplingOptions, device: torch.device) -> int:
    """The row streams' seed: the given one, else one drawn on rank 0 and broadcast to all ranks."""
    if opts.seed is not None:
        return opts.seed
    drawn = torch.randint(0, 2**62, (1,), dtype=torch.long).to(device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(drawn, src=0)
    return int(drawn.item())


class _Peers:
    """This rank's neighbours in its pipeline (same dp and tp coordinates)."""

    def __init__(self, model: ParallelModel) -> None:
        layout = model.layout
        stage = layout.pp_rank
        self.group = layout.pp_group
        self.prev = layout.rank_of(pp=stage - 1, dp=layout.dp_rank, tp=layout.tp_rank) if stage > 0 else None
        self.next = (
            layout.rank_of(pp=stage + 1, dp=layout.dp_rank, tp=layout.tp_rank)
            if stage < layout.pp - 1
            else None
        )
        self.last = layout.rank_of(pp=layout.pp - 1, dp=layout.dp_rank, tp=layout.tp_rank)


def _hidden_spec(model: ParallelModel) -> tuple[int, torch.dtype]:
    config = None if model.source is None else model.source.config
    params = [p for p in model.module.parameters() if p.is_floating_point()]
    return int(getattr(config, "hidden_size", 0)), params[0].dtype


@functools.lru_cache(maxsize=16)
def decode_round(num_stages: int, num_microbatches: int) -> dict[int, list[Any]]:
    """Each pipeline rank's actions in one decode step ([Note: decoding under pipeline parallelism]).

    The forward-only round of merak-pipe's GPipe schedule (every stage runs ``F`` of the microbatches in
    order), lowered (``RECV_F`` before the ``F`` that needs it, ``SEND_F`` after the one that makes it) and
    validated with the NCCL rules (``merak_pipe.validate(..., nccl=True)`` replays the evaluation round's
    issue order too). Pipeline rank ``s`` holds stage ``s``.
    """
    import merak_pipe
    from merak_pipe import ActionKind

    schedule = merak_pipe.build_schedule("gpipe", num_stages=num_stages, num_microbatches=num_microbatches)
    lowered = merak_pipe.validate(merak_pipe.lower(schedule), channel_order=True, nccl=True)
    keep = (ActionKind.FORWARD, ActionKind.SEND_F, ActionKind.RECV_F)
    return {rank: [a for a in lowered.actions[rank] if a.kind in keep] for rank in range(num_stages)}


def forward_round(
    model: ParallelModel,
    decoder: Any,
    inputs_bt: torch.Tensor,
    chunks: list[slice],
    forward: Callable[[torch.Tensor, int, slice], torch.Tensor],
    at_last: Callable[[torch.Tensor, slice], None],
) -> _Peers:
    """One forward of every microbatch through this rank's stage by the decode round (pp > 1).

    ``forward(x, m, rows)`` runs the stage on microbatch ``m`` (rows ``rows`` of the batch); on the last
    stage ``at_last(output, rows)`` takes its output. Returns the stage's peers (the caller broadcasts
    what the last stage made).
    """
    from merak_pipe import ActionKind

    peers = _Peers(model)
    width, dtype = _hidden_spec(model)
    received: dict[int, torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}
    for action in decode_round(model.layout.pp, len(chunks))[model.layout.pp_rank]:
        m = action.microbatch
        rows = chunks[m]
        if action.kind is ActionKind.RECV_F:
            received[m] = torch.empty(
                (rows.stop - rows.start, inputs_bt.shape[1], width), dtype=dtype, device=inputs_bt.device
            )
            dist.recv(received[m], src=peers.prev, group=peers.group)
        elif action.kind is ActionKind.SEND_F:
            dist.send(outputs.pop(m).contiguous(), dst=peers.next, group=peers.group)
        else:
            out = forward(inputs_bt[rows] if decoder.first else received.pop(m), m, rows)
            if decoder.last:
                at_last(out, rows)
            else:
                outputs[m] = out
    return peers


def _run_step(
    model: ParallelModel,
    decoder: Any,
    inputs_bt: torch.Tensor,
    mask_bt: torch.Tensor,
    pos_bt: torch.Tensor,
    chunks: list[slice],
    caches: list[Any],
    choose: Any,
) -> torch.Tensor:
    """One forward of every microbatch through this rank's stage; the step's tokens on every rank."""
    tokens_b = torch.zeros(inputs_bt.shape[0], dtype=torch.long, device=inputs_bt.device)
    if model.layout.pp == 1:
        tokens_b[chunks[0]] = choose(decoder(inputs_bt, mask_bt, pos_bt, caches[0]), chunks[0])
        return tokens_b

    def forward(x: torch.Tensor, m: int, rows: slice) -> torch.Tensor:
        return decoder(x, mask_bt[rows], pos_bt[rows], caches[m])

    def at_last(out: torch.Tensor, rows: slice) -> None:
        tokens_b[rows] = choose(out, rows)

    peers = forward_round(model, decoder, inputs_bt, chunks, forward, at_last)
    dist.broadcast(tokens_b, src=peers.last, group=peers.group)
    return tokens_b


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
    """Prefill, then one token per step ([Note: transformers' generate, exactly])."""

    def choose(logits_bv: torch.Tensor, rows: slice) -> torch.Tensor:
        return next_tokens(logits_bv, opts, None if generators is None else generators[rows])

    caches = [decoder.new_cache() for _ in chunks]
    pos_bt = (mask_bt.cumsum(-1) - 1).masked_fill(mask_bt == 0, 0)
    sequences = ids_bt
    inputs_bt = ids_bt
    unfinished = torch.ones(ids_bt.shape[0], dtype=torch.bool, device=ids_bt.device)
    eos_t = torch.tensor(eos, dtype=torch.long, device=ids_bt.device)
    for _ in range(max_new_tokens):
        tokens_b = _run_step(model, decoder, inputs_bt, mask_bt, pos_bt, chunks, caches, choose)
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
