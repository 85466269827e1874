"""The schedule IR: actions, per-rank action lists, and the table that prints them.

An :class:`Action` is ``(stage, kind, microbatch)`` with the compact string form of
``torch.distributed.pipelining``'s ``_Action`` (``"1F3"`` = stage 1, forward, microbatch 3;
``"2SEND_B0"``; ``"0RECV_F5"``), and the decode step in decode schedules (``"0F3@2"``). A
:class:`Schedule` maps each pipeline rank to its ordered list of actions, plus the stage-to-rank
map (several stages per rank for interleaved schedules) and an optional :class:`RecomputePlan` (per-stage recompute fractions, data like the rest;
plans are computed by :mod:`merak_pipe.recompute`).

This module holds data only. Generating (``merak_pipe.schedules``), lowering and validating
(``merak_pipe.lowering`` / ``merak_pipe.validate``), simulating (``merak_pipe.sim``) and running
(the runtime) are separate steps that consume it.

[Note: recompute actions]
An ``R`` action means "recompute the forward of this stage for this microbatch now: its input
was kept, its internals were not", so that the coming ``B``/``I`` finds the activations ready.
A schedule with a recompute plan but without ``R`` actions means "recompute inside the
backward" (``torch.utils.checkpoint`` style).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum

__all__ = ["Action", "ActionKind", "RecomputePlan", "Schedule", "ScheduleError", "format_table"]


class ActionKind(str, Enum):
    """What an action does. Values are torch.distributed.pipelining's computation-type strings."""

    FORWARD = "F"
    FULL_BACKWARD = "B"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    RECOMPUTE = "R"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    SEND_T = "SEND_T"
    RECV_T = "RECV_T"

    @property
    def is_compute(self) -> bool:
        """True for F, B, I, W and R (actions that run the stage's module)."""
        return self in _COMPUTE_KINDS

    @property
    def is_comm(self) -> bool:
        """True for the send/recv kinds added by lowering."""
        return not self.is_compute

    @property
    def is_backward(self) -> bool:
        """True for B and I: the actions that consume the output gradient and produce the input one."""
        return self in (ActionKind.FULL_BACKWARD, ActionKind.BACKWARD_INPUT)

    def __str__(self) -> str:
        return self.value


_COMPUTE_KINDS = frozenset(
    {
        ActionKind.FORWARD,
        ActionKind.FULL_BACKWARD,
        ActionKind.BACKWARD_INPUT,
        ActionKind.BACKWARD_WEIGHT,
        ActionKind.RECOMPUTE,
    }
)
# Longest kinds first so "SEND_F" is not read as something shorter.
_KIND_PATTERN = "|".join(sorted((re.escape(k.value) for k in ActionKind), key=len, reverse=True))
_ACTION_RE = re.compile(rf"^\s*(\d+)({_KIND_PATTERN})(\d+)(?:@(\d+))?\s*$")


