"""Interleaved 1F1B (Megatron-LM's virtual pipeline): v stages per rank, stage s on rank s % P.

Microbatches go in rounds of ``g = M // max(1, M // P)`` (torch.distributed.pipelining's
"flexible" rounds, so M need not be a multiple of P but must be a multiple of the number of
rounds). A rank runs ``(v - 1) * g + 2 * (P - 1 - rank)`` warm-up forwards (capped at v * M), then
alternates one forward and one backward, cycling over its local stages every g operations
(forwards in ascending stage order, backwards in descending order).
"""

from __future__ import annotations

from merak_pipe.ir import Action, Schedule
from merak_pipe.recompute import RecomputePlan
from merak_pipe.schedules._common import B, F

__all__ = ["interleaved_1f1b"]


def _layout(num_stages: int, num_ranks: int | None, virtual_stages: int | None) -> tuple[int, int]:
    if num_ranks is None and virtual_stages is None:
        raise ValueError(
            "interleaved-1f1b needs num_ranks=P or virtual_stages=v (num_stages = P * v); got neither"
        )
    if num_ranks is not None:
        if num_stages % num_ranks != 0:
            raise ValueError(
                f"interleaved-1f1b: num_stages={num_stages} is not a multiple of num_ranks={num_ranks}; "
                "every rank must hold the same number of stages"
            )
        v = num_stages // num_ranks
        if virtual_stages is not None and virtual_stages != v:
            raise ValueError(
                f"interleaved-1f1b: virtual_stages={virtual_stages} but num_stages / num_ranks = {v}; "
                "give one of them or make them agree"
            )
        return num_ranks, v
    assert virtual_stages is not None
    if not isinstance(virtual_stages, int) or virtual_stages < 1 or num_stages % virtual_stages != 0:
        raise ValueError(
            f"interleaved-1f1b: virtual_stages={virtual_stages!r} must be an int >= 1 dividing "
            f"num_stages={num_stages}"
        )
    return num_stages // virtual_stages, virtual_stages


def interleaved_1f1b(
    *,
    num_stages: int,
    num_microbatches: int,
    num_ranks: int | None = None,
    recompute: RecomputePlan | None = None,
    virtual_stages: int | None = None,
) -> Schedule:
    """Interleaved 1F1B over ``num_ranks`` ranks with ``num_stages / num_ranks`` stages each."""
    P, v = _layout(num_stages, num_ranks, virtual_stages)
    M = num_microbatches
    rounds = max(1, M // P)
    if M % rounds != 0:
        candidates = [m for m in range(max(1, M - P), M + P + 1) if m % max(1, m // P) == 0]
        raise ValueError(
            f"interleaved-1f1b: num_microbatches={M} is not a multiple of the number of rounds "
            f"max(1, M // P)={rounds} (P={P} ranks); use for example one of {candidates}"
        )
    group = M // rounds
    total = v * M
    actions: dict[int, list[Action]] = {}
    for rank in range(P):
        warmup = min((v - 1) * group + 2 * (P - 1 - rank), total)
        fwd_mb = [0] * v
        bwd_mb = [0] * v
        ops: list[Action] = []

        def forward(k: int, rank: int = rank, fwd_mb: list[int] = fwd_mb, ops: list[Action] = ops) -> None:
            local = (k // group) % v
            ops.append(Action(local * P + rank, F, fwd_mb[local]))
            fwd_mb[local] += 1

        def backward(k: int, rank: int = rank, bwd_mb: list[int] = bwd_mb, ops: list[Action] = ops) -> None:
            local = v - 1 - (k // group) % v
            ops.append(Action(local * P + rank, B, bwd_mb[local]))
            bwd_mb[local] += 1

        for k in range(warmup):
            forward(k)
        for k in range(total - warmup):
            forward(warmup + k)
            backward(k)
        for k in range(total - warmup, total):
            backward(k)
        actions[rank] = ops
    stage_to_rank = tuple(s % P for s in range(num_stages))
    return Schedule(
        "interleaved-1f1b",
        num_stages,
        M,
        stage_to_rank,
        actions,
        recompute=recompute,
        options={"virtual_stages": v},
    )
