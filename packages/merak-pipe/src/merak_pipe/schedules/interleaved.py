"""Interleaved 1F1B (Megatron-LM's virtual pipeline): v stages per rank, stage s on rank s % P.

Microbatches go in ``max(1, M // P)`` rounds. When M is a multiple of the number of rounds they
are equal, as in torch.distributed.pipelining's "flexible" interleaved schedule (and the order is
the same as torch's); otherwise the first ``M % rounds`` rounds take one microbatch more, so any
M works. Within a round a rank runs every microbatch of the round through one local stage before
the next (forwards in ascending stage order, backwards in descending order). A rank runs
``(v - 1) * g + 2 * (P - 1 - rank)`` warm-up forwards (g: the first round's size, capped at v * M),
then alternates one forward and one backward, then drains the backwards.
"""

from __future__ import annotations

from merak_pipe.ir import Action, RecomputePlan, Schedule
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
    q, rem = divmod(M, rounds)
    sizes = [q + 1] * rem + [q] * (rounds - rem)
    forward_order: list[tuple[int, int]] = []  # (local stage, microbatch) in a rank's forward order
    backward_order: list[tuple[int, int]] = []
    first = 0
    for size in sizes:
        for local in range(v):
            forward_order += [(local, m) for m in range(first, first + size)]
        for local in reversed(range(v)):
            backward_order += [(local, m) for m in range(first, first + size)]
        first += size
    total = v * M
    actions: dict[int, list[Action]] = {}
    for rank in range(P):
        warmup = min((v - 1) * sizes[0] + 2 * (P - 1 - rank), total)
        ops = [Action(local * P + rank, F, m) for local, m in forward_order[:warmup]]
        for k in range(total - warmup):
            local, m = forward_order[warmup + k]
            ops.append(Action(local * P + rank, F, m))
            local, m = backward_order[k]
            ops.append(Action(local * P + rank, B, m))
        ops += [Action(local * P + rank, B, m) for local, m in backward_order[total - warmup :]]
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
