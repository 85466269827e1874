"""The pipeline messages of decoding and scoring at pp > 1: merak-pipe's schedules, interpreted.

Shapes: ``b`` batch rows, ``t`` tokens, ``h`` hidden size.

[Note: decoding under pipeline parallelism] The batch's rows are split into microbatches; each stage
keeps one KV cache per microbatch. Decoding interprets merak-pipe's multi-step decode schedule
(``merak_pipe.decode_schedule(pp, microbatches, max_new_tokens)``, validated under NCCL's rules,
[Note: decode schedules] in ``merak_pipe/schedules/decode.py``): every stage runs the forwards of
(step, microbatch) in order; stage ``s`` receives microbatch ``m``'s hidden states from stage
``s - 1`` (``RECV_F``; the first stage embeds tokens instead), runs its layers and sends the result on
(``SEND_F``); the last stage picks the tokens of ``m`` and sends them back to the first stage
(``SEND_T`` / ``RECV_T``), which starts step ``t + 1`` of ``m`` at once while the other microbatches
of step ``t`` are still in the pipeline: steps overlap, and with as many microbatches as stages every
stage is busy in the steady state. Each run of consecutive sends and receives of a rank is issued as
one ``batch_isend_irecv`` and waited before the rank goes on, which is the unit the validator replays.

Ending rows and stopping. A row that produced EOS gets ``pad_token_id`` afterwards and keeps flowing
(masked, exactly as transformers' ``generate``). A microbatch whose rows have all ended stops, agreed
by every stage without a collective: each message carries a flag (the last element of the flattened
hidden states, one more element after the tokens). The last stage knows the end when it picks the
tokens of step ``e``; its token message of step ``e`` carries the flag to the first stage; the first
stage then sends, in place of the hidden states of step ``e + 1``, a message with the flag set and runs
nothing, each stage passes it on, and no stage runs anything of the microbatch after it
(``merak_pipe.decode_action_runs``). Every rank learns the end from a message it receives before any
action it drops, and it drops whole pairs (a send and its receive), so the order that is left is one
merak-pipe validated (``decode_schedule(..., last_steps=...)``, tested for every combination of ends).
A flag read is a host read of a received tensor (a device synchronisation on GPUs, where the message
lives on the device as NCCL requires). Decoding stops when every microbatch has ended or after
``max_new_tokens`` steps; then the last stage broadcasts every row's new tokens and their count over
the pipeline group (one collective, after every point-to-point message of every rank). Stopping each
microbatch at its own end is exact: transformers stops when every row has ended, and a microbatch's
rows depend only on that microbatch.

Scoring (one forward of every position, no step after it) runs the forward-only round of merak-pipe's
GPipe schedule (:func:`decode_round`, :func:`forward_round`). Data-parallel replicas decode the same
batch independently, each through its own pipeline.

Not done here: the loop at pp = 1 and the options (:mod:`merak_core.generation.decode`), the eager
stages (:mod:`merak_core.generation.decoders`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from merak_core.parallel.compose import ParallelModel


class _Peers:
    """This rank's neighbours in its pipeline (same dp and tp coordinates)."""

    def __init__(self, model: ParallelModel) -> None:
        layout = model.layout
        stage = layout.pp_rank

        def rank(pp: int) -> int:
            return int(layout.rank_of(pp=pp, dp=layout.dp_rank, tp=layout.tp_rank))

        self.group = layout.pp_group
        self.prev = rank(stage - 1) if stage > 0 else None
        self.next = rank(stage + 1) if stage < layout.pp - 1 else None
        self.first = rank(0)
        self.last = rank(layout.pp - 1)


def _hidden_spec(model: ParallelModel) -> tuple[int, torch.dtype]:
    config = None if model.source is None else model.source.config
    params = [p for p in model.module.parameters() if p.is_floating_point()]
    return int(getattr(config, "hidden_size", 0)), params[0].dtype


def agreed_stage_decoder(model: ParallelModel, build: Callable[[], Any]) -> Any:
    """``build()`` (this rank's stage decoder), or the first refusal any stage of the pipeline raised, on
    every rank of it: a stage that refuses alone (a cut inside a decoder layer) must not leave the others
    waiting on their first message. One gather of the refusals over the pipeline group, before any."""
    error: ValueError | None = None
    decoder = None
    try:
        decoder = build()
    except ValueError as exc:
        error = exc
    refusals: list[str | None] = [None] * model.layout.pp
    dist.all_gather_object(refusals, None if error is None else str(error), group=model.layout.pp_group)
    if error is not None:
        raise error
    for stage, text in enumerate(refusals):
        if text is not None:
            raise ValueError(f"pipeline stage {stage} refuses generation: {text}")
    return decoder