@dataclass(frozen=True)
class Action:
    """One step of a schedule: ``stage`` runs ``kind`` for ``microbatch`` (of decode step ``step``).

    For send/recv kinds, ``stage`` is the stage on *this* rank that sends or receives:
    ``SEND_F`` is sent by the producing stage, ``RECV_F`` is received by the consuming stage
    (``stage + 1``), ``SEND_B`` by the stage whose input gradient it is, ``RECV_B`` by
    ``stage - 1``; this is torch.distributed.pipelining's convention. ``SEND_T`` / ``RECV_T``
    carry a decode step's tokens from the last stage (which sends) back to the first (which
    receives) ([Note: decode schedules] in ``merak_pipe.schedules.decode``).

    ``step`` is the decode step of a multi-step decode schedule (0 in training schedules); the
    compact form writes it after ``@`` when it is not 0 (``"0F3@2"``).
    """

    stage: int
    kind: ActionKind
    microbatch: int
    step: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ActionKind):
            object.__setattr__(self, "kind", ActionKind(self.kind))
        if self.stage < 0 or self.microbatch < 0 or self.step < 0:
            raise ValueError(
                f"Action({self.stage}, {self.kind.value}, {self.microbatch}, step={self.step}): stage, "
                "microbatch and step must be >= 0; pass 0-based indices"
            )

    def __str__(self) -> str:
        text = f"{self.stage}{self.kind.value}{self.microbatch}"
        return f"{text}@{self.step}" if self.step else text

    def __repr__(self) -> str:
        return f"Action({self})"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse the compact form, e.g. ``"1F3"``, ``"2SEND_B0"``; raises ValueError otherwise."""
        match = _ACTION_RE.match(text)
        if match is None:
            kinds = ", ".join(k.value for k in ActionKind)
            raise ValueError(
                f"cannot parse action {text!r}: expected <stage><kind><microbatch>[@<step>] such as '1F3', "
                f"'2SEND_B0' or '0F1@4', with kind one of {kinds}"
            )
        stage, kind, microbatch, step = match.groups()
        return cls(int(stage), ActionKind(kind), int(microbatch), int(step or 0))


@dataclass(frozen=True)
class RecomputePlan:
    """Per-stage recompute fractions (0.0 = keep all activations, 1.0 = recompute everything)."""

    fractions: tuple[float, ...]

    def __post_init__(self) -> None:
        fractions = tuple(float(f) for f in self.fractions)
        object.__setattr__(self, "fractions", fractions)
        if not fractions:
            raise ValueError("RecomputePlan.fractions is empty; give one fraction per stage")
        for stage, fraction in enumerate(fractions):
            if not (0.0 <= fraction <= 1.0) or math.isnan(fraction):
                raise ValueError(
                    f"recompute fraction of stage {stage} is {fraction}; expected a value in [0, 1] "
                    "(0 keeps all activations, 1 recomputes the whole stage)"
                )

    @property
    def num_stages(self) -> int:
        """Number of stages the plan covers."""
        return len(self.fractions)

    def __getitem__(self, stage: int) -> float:
        return self.fractions[stage]

    @property
    def total(self) -> float:
        """Sum of the fractions (a simple "how much is recomputed" measure)."""
        return sum(self.fractions)

    @classmethod
    def none(cls, num_stages: int) -> RecomputePlan:
        """Keep every activation on every stage."""
        return cls((0.0,) * _check_stages(num_stages))

    @classmethod
    def full(cls, num_stages: int) -> RecomputePlan:
        """Recompute every stage completely."""
        return cls((1.0,) * _check_stages(num_stages))

    @classmethod
    def uniform(cls, num_stages: int, fraction: float) -> RecomputePlan:
        """The same fraction on every stage."""
        return cls((float(fraction),) * _check_stages(num_stages))

    @classmethod
    def from_list(cls, fractions: Sequence[float]) -> RecomputePlan:
        """A plan from any sequence of fractions."""
        return cls(tuple(float(f) for f in fractions))


def _check_stages(num_stages: int) -> int:
    if num_stages < 1:
        raise ValueError(f"num_stages={num_stages}; expected >= 1")
    return num_stages


class ScheduleError(ValueError):
    """A schedule is invalid. The message holds the per-rank table with the bad step marked."""

    def __init__(self, message: str, *, rank: int | None = None, step: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.step = step


@dataclass
class Schedule:
    """Per-rank ordered action lists for one training step of a pipeline.

    ``actions[rank]`` is the order in which pipeline rank ``rank`` runs its actions.
    ``stage_to_rank[stage]`` is the pipeline rank that holds ``stage``.
    ``lowered`` is True once send/recv actions have been added (``merak_pipe.lower``).
    ``recompute`` says which fraction of each stage's layers is recomputed (None: nothing is).
    """

    name: str
    num_stages: int
    num_microbatches: int
    stage_to_rank: tuple[int, ...]
    actions: dict[int, list[Action]]
    lowered: bool = False
    recompute: RecomputePlan | None = None
    options: dict[str, object] = field(default_factory=dict)
    """Generator options this schedule was built with (informational, e.g. ``{"virtual_stages": 2}``)."""
    num_steps: int | None = None
    """None for a training schedule (one round, forwards and backwards); for a forward-only decode
    schedule (:func:`merak_pipe.decode_schedule`), its number of decode steps: each microbatch runs
    step ``t + 1`` after the tokens of its step ``t`` came back to the first stage."""

    def __post_init__(self) -> None:
        self.stage_to_rank = tuple(int(r) for r in self.stage_to_rank)
        if len(self.stage_to_rank) != self.num_stages:
            raise ValueError(
                f"stage_to_rank has {len(self.stage_to_rank)} entries but num_stages={self.num_stages}; "
                "give exactly one rank per stage"
            )
        if self.num_steps is not None and self.num_steps < 1:
            raise ValueError(f"num_steps={self.num_steps}: a decode schedule needs at least one step")
        if self.num_stages < 1 or self.num_microbatches < 1:
            raise ValueError(
                f"num_stages={self.num_stages}, num_microbatches={self.num_microbatches}: both must be >= 1"
            )
        ranks = set(self.stage_to_rank)
        if ranks != set(range(len(ranks))):
            raise ValueError(
                f"stage_to_rank={self.stage_to_rank} must use every rank 0..num_ranks-1; renumber ranks"
            )
        for rank in range(len(ranks)):
            self.actions.setdefault(rank, [])
        extra = set(self.actions) - ranks
        if extra:
            raise ValueError(
                f"actions given for ranks {sorted(extra)} that hold no stage (stage_to_rank={self.stage_to_rank})"
            )
        if self.recompute is not None and self.recompute.num_stages != self.num_stages:
            raise ValueError(
                f"recompute plan has {self.recompute.num_stages} stages, schedule has {self.num_stages}; "
                "build the plan for this schedule's num_stages"
            )

    @property
    def is_decode(self) -> bool:
        """True for a forward-only multi-step decode schedule (``num_steps`` is set)."""
        return self.num_steps is not None

    @property
    def num_ranks(self) -> int:
        """Number of pipeline ranks."""
        return len(set(self.stage_to_rank))

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages held by ``rank``, ascending."""
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

    def rank_of(self, stage: int) -> int:
        """The rank that holds ``stage``."""
        return self.stage_to_rank[stage]

    @property
    def has_recompute_actions(self) -> bool:
        """True when the schedule holds explicit ``R`` actions (see [Note: recompute actions])."""
        return any(a.kind is ActionKind.RECOMPUTE for acts in self.actions.values() for a in acts)

    def compute_actions(self, rank: int) -> list[Action]:
        """``actions[rank]`` without send/recv."""
        return [a for a in self.actions[rank] if a.kind.is_compute]

    def __iter__(self) -> Iterator[tuple[int, Action]]:
        for rank in sorted(self.actions):
            for action in self.actions[rank]:
                yield rank, action

    def __str__(self) -> str:
        return format_table(self)


