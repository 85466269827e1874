"""merak_pipe: pipeline schedules as data, recomputation plans, a simulator, and a pipeline runtime.

Pure parts (no process group needed): the schedule IR (:mod:`merak_pipe.ir`), schedule
generators behind :func:`build_schedule`, recomputation plans, lowering and validation, the
discrete-event simulator, trace export and CSV import/export. The runtime that executes a
schedule over torch.distributed lives in ``stage.py`` / ``runner.py``.
"""

from __future__ import annotations

from merak_pipe.csv_io import from_csv, to_csv
from merak_pipe.ir import Action, ActionKind, Schedule, ScheduleError, format_table
from merak_pipe.lowering import lower, strip_comms
from merak_pipe.recompute import RecomputePlan, closed_form_plan, in_flight_counts, stage_aware_plan
from merak_pipe.schedules import available_schedules, build_schedule, register_schedule
from merak_pipe.sim import CostModel, SimResult, TimedAction, simulate
from merak_pipe.trace import chrome_trace, plot_timeline
from merak_pipe.validate import validate

__version__ = "0.1.0"

__all__ = [
    "Action",
    "ActionKind",
    "CostModel",
    "RecomputePlan",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "TimedAction",
    "__version__",
    "available_schedules",
    "build_schedule",
    "chrome_trace",
    "closed_form_plan",
    "format_table",
    "from_csv",
    "in_flight_counts",
    "lower",
    "plot_timeline",
    "register_schedule",
    "simulate",
    "stage_aware_plan",
    "strip_comms",
    "to_csv",
    "validate",
]

# --- runtime block -------------------------------------------------------------------------
# Owned by the "runtime" engineer: they may edit this block freely (add names to the list).
from merak_pipe.comm import PipelineCommError, PipelineTimeoutError  # noqa: E402
from merak_pipe.runner import PipelineRunner  # noqa: E402
from merak_pipe.shared import shared_parameter_groups, shared_parameters_list  # noqa: E402
from merak_pipe.stage import PipelineStage  # noqa: E402
from merak_pipe.timing import (  # noqa: E402
    ActionTiming,
    gather_timings,
    measured_chrome_trace,
    measured_costs,
    measured_step_time,
)

__all__ += [
    "ActionTiming",
    "PipelineCommError",
    "PipelineRunner",
    "PipelineStage",
    "PipelineTimeoutError",
    "gather_timings",
    "measured_chrome_trace",
    "measured_costs",
    "measured_step_time",
    "shared_parameter_groups",
    "shared_parameters_list",
]
# --- end of runtime block ------------------------------------------------------------------
