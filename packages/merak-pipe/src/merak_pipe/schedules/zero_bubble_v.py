"""ZB-V (zero-bubble "V" schedule): two stages per rank placed in a V, backward split into I and W.

With P ranks there are S = 2P stages; stage s sits on rank ``s`` for ``s < P`` and on rank
``2P - 1 - s`` otherwise, so rank 0 holds the first and the last stage (a tied embedding is one
local parameter there) and the middle two stages share rank P - 1 (their hand-over needs no
message). The order comes from a list schedule with unit costs (F = I = W = 1): at each tick a
free rank runs, in this priority, a ready ``I`` (the gradient wave is the critical path), a ready
``F`` (the later stage first, so microbatches reach the loss early), otherwise a pending ``W``
(weight gradients fill what would be bubbles). Forwards of the first leg (stages below P) wait
while the rank holds ``2P`` microbatch-stages of activations (forward done, ``W`` not done): the
memory of 1F1B's first stage, whose stage holds both halves of the rank's layers. Forwards of the
second leg are never held back, so the last stage can always start a backward (no deadlock).
Qi et al., "Pipeline Parallelism with Controllable Memory" / "Zero Bubble Pipeline Parallelism".

Not done here: the paper's half-memory variants (ZB-V with less than 1F1B's memory).
"""

from __future__ import annotations

from merak_pipe.ir import Action, RecomputePlan, Schedule
from merak_pipe.schedules._common import F, I, W

__all__ = ["zb_v", "v_stage_to_rank"]


def v_stage_to_rank(num_ranks: int) -> tuple[int, ...]:
    """The V placement of ``2 * num_ranks`` stages: stage s on rank ``min(s, 2P - 1 - s)``."""
    return tuple(min(s, 2 * num_ranks - 1 - s) for s in range(2 * num_ranks))


def _ranks(num_stages: int, num_ranks: int | None, virtual_stages: int | None) -> int:
    if virtual_stages not in (None, 2):
        raise ValueError(
            f"zb-v places exactly 2 stages per rank: virtual_stages={virtual_stages!r}; use 2 "
            "(or interleaved-1f1b for other counts)"
        )
    if num_stages % 2 or num_stages < 2:
        raise ValueError(f"zb-v needs an even num_stages (2 per rank), got {num_stages}")
    if num_ranks is not None and num_ranks * 2 != num_stages:
        raise ValueError(
            f"zb-v: num_stages={num_stages} must be 2 * num_ranks={num_ranks}; give "
            f"num_stages={2 * num_ranks}"
        )
    return num_stages // 2


class _State:
    """Bookkeeping of the list schedule (ticks are unit-cost actions)."""

    def __init__(self, P: int, M: int) -> None:
        self.P, self.M, self.S = P, M, 2 * P
        self.to_rank = v_stage_to_rank(P)
        self.next_f = [0] * self.S
        self.next_i = [0] * self.S
        self.done: dict[tuple[str, int, int], int] = {}  # (kind, stage, m) -> tick it finished
        self.pending_w: list[list[tuple[int, int]]] = [[] for _ in range(P)]
        self.live = [0] * P
        self.actions: dict[int, list[Action]] = {r: [] for r in range(P)}

    def ready(self, key: tuple[str, int, int], tick: int) -> bool:
        return self.done.get(key, tick + 1) <= tick

    def stages(self, rank: int) -> tuple[int, int]:
        return rank, self.S - 1 - rank

    def _reserved(self, rank: int) -> int:
        """Live microbatch-stages plus the second-leg forwards that microbatches already started will add."""
        first, second = self.stages(rank)
        return self.live[rank] + self.next_f[first] - self.next_f[second]

    def pick(self, rank: int, tick: int) -> tuple[str, int, int] | None:
        S, M = self.S, self.M
        for s in sorted(self.stages(rank), reverse=True):  # I: later stage first (the wave's head)
            m = self.next_i[s]
            if m < M and self.ready(("F", s, m), tick) and (s == S - 1 or self.ready(("I", s + 1, m), tick)):
                return ("I", s, m)
        for s in sorted(self.stages(rank), reverse=True):
            m = self.next_f[s]
            if m >= M or not (s == 0 or self.ready(("F", s - 1, m), tick)):
                continue
            if s < self.P and self._reserved(rank) + 2 > 2 * self.P:
                continue
            return ("F", s, m)
        if self.pending_w[rank]:
            s, m = self.pending_w[rank][0]
            return ("W", s, m)
        return None

    def run(self, rank: int, choice: tuple[str, int, int], tick: int) -> None:
        kind, s, m = choice
        if kind == "F":
            self.next_f[s] += 1
            self.live[rank] += 1
            self.actions[rank].append(Action(s, F, m))
        elif kind == "I":
            self.next_i[s] += 1
            self.pending_w[rank].append((s, m))
            self.actions[rank].append(Action(s, I, m))
        else:
            self.pending_w[rank].pop(0)
            self.live[rank] -= 1
            self.actions[rank].append(Action(s, W, m))
        self.done[choice] = tick + 1


def zb_v(
    *,
    num_stages: int,
    num_microbatches: int,
    num_ranks: int | None = None,
    recompute: RecomputePlan | None = None,
    virtual_stages: int | None = None,
) -> Schedule:
    """ZB-V over ``num_stages / 2`` ranks (see the module docstring for the order)."""
    P = _ranks(num_stages, num_ranks, virtual_stages)
    state = _State(P, num_microbatches)
    total = 3 * num_stages * num_microbatches
    tick, count = 0, 0
    while count < total:
        for rank in range(P):
            choice = state.pick(rank, tick)
            if choice is not None:
                state.run(rank, choice, tick)
                count += 1
        tick += 1
        assert tick <= 4 * total + 8, "zb-v list schedule made no progress"  # internal invariant
    return Schedule(
        "zb-v",
        num_stages,
        num_microbatches,
        state.to_rank,
        state.actions,
        recompute=recompute,
        options={"virtual_stages": 2},
    )
