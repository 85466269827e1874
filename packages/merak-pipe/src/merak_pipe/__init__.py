"""merak_pipe: pipeline schedules as data, recomputation plans, a simulator, and a pipeline runtime.

Pure parts (no process group needed): the schedule IR (:mod:`merak_pipe.ir`), schedule
generators behind :func:`build_schedule`, recomputation plans, lowering and validation, the
discrete-event simulator, trace export and CSV import/export. The runtime that executes a
schedule over torch.distributed lives in ``stage.py`` / ``runner.py``.
"""

from __future__ import annotations

from merak_pipe.action_profile import ActionProfile, ProfiledSpan, gather_spans
from merak_pipe.comm import PipelineCommError, PipelineTimeoutError
from merak_pipe.csv_io import from_csv, to_csv
from merak_pipe.ir import Action, ActionKind, RecomputePlan, Schedule, ScheduleError, format_table
from merak_pipe.lowering import lower, strip_comms
from merak_pipe.recompute import closed_form_plan, in_flight_counts, stage_aware_plan
from merak_pipe.runner import PipelineRunner
from merak_pipe.schedules import (
    ScheduleInfo,
    available_schedules,
    build_schedule,
    register_schedule,
    schedule_info,
    schedule_infos,
)
from merak_pipe.schedules.decode import decode_action_runs, decode_schedule
from merak_pipe.shared import shared_parameter_groups, shared_parameters_list
from merak_pipe.sim import CostModel, SimResult, TimedAction, simulate
from merak_pipe.stage import PipelineStage
from merak_pipe.timing import (
    ActionTiming,
    gather_timings,
    measured_chrome_trace,
    measured_costs,
    measured_step_time,
)
from merak_pipe.trace import chrome_trace, plot_timeline
from merak_pipe.validate import validate

__version__ = "0.1.0"

__all__ = [
    "Action",
    "ActionKind",
    "ActionProfile",
    "ActionTiming",
    "CostModel",
    "PipelineCommError",
    "PipelineRunner",
    "PipelineStage",
    "PipelineTimeoutError",
    "ProfiledSpan",
    "RecomputePlan",
    "Schedule",
    "ScheduleError",
    "ScheduleInfo",
    "SimResult",
    "TimedAction",
    "__version__",
    "available_schedules",
    "build_schedule",
    "chrome_trace",
    "closed_form_plan",
    "decode_action_runs",
    "decode_schedule",
    "format_table",
    "from_csv",
    "gather_spans",
    "gather_timings",
    "in_flight_counts",
    "lower",
    "measured_chrome_trace",
    "measured_costs",
    "measured_step_time",
    "plot_timeline",
    "register_schedule",
    "schedule_info",
    "schedule_infos",
    "shared_parameter_groups",
    "shared_parameters_list",
    "simulate",
    "stage_aware_plan",
    "strip_comms",
    "to_csv",
    "validate",
]
