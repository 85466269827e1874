"""Where the TP probe used to live: :mod:`merak_core.planner.probe` (re-exported here under the old name)."""

from merak_core.planner.probe import ProbeResult, measure_tp_scale

__all__ = ["ProbeResult", "measure_tp_scale"]
