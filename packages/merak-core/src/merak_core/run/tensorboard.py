"""TensorBoard event files of a run, when the ``tensorboard`` package is installed (the ``tensorboard`` extra).

Events go to ``output_dir/tensorboard`` through ``torch.utils.tensorboard.SummaryWriter``.
Training records are written under ``train/<key>`` (``train/loss``, ``train/lr``,
``train/grad_norm``, ``train/tokens_per_s``, ``train/step_time_s``), evaluation records under
``eval/<name>`` (``eval_loss`` becomes ``eval/loss``). A resumed run opens the writer with
``purge_step`` one past the resumed step, so TensorBoard hides what the interrupted segment
logged after the checkpoint, as ``metrics.jsonl`` drops it (one curve per run).

Without the package nothing is written and :func:`open_writer` returns None; the run says so once
at its start (``training.report_to``, :mod:`merak_core.run.reporting`).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger(__name__)

SUBDIR = "tensorboard"


def available() -> bool:
    """Whether ``torch.utils.tensorboard`` can write events (the ``tensorboard`` package is installed)."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        return False
    return True


def open_writer(output_dir: str, *, resumed_step: int = 0) -> Any:
    """A ``SummaryWriter`` on ``output_dir/tensorboard`` (None without the ``tensorboard`` package)."""
    if not available():
        logger.info(
            "tensorboard is not installed (pip install 'merak-core[tensorboard]'): no TensorBoard events"
        )
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(
        os.path.join(output_dir, SUBDIR), purge_step=resumed_step + 1 if resumed_step else None
    )


def tag(key: str, *, evaluation: bool) -> str:
    """The TensorBoard tag of a record key (``loss`` -> ``train/loss``, ``eval_loss`` -> ``eval/loss``)."""
    if evaluation:
        return "eval/" + (key[len("eval_") :] if key.startswith("eval_") else key)
    return f"train/{key}"


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The scalars of a record by tag: every number (not ``step``, flags or None); non-finite ones only for a loss.

    What every reporter of ``training.report_to`` logs at ``record["step"]`` (:mod:`merak_core.run.reporting`).
    """
    evaluation = "loss" not in record
    out = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(value) or key.endswith("loss"):
            out[tag(key, evaluation=evaluation)] = float(value)
    return out


def write_record(writer: Any, record: Mapping[str, Any]) -> None:
    """:func:`scalars` of ``record`` as TensorBoard scalars at ``record["step"]``."""
    step = int(record.get("step", 0))
    for key, value in scalars(record).items():
        writer.add_scalar(key, value, step)


__all__ = ["SUBDIR", "available", "open_writer", "scalars", "tag", "write_record"]
