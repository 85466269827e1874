"""``training.report_to``: where a run's scalars go besides ``metrics.jsonl`` (TensorBoard, W&B, MLflow).

[Note: report_to]
- unset (None, the default): TensorBoard when the ``tensorboard`` package is installed; without it,
  one warning at the start of training saying so (and how to install it or silence it);
- a name or a list of names of :data:`merak_core.config.report_to.REPORT_TO`; ``all``: every one that is installed;
  ``none`` (or ``[]``): neither. Any other value is refused with the arguments, naming the allowed
  ones (a job file: by ``merak train`` before torchrun starts);
- ``wandb`` or ``mlflow`` asked for without its package is refused the same way (the ``wandb`` and
  ``mlflow`` extras); ``tensorboard`` asked for without its package gets the warning of the default.

Every reporter receives the same scalars, :func:`merak_core.run.tensorboard.scalars` of each record
(``train/loss``, ``train/lr``, ..., ``eval/loss``), from global rank 0 only
(:class:`~merak_core.run.metrics.MetricsWriter` is a no-op elsewhere).

Weights & Biases: ``wandb.init(project=$WANDB_PROJECT or "merak", dir=output_dir, config=the run's
arguments, mode=$WANDB_MODE)``; ``WANDB_MODE=offline`` writes the run under
``output_dir/wandb/offline-run-*`` (``wandb sync`` uploads it later). A resumed job starts a new
W&B run whose steps continue from the checkpoint's step.

MLflow (the ``mlflow`` extra: ``mlflow-skinny``, MLflow's tracking client without its server and UI)
through its ``MlflowClient``, no global active run: ``$MLFLOW_TRACKING_URI`` when set (a server, a
database), else MLflow's file store at ``file://<output_dir>/mlruns`` (MLflow 3 accepts a file store
only with ``MLFLOW_ALLOW_FILE_STORE=true``, which is set for this default unless the environment sets
it); the experiment ``$MLFLOW_EXPERIMENT_NAME`` or ``merak``, created when missing; one run per job
start (a resumed job starts a new one whose steps continue from the checkpoint's step, tagged
``merak.resumed_step``) with the run's arguments as its params (once, values cut at 500
characters), the scalars as metrics at each record's step, and ``FINISHED`` at the end. ``mlflow ui
--backend-store-uri <output_dir>/mlruns`` (the full ``mlflow`` package) shows it.

Not done here: the records themselves (``cadence.py``, ``metrics.py``).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
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
    if "mlflow" in names:
        reporters.append(_MLflow(output_dir, config, resumed_step))
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


class _MLflow:
    """One MLflow run through ``MlflowClient`` (see [Note: report_to] for the store and the experiment)."""

    PARAM_CHARS = 500
    """Params are cut to this many characters (every MLflow version's limit is at least this)."""
    BATCH = 100
    """Params per ``log_batch`` call (MLflow's limit)."""

    def __init__(self, output_dir: str, config: Mapping[str, Any] | None, resumed_step: int) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or Path(output_dir, "mlruns").resolve().as_uri()
        if uri.startswith("file:"):  # MLflow 3 refuses its file store without this opt-in
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "merak"
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = (
            experiment.experiment_id if experiment is not None else self.client.create_experiment(name)
        )
        tags = {"merak.output_dir": os.path.abspath(output_dir), "merak.resumed_step": str(resumed_step)}
        self.run_id = self.client.create_run(experiment_id, tags=tags).info.run_id
        params = [Param(str(k), str(v)[: self.PARAM_CHARS]) for k, v in (config or {}).items()]
        for start in range(0, len(params), self.BATCH):
            self.client.log_batch(self.run_id, params=params[start : start + self.BATCH])
        logger.info("MLflow: run %s of experiment %r at %s", self.run_id, name, uri)

    def write(self, record: Mapping[str, Any]) -> None:
        from mlflow.entities import Metric

        step, now = int(record.get("step", 0)), int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in tensorboard.scalars(record).items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id, "FINISHED")


__all__ = ["Reporter", "open_reporters"]
