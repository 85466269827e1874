"""`merak plan --cluster FILE --nodes N` and `--dry-run-ranks N` through the real CLI entry point (in process)."""

from __future__ import annotations

import pathlib

import yaml

from merak_core.cli import main

DEMO = str(pathlib.Path(__file__).resolve().parents[2] / "examples/addition/config.yaml")


def test_plan_for_a_cluster_prints_a_ranked_table_with_per_stage_memory(capsys, tmp_path):
    out_yaml = tmp_path / "best.yaml"
    assert (
        main(
            [
                "plan",
                DEMO,
                "--cluster",
                "a100-80gb-8x",
                "--nodes",
                "1",
                "--top",
                "3",
                "--write-config",
                str(out_yaml),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "on 1 nodes x 8 A100-SXM4-80GB (8 ranks, cluster a100-80gb-8x)" in out
    assert "memory per stage (usable)" in out and "(72.0G)" in out
    rows = [line for line in out.splitlines() if line.strip().startswith(("1 ", "2 ", "3 "))]
    assert len(rows) == 3
    written = yaml.safe_load(out_yaml.read_text())["training"]
    assert written["dp"] * written["tp"] * written["pp"] == 8


def test_plan_without_world_size_or_cluster_is_a_clear_error(capsys):
    assert main(["plan", DEMO, "--memory-per-device", "1GiB"]) == 2
    assert (
        "--world-size=None: expected a number of ranks >= 1 (or plan for a cluster" in capsys.readouterr().err
    )
    assert main(["plan", DEMO, "--cluster", "h100-sxm-8x"]) == 2
    assert "--cluster needs --nodes N" in capsys.readouterr().err
    assert main(["plan", DEMO, "--cluster", "no-such-cluster", "--nodes", "1"]) == 2
    assert "neither a file nor a shipped cluster" in capsys.readouterr().err


def test_plan_dry_run_on_the_cluster_nodes(capsys):
    assert main(["plan", DEMO, "--cluster", "h100-sxm-8x", "--nodes", "2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "dry run: 16 ranks on h100-sxm-8x, dp=4 tp=2 pp=2" in out  # dp inferred from 16 / (tp*pp)
    assert "every rank would build and fit" in out


def test_train_dry_run_ranks_reports_the_first_failure(capsys):
    assert main(["train", DEMO, "--dry-run-ranks", "64", "--cluster", "a100-80gb-8x"]) == 0
    assert "built 64 ranks' groups" in capsys.readouterr().out
    # tp=3 does not divide 64 ranks: rank 0 fails, exit status 1
    assert main(["train", DEMO, "training.tp=3", "--dry-run-ranks", "64"]) == 1
    out = capsys.readouterr().out
    assert "cluster: h100-sxm-8x (the default" in out
    assert "FIRST FAILURE: error [layout] rank 0" in out


def test_plan_for_a_cluster_traces_a_transformers_model(capsys):
    import pytest

    pytest.importorskip("transformers")
    job = str(pathlib.Path(DEMO).parents[1] / "transformers/config.yaml")
    assert main(["plan", job, "--cluster", "h100-sxm-8x", "--nodes", "1", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "feasible configurations on 1 nodes" in out and "(fp32)" in out
