"""``training.report_to``: the allowed values, the default's TensorBoard and its warning, W&B offline and
MLflow's file store read back.

The W&B tests use the real ``wandb`` package in offline mode (``WANDB_MODE=offline``, no network)
and read the run file it wrote (``output_dir/wandb/offline-run-*/run-*.wandb``: LevelDB-style log
records of W&B's protobuf ``Record``); they are skipped where ``wandb`` is not installed (the
``wandb`` extra; the nox ``tests`` session installs it). The MLflow tests use the real ``mlflow``
client (``mlflow-skinny``, the ``mlflow`` extra) on its file store under ``tmp_path`` and read the
runs back with ``MlflowClient``; skipped without it.
"""

from __future__ import annotations

import json
import logging
import math
import re
import struct
import sys
from pathlib import Path
from typing import Any

import pytest

from merak_core import TrainingArguments
from merak_core.cli.main import main
from merak_core.config.report_to import check_report_to
from merak_core.run import tensorboard
from merak_core.run.metrics import MetricsWriter

REPO = Path(__file__).resolve().parents[2]
RECORDS = [
    *(
        {"step": s, "loss": 2.0 / s, "lr": 1e-3 * s, "grad_norm": 0.5 + s, "skipped": False}
        for s in (1, 2, 3)
    ),
    {"step": 3, "eval_loss": 0.75, "eval_accuracy": 0.5},
    {"step": 4, "loss": float("nan"), "lr": 4e-3, "grad_norm": None, "skipped": True},
]


@pytest.mark.parametrize(
    ("value", "normalised"),
    [
        (None, None),
        ("wandb", ["wandb"]),
        (["tensorboard", "wandb", "wandb"], ["tensorboard", "wandb"]),
        ("MLflow", ["mlflow"]),
        (["tensorboard", "wandb", "mlflow"], ["tensorboard", "wandb", "mlflow"]),
        ("TensorBoard", ["tensorboard"]),
        ("none", []),
        ([], []),
        ("all", ["all"]),
    ],
)
def test_report_to_values(value: Any, normalised: list[str] | None) -> None:
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    assert TrainingArguments(report_to=value).report_to == normalised


@pytest.mark.parametrize(
    "value", ["comet", ["tensorboard", "comet"], ["none", "wandb"], ["all", "tensorboard"]]
)
def test_a_bad_report_to_is_refused_naming_the_allowed_values(value: Any) -> None:
    with pytest.raises(
        ValueError, match=r"report_to=.* is invalid.*expected one of \('tensorboard', 'wandb', 'mlflow'\)"
    ):
        TrainingArguments(report_to=value)


