"""The progress line (gradient norm, ETA) and the TensorBoard event files of a run."""

from __future__ import annotations

from pathlib import Path

import pytest

from merak_core.run.metrics import MetricsWriter, format_duration


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_progress_line_shows_the_gradient_norm_and_the_time_left(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    clock = _Clock()
    writer = MetricsWriter(str(tmp_path), enabled=True, clock=clock)
    writer.start(100)
    writer.log(
        {"step": 1, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.73125, "step_time_s": 2.0, "tokens_per_s": 1234.4}
    )
    clock.now += 45.0  # steps 2..10 took 5 s each
    writer.log(
        {"step": 10, "loss": 2.0, "lr": 1e-3, "grad_norm": 12.5, "step_time_s": 0.5, "tokens_per_s": 2000.0}
    )
    clock.now += 90.0 * 5
    writer.log({"step": 100, "loss": 1.0, "lr": 0.0, "step_time_s": 5.0})
    first, tenth, last = capsys.readouterr().out.splitlines()
    assert first == (
        "step   1/100 [>                       ]  loss 2.5000  lr 1.00e-03  grad_norm 0.731  "
        "1,234 tok/s  2000 ms/step  ETA 3:18"
    )  # the first step's own time x 99 steps left
    assert tenth == (
        "step  10/100 [==>                     ]  loss 2.0000  lr 1.00e-03  grad_norm 12.5  "
        "2,000 tok/s  500 ms/step  ETA 7:30"
    )  # 5 s a step since step 1 x 90 steps left
    assert last.endswith("5000 ms/step  ETA 0:00") and "grad_norm" not in last  # no clipping: no norm


def test_a_resumed_segment_estimates_from_its_own_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    clock = _Clock()
    writer = MetricsWriter(str(tmp_path), enabled=True, clock=clock)
    writer.start(20, resumed_step=10)
    writer.log({"step": 11, "loss": 1.0, "step_time_s": 30.0})  # loading and warm-up
    clock.now += 4.0
    writer.log({"step": 12, "loss": 1.0, "step_time_s": 4.0})
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("ETA 4:30") and out[1].endswith("ETA 0:32")


def test_format_duration() -> None:
    assert [format_duration(s) for s in (0, 59.4, 75, 3725, float("nan"))] == [
        "0:00",
        "0:59",
        "1:15",
        "1:02:05",
        "--:--",
    ]


def test_tensorboard_event_files_are_written_and_readable(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = MetricsWriter(str(tmp_path), enabled=True)
    writer.start(4)
    for step in range(1, 5):
        writer.log(
            {
                "step": step,
                "loss": 1.0 / step,
                "lr": 1e-3,
                "grad_norm": float(step),
                "step_time_s": 0.1,
                "skipped": False,
            }
        )
    writer.log({"step": 4, "eval_loss": 0.5, "eval_accuracy": 0.75})
    writer.finish()
    files = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 1
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "train/step_time_s",
        "eval/loss",
        "eval/accuracy",
    } <= tags
    assert "train/skipped" not in tags
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("train/loss")] == [
        (1, 1.0),
        (2, 0.5),
        (3, round(1 / 3, 6)),
        (4, 0.25),
    ]
    assert [(e.step, e.value) for e in events.Scalars("eval/accuracy")] == [(4, 0.75)]


def test_tensorboard_of_a_resumed_run_hides_the_interrupted_segments_later_steps(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = MetricsWriter(str(tmp_path), enabled=True)
    first.start(6)
    for step in range(1, 6):  # checkpoint at 3, crash after 5
        first.log({"step": step, "loss": float(step)})
    first.finish()
    second = MetricsWriter(str(tmp_path), enabled=True)
    second.start(6, resumed_step=3)
    for step in (4, 5, 6):
        second.log({"step": step, "loss": 10.0 * step})
    second.finish()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 40.0),
        (5, 50.0),
        (6, 60.0),
    ]
