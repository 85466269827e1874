"""Context parallelism's memory: the activation bytes one rank holds during a step, measured at cp=1, 2, 4.

Each rank of a 4-rank pool runs one forward and backward of the reference Llama (float64, GQA, rotary,
causal) on the same two sequences of ``SEQ`` tokens: alone on the whole sequences (cp=1), in a cp=2
group and in the cp=4 group, each time holding its share of the tokens, in both modes, under the
saved-tensor meter (:class:`~merak_core.planner.memory_meter.SavedActivationMeter`: the bytes
autograd keeps for backward, each storage once, parameters excluded). Every rank's peak is
compared with the memory model's prediction from a profile measured at cp=1
(:func:`merak_core.planner.context_cost.cp_local_profile` + :func:`~merak_core.planner.memory.predict_stage_memory`),
which must hold within the planner's margin (``MEMORY_MARGIN``), and with ``1 / cp`` of the cp=1 bytes:
both modes hold within 15% of ``1 / cp`` at cp=2 and cp=4 on every rank (the ring's backward passes
the key/value blocks round again instead of keeping them, [Note: ring backward] in
:mod:`merak_tp.ring`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from merak_core.planner.context_cost import cp_local_profile
from merak_core.planner.memory import MEMORY_MARGIN, predict_stage_memory
from merak_core.planner.profile import profile_model
from tests.support.dist import run_on_ranks
from tests.support.models import DecoderConfig, Llama

SEQ, BATCH, VOCAB, LAYERS = 128, 2, 96, 2
CPS = (1, 2, 4)
TOLERANCE = 0.15
"""How far from ``1 / cp`` of the cp=1 bytes a rank's measured bytes may be (issue 28)."""


def _model() -> Llama:
    torch.manual_seed(0)
    cfg = DecoderConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_layers=LAYERS,
        num_heads=8,
        num_kv_heads=4,  # GQA; cp=4 divides both head counts (Ulysses)
        max_seq_len=SEQ,
    )
    return Llama(cfg).double()


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))


def _step_peak(model: Llama, ids: torch.Tensor, ctx: Any) -> int:
    """Peak saved bytes of one forward and backward of this rank's tokens (``ctx``: the cp context or None)."""
    from merak_core.planner.memory_meter import SavedActivationMeter
    from merak_tp.context import context_parallel, shard_positions

    pos = (
        torch.arange(SEQ) if ctx is None else shard_positions(SEQ, ctx.size, ctx.rank, balanced=ctx.balanced)
    )
    inputs, labels = ids[:, :-1][:, pos], ids[:, 1:][:, pos]
    meter = SavedActivationMeter({0: model})
    with meter.measuring(), context_parallel(ctx):
        logits = model(inputs)
        F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="sum").backward()
    model.zero_grad(set_to_none=True)
    return meter.peak[0]


def _measure_on_rank() -> dict[tuple[str, int], int]:
    """This rank's peak saved bytes per (mode, cp)."""
    from merak_tp.context import ContextParallel

    rank = dist.get_rank()
    groups = {4: dist.group.WORLD}
    for members in ([0, 1], [2, 3]):  # every rank creates every group, in the same order
        group = dist.new_group(members)
        if rank in members:
            groups[2] = group
    model, ids = _model(), _ids()
    out: dict[tuple[str, int], int] = {}
    for mode in ("ring", "ulysses"):
        for cp in CPS:
            ctx = None if cp == 1 else ContextParallel(groups[cp], mode)
            out[mode, cp] = _step_peak(model, ids, ctx)
    return out


def _predicted_activation_bytes(mode: str, cp: int) -> float:
    profile = profile_model(_model(), _ids()[:, :-1], repeats=1)
    local = cp_local_profile(profile, cp, mode)
    (stage,) = predict_stage_memory(
        local, stage_layers=[LAYERS], schedule="1f1b", num_microbatches=1, micro_batch_size=BATCH
    )
    return stage.activation_bytes


def test_activation_bytes_fall_with_cp_and_match_the_memory_model() -> None:
    per_rank = run_on_ranks(4, _measure_on_rank)
    whole = per_rank[0]["ring", 1]
    assert all(r[mode, 1] == whole for r in per_rank for mode in ("ring", "ulysses"))  # cp=1: one process
    for mode in ("ring", "ulysses"):
        for cp in CPS[1:]:
            worst = max(r[mode, cp] for r in per_rank)
            ratio = worst / (whole / cp)  # 1.0: exactly 1/cp of the one-process bytes
            assert abs(ratio - 1) <= TOLERANCE, (mode, cp, worst, whole, ratio)
            predicted = _predicted_activation_bytes(mode, cp)
            error = (predicted - worst) / worst
            assert abs(error) <= MEMORY_MARGIN, (mode, cp, predicted, worst, error)
    predicted_whole = _predicted_activation_bytes("ring", 1)
    assert abs(predicted_whole - whole) / whole <= MEMORY_MARGIN
