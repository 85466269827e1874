"""``training.report_to``: where a run's scalars go besides ``metrics.jsonl`` (TensorBoard, Weights & Biases).

[Note: report_to]
- unset (None, the default): TensorBoard when the ``tensorboard`` package is installed; without it,
  one warning at the start of training saying so (and how to install it or silence it);
- a name or a list of names of :data:`merak_core.config.report_to.REPORT_TO`; ``all``: every one that is installed;
  ``none`` (or ``[]``): neither. Any other value is refused with the arguments, naming the allowed
  ones (a job file: by ``merak train`` before torchrun starts);
- ``wandb`` asked for without the ``wandb`` package is refused the same way (the ``wandb`` extra);
  ``tensorboard`` asked for without its package gets the warning of the default.

Every reporter receives the same scalars, :func:`merak_core.run.tensorboard.scalars` of each record
(``train/loss``, ``train/lr``, ..., ``eval/loss``), from global rank 0 only
(:class:`~merak_core.run.metrics.MetricsWriter` is a no-op elsewhere).

Weights & Biases: ``wandb.init(project=$WANDB_PROJECT or "merak", dir=output_dir, config=the run's
arguments, mode=$WANDB_MODE)``; ``WANDB_MODE=offline`` writes the run under
``output_dir/wandb/offline-run-*`` (``wandb sync`` uploads it later). A resumed job starts a new
W&B run whose steps continue from the checkpoint's step.

Not done here: MLflow; the records themselves (``cadence.py``, ``metrics.py``).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from merak_core.config.report_to import REPORT_TO
from merak_core.run import tensorboard

logger = logging.getLogger(__name__)


class Reporter(Protocol):
    """A sink of a run's records on rank 0."""

    def write(self, record: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def open_reporters(
    output_dir: str,
    report_to: Sequence[str] | None,
    *,
    resumed_step: int = 0,
    config: Mapping[str, Any] | None = None,
) -> list[Reporter]:
    """The reporters of a run (rank 0), opened; ``report_to`` as ``config.report_to.check_report_to`` returns it."""
    names = ["tensorboard"] if report_to is None else list(report_to)
    every = names == ["all"]
    if every:
        names = [n for n in REPORT_TO if n == "tensorboard" or importlib.util.find_spec(n) is not None]
    reporters: list[Reporter] = []
    if "tensorboard" in names:
        if tensorboard.available():
            reporters.append(_TensorBoard(output_dir, resumed_step))
        elif not every:
            logger.warning(
                "TensorBoard is not installed, so this run writes no TensorBoard events: "
                "pip install 'merak-core[tensorboard]', or set training.report_to: none"
            )
    if "wandb" in names:
        reporters.append(_Wandb(output_dir, config))
    return reporters


class _TensorBoard:
    """Event files under ``output_dir/tensorboard`` (:mod:`merak_core.run.tensorboard`)."""

    def __init__(self, output_dir: str, resumed_step: int) -> None:
        self.writer = tensorboard.open_writer(output_dir, resumed_step=resumed_step)

    def write(self, record: Mapping[str, Any]) -> None:
        tensorboard.write_record(self.writer, record)

    def write_text(self, tag: str, text: str, step: int) -> None:
        self.writer.add_text(tag, text, step)

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    """One Weights & Biases run; ``WANDB_MODE`` (``online``, ``offline``, ``disabled``) chooses where it goes."""

    def __init__(self, output_dir: str, config: Mapping[str, Any] | None) -> None:
        import wandb

        mode: Any = os.environ.get("WANDB_MODE") or None  # wandb checks the value (online, offline, disabled)
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or "merak",
            dir=output_dir,
            config=dict(config) if config is not None else None,
            mode=mode,
        )

    def write(self, record: Mapping[str, Any]) -> None:
        values = tensorboard.scalars(record)
        if values:
            self.run.log(values, step=int(record.get("step", 0)))

    def close(self) -> None:
        self.run.finish()


__all__ = ["Reporter", "open_reporters"]
