"""Recomputation plans: which fraction of each stage's layers recomputes its activations.

A :class:`RecomputePlan` holds, per stage, a fraction in [0, 1]: 0.0 keeps every activation,
1.0 checkpoints the whole stage (only its input is kept and the forward is run again before
the backward). The runtime checkpoints the first ``round(f * num_units)`` units of a stage
(an ``nn.Sequential`` stage is a chain of units; any other module is one unit).

Plans are built by :meth:`RecomputePlan.none`, :meth:`RecomputePlan.full`,
:meth:`RecomputePlan.uniform`, :func:`closed_form_plan` (Merak's ``(1 - r_i)(S - 1 - i) = const``)
and :func:`stage_aware_plan` (the smallest fraction per stage that fits a memory budget).
This module does not measure anything: sizes are inputs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["RecomputePlan", "as_plan"]


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


def as_plan(recompute: RecomputePlan | str | float | None, num_stages: int) -> RecomputePlan | None:
    """Normalise the ``recompute=`` argument of :func:`merak_pipe.build_schedule`.

    Accepts None, a :class:`RecomputePlan`, ``"none"``, ``"full"``, or a float (uniform fraction).
    """
    if recompute is None or isinstance(recompute, RecomputePlan):
        if recompute is not None and recompute.num_stages != num_stages:
            raise ValueError(
                f"recompute plan covers {recompute.num_stages} stages but num_stages={num_stages}; "
                "build the plan for this pipeline"
            )
        return recompute
    if isinstance(recompute, str):
        if recompute == "none":
            return RecomputePlan.none(num_stages)
        if recompute == "full":
            return RecomputePlan.full(num_stages)
        raise ValueError(
            f"recompute={recompute!r}; expected 'none', 'full', a float in [0, 1] or a RecomputePlan"
        )
    if isinstance(recompute, (int, float)) and not isinstance(recompute, bool):
        return RecomputePlan.uniform(num_stages, float(recompute))
    raise ValueError(
        f"recompute={recompute!r}; expected None, 'none', 'full', a float in [0, 1] or a RecomputePlan"
    )
