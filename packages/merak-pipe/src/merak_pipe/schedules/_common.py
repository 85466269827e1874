"""Helpers shared by the schedule generators (private)."""

from __future__ import annotations

from merak_pipe.ir import Action, ActionKind

F = ActionKind.FORWARD
B = ActionKind.FULL_BACKWARD
I = ActionKind.BACKWARD_INPUT  # noqa: E741 - the IR's name for input-gradient backward
W = ActionKind.BACKWARD_WEIGHT
R = ActionKind.RECOMPUTE


def one_stage_per_rank(name: str, num_stages: int, num_ranks: int | None) -> tuple[int, ...]:
    """stage_to_rank for schedules that put exactly one stage on each rank."""
    if num_ranks is not None and num_ranks != num_stages:
        raise ValueError(
            f"schedule {name!r} puts one stage on each rank: num_ranks={num_ranks} must equal "
            f"num_stages={num_stages}; use 'interleaved-1f1b' for several stages per rank"
        )
    return tuple(range(num_stages))


def one_f_one_b_order(stage: int, num_stages: int, num_microbatches: int) -> list[tuple[str, int]]:
    """The 1F1B order of one stage as ("F"|"B", microbatch) pairs.

    Stage i runs min(S - 1 - i, M) warm-up forwards, then alternates one forward and one
    backward, then drains the remaining backwards; it holds at most min(S - i, M) microbatches.
    """
    warmup = min(num_stages - 1 - stage, num_microbatches)
    order: list[tuple[str, int]] = [("F", m) for m in range(warmup)]
    for k in range(num_microbatches - warmup):
        order.append(("F", warmup + k))
        order.append(("B", k))
    order.extend(("B", k) for k in range(num_microbatches - warmup, num_microbatches))
    return order


def act(stage: int, kind: ActionKind, microbatch: int) -> Action:
    return Action(stage, kind, microbatch)
