"""The planner: choose the (dp, tp, pp) layout, schedule, microbatches and recomputation from a cost model.

A :class:`ModelProfile` holds per-layer costs for one sample (forward and backward seconds,
activation bytes, parameter bytes) plus what constrains tensor parallelism (heads, kv heads,
vocabulary). :func:`profile_model` measures one on the local device by running the model once
(forward times and saved-activation bytes per layer through hooks); profiles are cached as JSON
keyed by a model fingerprint and the device. A :class:`CommModel` prices point-to-point messages
and all-reduces (ring formula); its defaults are assumptions, :func:`measure_comm` measures one
with the real collectives of a process group, and
:func:`~merak_core.planner.action_cost.measure_action_cost` the pipeline runtime's own seconds per action.

:func:`plan` enumerates every layout with dp * tp * pp = world_size, every microbatch count that
divides the per-replica batch, every schedule the Trainer runs and recompute none / full /
stage_aware; it predicts the step time with :func:`merak_pipe.simulate` (stage costs scaled by
1 / tp plus TP all-reduces, then the DP gradient all-reduce of the slowest stage) and the
per-stage peak memory (weights + gradients + optimizer states, divided by dp under ZeRO-1, plus
the simulated activation peak), drops what does not fit and ranks the rest.

[Note: planner model limits] Layers are split contiguously to balance forward time; TP divides
every layer's compute, activations and parameters by tp and adds two all-reduces of the layer's
output per layer in forward and two in backward; the DP all-reduce is not overlapped with the
pipeline. Backward time is measured as a whole and spread over layers in proportion to forward.

Pure (no process group, no run): may import ``merak_core.parallel`` and the folders below
``run``; never ``run``, :mod:`merak_core.autoplan` (what runs on the ranks) or the Trainer.
"""

from merak_core.planner.candidate import Candidate, format_plan, why_best
from merak_core.planner.choices import PLANNER_SCHEDULES, RECOMPUTE_MODES
from merak_core.planner.comm import CommModel, measure_comm
from merak_core.planner.contention import measure_contention
from merak_core.planner.feedback import (
    MeasuredStep,
    PlanComparison,
    PlanContext,
    Replan,
    compare,
    correct_profile,
    needs_replan,
    predict_current,
    replan,
)
from merak_core.planner.model_profile import ModelProfile
from merak_core.planner.pricing import split_layers
from merak_core.planner.profile import model_fingerprint, profile_model
from merak_core.planner.search import plan, predict

__all__ = [
    "PLANNER_SCHEDULES",
    "RECOMPUTE_MODES",
    "Candidate",
    "CommModel",
    "MeasuredStep",
    "ModelProfile",
    "PlanComparison",
    "PlanContext",
    "Replan",
    "compare",
    "correct_profile",
    "format_plan",
    "measure_comm",
    "measure_contention",
    "model_fingerprint",
    "needs_replan",
    "plan",
    "predict",
    "predict_current",
    "profile_model",
    "replan",
    "split_layers",
    "why_best",
]