@functools.lru_cache(maxsize=16)
def decode_round(num_stages: int, num_microbatches: int) -> dict[int, list[Any]]:
    """Each pipeline rank's actions in one forward of every microbatch (scoring).

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


@functools.lru_cache(maxsize=16)
def decode_plan(num_stages: int, num_microbatches: int, num_steps: int) -> dict[int, list[Any]]:
    """Each pipeline rank's actions over every decode step: merak-pipe's decode schedule, validated under
    NCCL's rules ([Note: decoding under pipeline parallelism])."""
    import merak_pipe

    return dict(merak_pipe.decode_schedule(num_stages, num_microbatches, num_steps).actions)


def forward_round(
    model: ParallelModel,
    decoder: Any,
    inputs_bt: torch.Tensor,
    chunks: list[slice],
    forward: Callable[[torch.Tensor, int, slice], torch.Tensor],
    at_last: Callable[[torch.Tensor, slice], None],
) -> _Peers:
    """One forward of every microbatch through this rank's stage by :func:`decode_round` (pp > 1).

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


@dataclass
class _DecodeState:
    """What one rank holds while it interprets the decode schedule."""

    ids_bt: torch.Tensor
    mask_bt: torch.Tensor
    chunks: list[slice]
    num_steps: int
    pad: int
    eos_t: torch.Tensor
    caches: list[Any]
    width: int
    dtype: torch.dtype
    ended: dict[int, int] = field(default_factory=dict)
    """Microbatch -> its last step, once this rank knows it."""
    messages: dict[tuple[str, int, int], torch.Tensor] = field(default_factory=dict)
    """(kind, microbatch, step) -> a message received or made and not yet consumed."""
    new_bt: torch.Tensor | None = None
    """The last stage: every row's new tokens (``pad`` after its end)."""
    unfinished_b: torch.Tensor | None = None

    def rows(self, m: int) -> int:
        return self.chunks[m].stop - self.chunks[m].start

    def hidden_shape(self, m: int, t: int) -> tuple[int, int, int]:
        return (self.rows(m), self.ids_bt.shape[1] if t == 0 else 1, self.width)

    def mask_pos(self, m: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention mask and positions of microbatch ``m`` at step ``t`` ([Note: transformers'
        generate, exactly] in ``decode.py``)."""
        mask = self.mask_bt[self.chunks[m]]
        pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        if t == 0:
            return mask, pos
        grown = torch.cat([mask, torch.ones_like(mask[:, :1]).expand(-1, t)], dim=1)
        return grown, pos[:, -1:] + t


def _receive_buffer(state: _DecodeState, action: Any) -> torch.Tensor:
    m, t = action.microbatch, action.step
    if action.kind.value == "RECV_T":
        return torch.empty(state.rows(m) + 1, dtype=torch.long, device=state.ids_bt.device)
    numel = state.rows(m) * state.hidden_shape(m, t)[1] * state.width + 1
    return torch.empty(numel, dtype=state.dtype, device=state.ids_bt.device)


def _issue(unit: list[Any], state: _DecodeState, peers: _Peers) -> None:
    """Issue one unit (consecutive sends and receives) as one batch and wait for all of it."""
    if not unit:
        return
    ops, received = [], []
    for action in unit:
        m, t, kind = action.microbatch, action.step, action.kind.value
        if kind.startswith("SEND"):
            tensor = state.messages.pop(("T" if kind == "SEND_T" else "F", m, t))
            ops.append(
                dist.P2POp(dist.isend, tensor, peers.first if kind == "SEND_T" else peers.next, peers.group)
            )
        else:
            tensor = _receive_buffer(state, action)
            ops.append(
                dist.P2POp(dist.irecv, tensor, peers.last if kind == "RECV_T" else peers.prev, peers.group)
            )
            received.append((("T" if kind == "RECV_T" else "in", m, t), tensor))
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    for key, tensor in received:
        state.messages[key] = tensor
        if key[0] == "T" and bool(tensor[-1]):  # the first stage learns the end of microbatch key[1]
            state.ended[key[1]] = key[2]


def _stage_input(action: Any, state: _DecodeState, decoder: Any) -> torch.Tensor | None:
    """The input of one F of the schedule, or None where it only passes its microbatch's end marker on."""
    m, t = action.microbatch, action.step
    if decoder.first:
        tokens = state.messages.pop(("T", m, t - 1)) if t > 0 else None
        if m in state.ended:  # ended at t - 1: this F is the end marker (decode_action_runs)
            return None
        return state.ids_bt[state.chunks[m]] if tokens is None else tokens[:-1, None]
    incoming = state.messages.pop(("in", m, t))
    if bool(incoming[-1]):
        state.ended.setdefault(m, t - 1)  # the last stage knew it already
        return None
    return incoming[:-1].view(state.hidden_shape(m, t))


def _forward(action: Any, state: _DecodeState, decoder: Any, choose: Callable[..., torch.Tensor]) -> None:
    """Run one F of the schedule: compute, or pass a microbatch's end marker on."""
    m, t = action.microbatch, action.step
    x = _stage_input(action, state, decoder)
    if x is None:
        if not decoder.last:
            marker = torch.zeros(
                state.rows(m) * state.width + 1, dtype=state.dtype, device=state.ids_bt.device
            )
            marker[-1] = 1
            state.messages[("F", m, t)] = marker
        return
    mask, pos = state.mask_pos(m, t)
    out = decoder(x, mask, pos, state.caches[m])
    if decoder.last:
        _pick(out, m, t, state, choose)
    else:
        flat = out.reshape(-1)
        state.messages[("F", m, t)] = torch.cat([flat, flat.new_zeros(1)])


def _pick(
    logits_bv: torch.Tensor, m: int, t: int, state: _DecodeState, choose: Callable[..., torch.Tensor]
) -> None:
    """The last stage: microbatch ``m``'s tokens of step ``t``, its rows' ends and the token message."""
    assert state.new_bt is not None and state.unfinished_b is not None
    rows = state.chunks[m]
    tokens_b = choose(logits_bv, rows)
    unfinished = state.unfinished_b[rows]
    tokens_b = torch.where(unfinished, tokens_b, torch.full_like(tokens_b, state.pad))
    state.new_bt[rows, t] = tokens_b
    if state.eos_t.numel():
        state.unfinished_b[rows] = unfinished & ~torch.isin(tokens_b, state.eos_t)
    done = not bool(state.unfinished_b[rows].any())
    if done:
        state.ended[m] = t
    if t < state.num_steps - 1:
        state.messages[("T", m, t)] = torch.cat([tokens_b, tokens_b.new_tensor([int(done)])])


def pipelined_decode(
    model: ParallelModel,
    decoder: Any,
    ids_bt: torch.Tensor,
    mask_bt: torch.Tensor,
    chunks: list[slice],
    choose: Callable[..., torch.Tensor],
    eos: list[int],
    pad: int,
    max_new_tokens: int,
) -> torch.Tensor:
    """Prefill and every decode step at pp > 1 ([Note: decoding under pipeline parallelism]); the
    ``(b, t + new)`` sequences on every rank of the pipeline."""
    from merak_pipe import decode_action_runs

    layout = model.layout
    peers = _Peers(model)
    width, dtype = _hidden_spec(model)
    device = ids_bt.device
    state = _DecodeState(
        ids_bt=ids_bt,
        mask_bt=mask_bt,
        chunks=chunks,
        num_steps=max_new_tokens,
        pad=pad,
        eos_t=torch.tensor(eos, dtype=torch.long, device=device),
        caches=[decoder.new_cache() for _ in chunks],
        width=width,
        dtype=dtype,
    )
    if decoder.last:
        state.new_bt = torch.full((ids_bt.shape[0], max_new_tokens), pad, dtype=torch.long, device=device)
        state.unfinished_b = torch.ones(ids_bt.shape[0], dtype=torch.bool, device=device)
    unit: list[Any] = []
    for action in decode_plan(layout.pp, len(chunks), max_new_tokens)[layout.pp_rank]:
        end = state.ended.get(action.microbatch, max_new_tokens - 1)
        if not decode_action_runs(action, end):
            continue
        if action.kind.is_comm:
            unit.append(action)
            continue
        _issue(unit, state, peers)
        unit = []
        _forward(action, state, decoder, choose)
    _issue(unit, state, peers)
    return _gather_tokens(state, peers, max_new_tokens)


def _gather_tokens(state: _DecodeState, peers: _Peers, max_new_tokens: int) -> torch.Tensor:
    """Every rank: the prompts and the new tokens up to the last step any microbatch ran."""
    b = state.ids_bt.shape[0]
    packed = torch.zeros(b * max_new_tokens + 1, dtype=torch.long, device=state.ids_bt.device)
    if state.new_bt is not None:
        steps = [state.ended.get(m, max_new_tokens - 1) + 1 for m in range(len(state.chunks))]
        packed[:-1] = state.new_bt.reshape(-1)
        packed[-1] = max(steps)
    dist.broadcast(packed, src=peers.last, group=peers.group)
    count = int(packed[-1])
    new_bt = packed[:-1].view(b, max_new_tokens)[:, :count]
    return torch.cat([state.ids_bt, new_bt], dim=1)
