"""``layout: auto`` without processes: the configuration errors (before any collective), the dry run,
the suggested job file, the machine defaults and the profiling inputs.

The multi-rank run (the plan's choice on every rank, equal losses, the plan check) is in
``tests/e2e/test_autoplan.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from merak_core.autoplan.auto import auto_layout, profile_inputs
from merak_core.autoplan.givens import (
    auto_degrees_note,
    auto_global_batch,
    compute_slots,
    default_memory_per_device,
)
from merak_core.config import TrainingArguments
from merak_core.config.layout_choice import LayoutChoice
from merak_core.job import JobConfig, write_job
from tests.e2e._bad_input_support import no_collectives

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples/addition/config.yaml"


@pytest.mark.parametrize(
    "kw, world, gbs, how",
    [
        (dict(), 4, 3 * 2 * 4, "x 4 ranks"),
        (dict(dp=2), 8, 3 * 2 * 2, "x dp 2 as written"),
        (dict(dp=1, tp=2, pp=2), 8, 3 * 2, "x dp 1 as written"),
        (dict(tp=2), 8, 3 * 2 * 4, "x dp 4 (= 8 ranks / cp*tp*pp 2)"),
        (dict(tp=2, pp=2), 8, 3 * 2 * 2, "x dp 2 (= 8 ranks / cp*tp*pp 4)"),
    ],
)
def test_auto_keeps_the_global_batch_the_written_degrees_give(kw, world, gbs, how):
    # layout: auto is one switch: written degrees are accepted, replaced by the plan's, and fix the batch
    args = TrainingArguments(
        layout="auto", per_device_train_batch_size=3, gradient_accumulation_steps=2, **kw
    )
    assert (args.dp, args.tp, args.pp) == (kw.get("dp"), kw.get("tp", 1), kw.get("pp", 1))
    head = "per_device_train_batch_size 3 x gradient_accumulation_steps 2"
    assert auto_global_batch(args, world) == (gbs, f"{head} {how}")
    note = auto_degrees_note(args, world)
    if kw:
        given = " ".join(f"{k}={v}" for k, v in kw.items())
        assert note == (
            f"layout auto: the job's {given} are replaced by the plan's (layout: manual keeps them); they "
            f"fix the global batch at {gbs} ({head} {how})"
        )
    else:
        assert note is None


def test_auto_refuses_a_null_dp_its_written_degrees_cannot_infer():
    args = TrainingArguments(layout="auto", tp=3)
    with pytest.raises(
        ValueError,
        match=r"dp is null and the written cp\*tp\*pp=3 does not divide the 4 ranks: set training.dp",
    ):
        auto_global_batch(args, 4)
    with no_collectives(), pytest.raises(ValueError, match="does not divide the 1 ranks"):
        auto_layout(args, nn.Linear(2, 2), [torch.zeros(2)])  # before any collective


def test_auto_switched_on_a_manual_job_file_keeps_its_degrees_for_the_batch(
    capsys: pytest.CaptureFixture[str],
):
    from merak_core.cli import main

    job = JobConfig.from_yaml(DEMO, ["training.layout=auto"])  # the demo writes dp=2 tp=2 pp=2
    assert (job.training.layout, job.training.dp, job.training.tp, job.training.pp) == ("auto", 2, 2, 2)
    # no --nproc-per-node: the written degrees give the ranks (8), and the global batch (16 x 2 x dp 2)
    assert main(["train", str(DEMO), "training.layout=auto", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "layout: auto -- when the job starts, on 8 ranks:" in out
    assert (
        "global batch of 64 (per_device_train_batch_size 16 x gradient_accumulation_steps 2 x dp 2 as "
        "written)" in out
    )
    assert (
        "layout auto: the job's dp=2 tp=2 pp=2 are replaced by the plan's (layout: manual keeps them); they "
        "fix the global batch at 64" in out
    )
    assert "--nproc-per-node=8" in out.splitlines()[-1]
    # other ranks than written: the written dp still counts the batch
    assert main(["train", str(DEMO), "training.layout=auto", "--nproc-per-node", "4", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "on 4 ranks:" in out and "global batch of 64 (" in out
    # dp null with a tp*pp that does not divide the ranks: refused before torchrun, by name
    bad = ["training.layout=auto", "training.dp=null", "training.tp=3", "training.pp=1"]
    assert main(["train", str(DEMO), *bad, "--nproc-per-node", "4", "--dry-run"]) == 2
    assert "set training.dp" in capsys.readouterr().err


def test_auto_arguments_round_trip_through_yaml_and_overrides(tmp_path: Path):
    args = TrainingArguments(layout="auto", memory_per_device="2GiB", plan_check_steps=4)
    assert args.memory_per_device == 2 * 2**30
    assert args.with_overrides(["seed=3"]).seed == 3
    path = tmp_path / "args.yaml"
    args.to_yaml(path)
    back = TrainingArguments.from_yaml(path)
    assert back == args
    written = args.with_overrides(["tp=2", "dp=2"])  # kept through YAML: they fix the global batch
    written.to_yaml(path)
    assert TrainingArguments.from_yaml(path) == written and (written.dp, written.tp) == (2, 2)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(layout="automatic"), "layout='automatic' is invalid"),
        (dict(plan_check_steps=1), "plan_check_steps=1 is invalid"),
        (dict(plan_check_steps=-1), "plan_check_steps=-1 is invalid"),
        (dict(plan_error_threshold=-0.5), "plan_error_threshold=-0.5 is invalid"),
        (dict(memory_per_device="lots"), "cannot read memory size 'lots'"),
    ],
)
def test_planner_field_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        TrainingArguments(**kw)


def test_auto_layout_refusals_before_any_collective():
    with no_collectives(), pytest.raises(ValueError, match="layout='manual'; expected 'auto'"):
        auto_layout(TrainingArguments(), nn.Linear(2, 2), [torch.zeros(2)])
    with no_collectives(), pytest.raises(ValueError, match="pass train_dataset"):
        auto_layout(TrainingArguments(layout="auto"), nn.Linear(2, 2), None)


def test_trainer_with_auto_refuses_a_given_layout():
    from merak_core import Trainer

    with no_collectives(), pytest.raises(ValueError, match="do not pass layout="):
        Trainer(nn.Linear(2, 2), TrainingArguments(layout="auto"), layout=object())  # type: ignore[arg-type]


def test_merak_train_dry_run_explains_auto(capsys: pytest.CaptureFixture[str]):
    from merak_core.cli import main

    over = ["training.layout=auto", "training.dp=null", "training.tp=1", "training.pp=1"]
    assert main(["train", str(DEMO), *over, "--nproc-per-node", "4", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "layout: auto -- when the job starts, on 4 ranks" in out
    assert (
        "global batch of 128 (per_device_train_batch_size 16 x gradient_accumulation_steps 2 x 4 ranks)"
        in out
    )
    assert f"merak plan {DEMO} {' '.join(over)} --world-size 4" in out
    assert "--nproc-per-node=4" in out.splitlines()[-1] and "merak_core.launch" in out.splitlines()[-1]
    assert main(["train", str(DEMO), *over, "--dry-run"]) == 2
    assert "pass --nproc-per-node" in capsys.readouterr().err


def test_write_job_gives_a_loadable_job_with_the_fields(tmp_path: Path):
    choice = LayoutChoice(dp=2, tp=1, pp=2, schedule="gpipe", num_microbatches=8, micro_batch_size=4)
    fields = choice.training_fields()
    assert fields["per_device_train_batch_size"] == 4 and fields["gradient_accumulation_steps"] == 8
    over = [
        "training.layout=auto",
        "training.dp=null",
        "training.tp=1",
        "training.pp=1",
        "training.max_steps=7",
    ]
    out = tmp_path / "sub" / "replanned.yaml"
    write_job(DEMO, out, choice, overrides=over)
    raw = yaml.safe_load(out.read_text())
    assert raw["training"]["layout"] == "manual"
    assert Path(raw["model"]["factory"].split(":")[0]).is_absolute()
    job = JobConfig.from_yaml(out)
    for k, v in fields.items():
        assert getattr(job.training, k) == v
    assert job.training.max_steps == 7
    # without a job file: the training section alone
    write_job(None, tmp_path / "t.yaml", choice)
    assert yaml.safe_load((tmp_path / "t.yaml").read_text()) == {"training": fields}


def test_machine_defaults_on_cpu(monkeypatch: pytest.MonkeyPatch):
    cpu = torch.device("cpu")
    assert compute_slots(cpu) == max(len(os.sched_getaffinity(0)) // torch.get_num_threads(), 1)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert default_memory_per_device(cpu) == ram // 4


class _Keyword(nn.Module):
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return input_ids.float()


class _Positional(nn.Module):
    def forward(self, ids_bt: torch.Tensor) -> torch.Tensor:
        return ids_bt.float()


def test_profile_inputs_follow_the_trainers_keyword_and_positional_rule():
    data = [{"input_ids": torch.tensor([i, i]), "labels": torch.tensor([1, 1])} for i in range(5)]
    kw = profile_inputs(_Keyword(), data, 3)
    assert isinstance(kw, dict) and set(kw) == {"input_ids"} and kw["input_ids"].shape == (3, 2)
    pos = profile_inputs(_Positional(), data, 3)
    assert isinstance(pos, torch.Tensor) and pos.tolist() == [[0, 0], [1, 1], [2, 2]]
    with pytest.raises(ValueError, match="training set is empty"):
        profile_inputs(_Positional(), [], 3)


def test_plan_check_report_writes_the_replanned_job_and_a_metrics_record(tmp_path: Path):
    # The Trainer side of the check on synthetic measurements (no processes): a fake run of pure DP,
    # measured with an optimizer 1 ns/byte slower than profiled (see test_planner_feedback's re-plan test).
    import dataclasses
    import json
    import math
    from types import SimpleNamespace

    from merak_core.autoplan.check import PlanCheck
    from merak_core.planner import CommModel, MeasuredStep, ModelProfile, PlanContext, predict_current
    from merak_core.run.metrics import MetricsWriter

    free = CommModel(
        p2p_latency_s=0.0, p2p_bandwidth=math.inf, allreduce_latency_s=0.0, allreduce_bandwidth=math.inf
    )
    profile = ModelProfile(
        layer_forward_s=[1e-3] * 4,
        layer_backward_s=[2e-3] * 4,
        layer_activation_bytes=[1e6] * 4,
        layer_param_bytes=[4e6] * 4,
        boundary_bytes=1e4,
        microbatch_overhead_s=2e-4,
        num_heads=4,
        vocab_size=16,
    )
    over = ["training.dp=4", "training.tp=1", "training.pp=1", "training.max_steps=7"]
    ctx = PlanContext(
        profile=profile, comm=free, memory_per_device=1e9, job_file=str(DEMO), job_overrides=tuple(over)
    )
    args = TrainingArguments(
        dp=4,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        schedule="1f1b",
        output_dir=str(tmp_path),
        save_steps=2,
    )
    metrics = tmp_path / "metrics.jsonl"
    run = SimpleNamespace(args=args, layout=SimpleNamespace(dp=4, tp=1, pp=1), schedule_name="1f1b")
    writer = MetricsWriter(str(tmp_path), enabled=True)  # the Trainer's sink for the check's record
    true = predict_current(
        ctx,
        LayoutChoice(dp=4, tp=1, pp=1, schedule="1f1b", num_microbatches=1, micro_batch_size=2),
        profile=dataclasses.replace(profile, optimizer_s_per_byte=1e-9),
    )
    measured = MeasuredStep(
        step_time_s=true.step_time_s,
        pipeline_s=true.pipeline_s,
        stage_forward_s=true.stage_forward_s,
        stage_backward_s=true.stage_backward_s,
        steps=3,
    )
    check = PlanCheck(run, ctx, 5, sink=writer.append)
    check._report(measured, 5)
    assert check.comparison is not None and check.replan is not None and check.replan.changed
    record = json.loads(metrics.read_text())
    assert record["step"] == 5 and record["replanned_changed"] is True
    assert record["error_step_time"] == pytest.approx(check.comparison.step_time_error)
    assert f"written to {tmp_path}/replanned.yaml" in record["replanned"]
    job = JobConfig.from_yaml(tmp_path / "replanned.yaml")
    best = check.replan.best
    assert (job.training.dp, job.training.tp, job.training.pp) == (best.dp, best.tp, best.pp) != (4, 1, 1)
    assert job.training.max_steps == 7  # the run's overrides are kept


def test_prepare_run_and_the_trainer_refuse_an_unknown_keyword():
    from merak_core import Trainer
    from merak_core.autoplan.prepare import prepare_run

    for build in (prepare_run, Trainer):
        with pytest.raises(TypeError, match="unexpected keyword arguments \\['layuot'\\]"):
            build(nn.Linear(2, 2), TrainingArguments(), layuot=None)  # type: ignore[call-arg]
