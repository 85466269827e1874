"""The merak-pipe command line prints what the library computes and writes traces and CSV."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from merak_pipe import CostModel, build_schedule, from_csv, simulate, to_csv
from merak_pipe.cli import main


def test_simulate_prints_the_library_numbers_and_writes_a_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "out.json"
    code = main(
        [
            "simulate",
            "--schedule",
            "shifted-critical-path",
            "--stages",
            "4",
            "--microbatches",
            "8",
            "--forward",
            "1",
            "--backward",
            "2",
            "--recompute",
            "full",
            "--input-bytes",
            "0.05",
            "--trace",
            str(trace),
            "--critical-path",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    expected = simulate(
        build_schedule("shifted-critical-path", num_stages=4, num_microbatches=8, recompute="full"),
        CostModel(forward=1, backward=2, input_bytes=0.05),
    )
    makespan = float(re.search(r"makespan ([0-9.e+]+)", out).group(1))  # type: ignore[union-attr]
    assert makespan == pytest.approx(expected.makespan, rel=1e-3)
    for rank in range(4):
        row = next(line for line in out.splitlines() if re.match(rf"\s+{rank} \|", line))
        assert f"{100 * expected.bubble_fraction[rank]:.1f}" in row
        assert f"s{rank}={expected.peak_memory[rank]:.4g}" in row
    assert "critical path: r0:0F0" in out
    events = json.loads(trace.read_text())["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert len(slices) == sum(len(a) for a in expected.schedule.actions.values())
    assert max(e["ts"] + e["dur"] for e in slices) == pytest.approx(expected.makespan * 1000.0)
    assert {e["tid"] for e in slices} == {0, 1, 2, 3}
    assert any(e["ph"] == "C" for e in events)


def test_show_validate_and_export_csv(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", "--schedule", "1f1b", "--stages", "2", "--microbatches", "2", "--lower"]) == 0
    out = capsys.readouterr().out
    assert "0SEND_F0" in out and "rank 1" in out
    csv_path = tmp_path / "zb.csv"
    assert (
        main(
            [
                "export-csv",
                "--schedule",
                "zb-h1",
                "--stages",
                "3",
                "--microbatches",
                "4",
                "--out",
                str(csv_path),
            ]
        )
        == 0
    )
    assert from_csv(csv_path).actions == build_schedule("zb-h1", num_stages=3, num_microbatches=4).actions
    assert main(["validate", "--csv", str(csv_path)]) == 0
    assert "ok: " in capsys.readouterr().out
    assert main(["simulate", "--csv", str(csv_path), "--forward", "1", "--backward", "2"]) == 0


def test_invalid_csv_exits_1_with_the_marked_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = build_schedule("1f1b", num_stages=2, num_microbatches=2)
    bad.actions[0].reverse()
    path = tmp_path / "bad.csv"
    to_csv(bad, path)
    assert main(["validate", "--csv", str(path)]) == 1
    err = capsys.readouterr().err
    assert "invalid schedule" in err and ">>" in err


def test_user_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "simulate",
                "--schedule",
                "interleaved-1f1b",
                "--stages",
                "6",
                "--microbatches",
                "4",
                "--ranks",
                "4",
            ]
        )
        == 2
    )
    assert "not a multiple of num_ranks" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["simulate", "--schedule", "1f1b"])


def test_png_needs_matplotlib_or_says_how_to_get_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    png = tmp_path / "t.png"
    args = ["simulate", "--schedule", "1f1b", "--stages", "3", "--microbatches", "4", "--png", str(png)]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert main(args) == 2
        assert "pip install merak-pipe[plot]" in capsys.readouterr().err
        return
    assert main(args) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(args) == 2
    assert "pip install merak-pipe[plot]" in capsys.readouterr().err