def format_table(
    schedule: Schedule,
    *,
    mark: tuple[int, int] | None = None,
    ranks: Iterable[int] | None = None,
) -> str:
    """Render ``schedule`` as a table: one column per rank, one row per step.

    ``mark=(rank, step)`` puts ``>>`` before that cell and ``<<`` after it.
    """
    rank_list = sorted(schedule.actions) if ranks is None else list(ranks)
    cells: list[list[str]] = []
    height = max((len(schedule.actions[r]) for r in rank_list), default=0)
    for rank in rank_list:
        column = []
        for step in range(height):
            text = str(schedule.actions[rank][step]) if step < len(schedule.actions[rank]) else ""
            if mark is not None and mark == (rank, step):
                text = f">>{text}<<"
            column.append(text)
        cells.append(column)
    headers = [f"rank {r}" for r in rank_list]
    widths = [max([len(h), *(len(c) for c in col)]) for h, col in zip(headers, cells, strict=True)]
    header = (
        f"{schedule.name}: {schedule.num_stages} stages, {schedule.num_microbatches} microbatches, "
        f"stage_to_rank={list(schedule.stage_to_rank)}"
        + (f", {schedule.num_steps} decode steps" if schedule.num_steps is not None else "")
    )
    lines = [header, "step | " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("-" * len(lines[-1]))
    for step in range(height):
        row = " | ".join(col[step].ljust(w) for col, w in zip(cells, widths, strict=True))
        lines.append(f"{step:4d} | {row}")
    return "\n".join(line.rstrip() for line in lines)