def test_a_bad_report_to_in_a_job_is_refused_before_torchrun(capsys: pytest.CaptureFixture[str]) -> None:
    job = str(REPO / "examples" / "addition" / "config.yaml")
    assert main(["train", job, "training.report_to=[tensorboard,comet]", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        "merak train: error: report_to=['tensorboard', 'comet'] is invalid ('comet' is not"
    ), err
    assert "'all' (every one installed) or 'none'" in err and len(err.splitlines()) == 1, err


def test_wandb_without_its_package_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: find_spec returns None
    with pytest.raises(
        ValueError, match=r"the wandb package is not installed: pip install 'merak-core\[wandb\]'"
    ):
        TrainingArguments(report_to=["tensorboard", "wandb"])
    assert TrainingArguments(report_to="all").report_to == ["all"]  # 'all': whatever is installed


def test_mlflow_without_its_package_is_refused_before_torchrun(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if not installed: find_spec returns None
    message = (
        "report_to names 'mlflow' but the mlflow-skinny package is not installed: pip install "
        "'merak-core[mlflow]', or remove mlflow from report_to"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        TrainingArguments(report_to=["tensorboard", "mlflow"])
    job = str(REPO / "examples" / "addition" / "config.yaml")
    assert main(["train", job, "training.report_to=[tensorboard,mlflow]", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(message) and len(err.splitlines()) == 1, err


def test_tensorboard_is_on_by_default_when_installed(tmp_path: Path) -> None:
    if not tensorboard.available():
        pytest.skip("the tensorboard package is not installed (the default then warns: tested above)")
    writer = MetricsWriter(str(tmp_path), enabled=True)  # report_to unset
    writer.start(4)
    writer.log(RECORDS[0])
    writer.finish()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.parametrize(
    ("report_to", "warned"), [(None, True), (["tensorboard"], True), ([], False), (["all"], False)]
)
def test_without_tensorboard_the_run_says_so_once_at_start(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    report_to: list[str] | None,
    warned: bool,
) -> None:
    monkeypatch.setattr(tensorboard, "available", lambda: False)
    monkeypatch.setitem(sys.modules, "wandb", None)  # 'all' finds nothing else either
    monkeypatch.setitem(sys.modules, "mlflow", None)
    writer = MetricsWriter(str(tmp_path), enabled=True, report_to=report_to)
    with caplog.at_level(logging.WARNING, logger="merak_core.run.reporting"):
        writer.start(4)
        for record in RECORDS:
            writer.log(record)
        writer.finish()
    lines = [r.getMessage() for r in caplog.records if r.name == "merak_core.run.reporting"]
    assert lines == (
        [
            "TensorBoard is not installed, so this run writes no TensorBoard events: "
            "pip install 'merak-core[tensorboard]', or set training.report_to: none"
        ]
        if warned
        else []
    )
    assert not (tmp_path / "tensorboard").exists() and (tmp_path / "metrics.jsonl").exists()


@pytest.fixture
def wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    # A fresh wandb service per test: it reads the WANDB_* variables set below when it starts.
    pytest.importorskip("wandb").teardown()
    home = tmp_path / "wandb_home"
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "merak-test")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(home / name.lower()))
    return tmp_path / "out"


def _wandb_history(output_dir: Path) -> tuple[dict[int, dict[str, float]], dict[str, Any]]:
    """Per step, the scalars of the one offline W&B run under ``output_dir``, and its config."""
    import wandb
    from wandb.proto import wandb_internal_pb2

    # The run's records reach its file through wandb's service process; ending the service waits for
    # it to write everything (on the loaded CI machine the file could be read before it had).
    wandb.teardown()
    runs = list((output_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs
    data, records, pos, chunk = runs[0].read_bytes(), [], 7, b""  # 7: the file's header (":W&B", version)
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            records.append(record)
            chunk = b""
    history: dict[int, dict[str, float]] = {}
    config: dict[str, Any] = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            history.setdefault(int(items["_step"]), {}).update(
                {k: float(v) for k, v in items.items() if not k.startswith("_")}
            )
        if record.WhichOneof("record_type") == "run":
            config = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.run.config.update
            }
    return history, config


def test_wandb_offline_receives_the_scalars_tensorboard_gets(wandb_offline: Path) -> None:
    writer = MetricsWriter(
        str(wandb_offline),
        enabled=True,
        report_to=["tensorboard", "wandb"],
        run_config={"learning_rate": 1e-3},
    )
    writer.start(4)
    for record in RECORDS:
        writer.log(record)
    writer.finish()

    expected: dict[int, dict[str, float]] = {}
    for record in RECORDS:
        expected.setdefault(record["step"], {}).update(tensorboard.scalars(record))
    history, config = _wandb_history(wandb_offline)
    assert history.keys() == expected.keys()
    for step, values in expected.items():
        got = history[step]
        assert got.keys() == values.keys(), (step, got)
        assert all(got[k] == v or (v != v and got[k] != got[k]) for k, v in values.items()), (
            step,
            got,
            values,
        )
    assert history[3]["eval/accuracy"] == 0.5 and history[1]["train/loss"] == 2.0
    assert config["learning_rate"] == 1e-3, config  # the run's arguments, as W&B's config
    assert list((wandb_offline / "tensorboard").glob("events.out.tfevents.*"))  # both, side by side


def test_wandb_alone_writes_no_tensorboard_and_other_ranks_nothing(wandb_offline: Path) -> None:
    writer = MetricsWriter(str(wandb_offline), enabled=True, report_to=check_report_to("wandb"))
    writer.start(2)
    writer.log(RECORDS[0])
    writer.finish()
    history, _ = _wandb_history(wandb_offline)
    assert history == {1: tensorboard.scalars(RECORDS[0])}
    assert not (wandb_offline / "tensorboard").exists()

    quiet = wandb_offline.parent / "rank1"
    other = MetricsWriter(str(quiet), enabled=False, report_to=["tensorboard", "wandb"])  # not global rank 0
    other.start(2)
    other.log(RECORDS[0])
    other.finish()
    assert not quiet.exists()


@pytest.fixture
def mlflow_env(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mlflow")
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.delenv(name, raising=False)  # restored after the test (the reporter sets the last)


def _mlflow_runs(uri: str, experiment: str = "merak") -> list[Any]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, (uri, experiment)
    return [client.get_run(r.info.run_id) for r in client.search_runs([found.experiment_id])]


def _mlflow_history(uri: str, run: Any) -> dict[int, dict[str, float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    history: dict[int, dict[str, float]] = {}
    for key in run.data.metrics:
        for metric in client.get_metric_history(run.info.run_id, key):
            history.setdefault(metric.step, {})[key] = metric.value
    return history


def _same(got: dict[int, dict[str, float]], expected: dict[int, dict[str, float]]) -> bool:
    return got.keys() == expected.keys() and all(
        got[s].keys() == v.keys()
        and all(got[s][k] == x or (math.isnan(x) and math.isnan(got[s][k])) for k, x in v.items())
        for s, v in expected.items()
    )


def test_mlflow_file_store_receives_the_scalars_and_the_params_once(tmp_path: Path, mlflow_env: None) -> None:
    out = tmp_path / "out"
    config = {"learning_rate": 1e-3, "tp_plan": None, "report_to": ["tensorboard", "mlflow"]}
    writer = MetricsWriter(str(out), enabled=True, report_to=["tensorboard", "mlflow"], run_config=config)
    writer.start(4)
    for record in RECORDS:
        writer.log(record)
    writer.finish()

    uri = (out / "mlruns").resolve().as_uri()  # the default: MLflow's file store under output_dir
    (run,) = _mlflow_runs(uri)
    assert run.info.status == "FINISHED"
    assert run.data.params == {k: str(v) for k, v in config.items()}
    assert run.data.tags["merak.resumed_step"] == "0"
    expected: dict[int, dict[str, float]] = {}
    for record in RECORDS:
        expected.setdefault(record["step"], {}).update(tensorboard.scalars(record))
    history = _mlflow_history(uri, run)
    assert _same(history, expected), (history, expected)
    assert history[3]["eval/accuracy"] == 0.5 and math.isnan(history[4]["train/loss"])
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))  # both, side by side


def test_mlflow_honours_the_tracking_uri_and_experiment(
    tmp_path: Path, mlflow_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    elsewhere = (tmp_path / "store").resolve().as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", elsewhere)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "job-7")
    out = tmp_path / "out"
    for resumed in (0, 2):  # a resumed job: a second run, its steps continuing from the checkpoint
        writer = MetricsWriter(str(out), enabled=True, report_to=check_report_to("mlflow"))
        writer.start(4, resumed_step=resumed)
        writer.log(RECORDS[resumed])
        writer.finish()
    assert not (out / "mlruns").exists() and not (out / "tensorboard").exists()
    runs = sorted(_mlflow_runs(elsewhere, "job-7"), key=lambda r: r.data.tags["merak.resumed_step"])
    assert [r.data.tags["merak.resumed_step"] for r in runs] == ["0", "2"]
    assert [_mlflow_history(elsewhere, r) for r in runs] == [
        {1: tensorboard.scalars(RECORDS[0])},
        {3: tensorboard.scalars(RECORDS[2])},
    ]
