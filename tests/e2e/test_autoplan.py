"""``layout: auto`` end to end on 4 gloo ranks: the planner's choice, equal on every rank, trains like one process.

One run serves three checks (to keep the test time small): every rank gets the same layout; it is
:func:`~merak_core.planner.plan`'s first candidate for the profile, communication model, memory
and compute slots the run used (recomputed here, in the test process); and the losses equal the
single-process reference for that layout's global batch. The same run's plan check (3 steps,
threshold 0 so that it always re-plans) must produce a predicted/measured table whose errors are
computed from its numbers, a metrics.jsonl record and a re-plan message.

On 2 ranks, with a profile whose pipeline bubble dominates and a device per rank (the machine's
measurements replaced so the plan decides), ``layout: auto`` chooses two stages per rank, as
:func:`~merak_core.planner.plan` ranks them, and trains like one process (losses and every
parameter). Then a manual layout's check (the Trainer profiles first) on 2 ranks, and ``merak train`` with
``layout: auto`` through torchrun on 2 processes (the launch path: plan, train, check, job file).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e._autoplan_support import fixed_planning_inputs
from tests.e2e._trainer_support import TokenDataset, build_model, make_args, reference_training
from tests.support.compare import assert_tensors_close
from tests.support.dist import run_on_ranks
from tests.support.models import REFERENCE_MODELS

REPO = Path(__file__).resolve().parents[2]
WORLD = 4
KWARGS: dict[str, Any] = dict(
    max_steps=3,
    per_device_train_batch_size=2,
    gradient_accumulation_steps=1,
    memory_per_device="1GiB",
    plan_check_steps=3,
    plan_error_threshold=0.0,
)


def _auto_body(name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    from merak_core import Trainer

    args = make_args(layout="auto", **kwargs)
    model = build_model(name)
    data = TokenDataset(64, model.config.vocab_size)
    trainer = Trainer(model, args, data, loss_fn=REFERENCE_MODELS[name].loss)
    history = trainer.train()
    t = trainer.args
    out: dict[str, Any] = {
        "fields": {
            k: getattr(t, k)
            for k in (
                "dp",
                "tp",
                "pp",
                "schedule",
                "per_device_train_batch_size",
                "gradient_accumulation_steps",
                "recompute",
                "virtual_stages",
                "zero_stage",
            )
        },
        "layout": (trainer.layout.dp, trainer.layout.tp, trainer.layout.pp),
        "losses": [h["loss"] for h in history],
    }
    if dist.get_rank() == 0:
        ctx = trainer.plan_context
        check = trainer.plan_check
        out.update(
            profile=ctx.profile,
            comm=ctx.comm,
            memory=ctx.memory_per_device,
            slots=ctx.compute_slots,
            comparison=check.comparison,
            replan=check.replan,
            output_dir=t.output_dir,
            metrics=open(os.path.join(t.output_dir, "metrics.jsonl")).read(),
        )
    return out


def test_layout_auto_chooses_plans_first_candidate_and_trains_like_one_process():
    from merak_core.planner import plan
    from merak_core.planner.choices import searched_virtual_stages

    results = run_on_ranks(WORLD, _auto_body, "gpt", KWARGS)
    fields = results[0]["fields"]
    assert all(r["fields"] == fields for r in results)
    assert all(r["layout"] == (fields["dp"], fields["tp"], fields["pp"]) for r in results)
    r0 = results[0]
    gbs = KWARGS["per_device_train_batch_size"] * KWARGS["gradient_accumulation_steps"] * WORLD
    best = plan(
        r0["profile"],
        world_size=WORLD,
        memory_per_device=r0["memory"],
        global_batch_size=gbs,
        comm=r0["comm"],
        compute_slots=r0["slots"],
        virtual_stages=searched_virtual_stages(r0["slots"]),
    )[0]
    expected = best.training_fields()
    expected.pop("memory_budget", None)
    assert fields == expected
    assert r0["memory"] == 2**30
    assert fields["per_device_train_batch_size"] * fields["gradient_accumulation_steps"] * fields["dp"] == gbs

    ref_kwargs = {
        **KWARGS,
        "per_device_train_batch_size": fields["per_device_train_batch_size"],
        "gradient_accumulation_steps": fields["gradient_accumulation_steps"],
    }
    ref_losses, _ = reference_training("gpt", ref_kwargs, fields["dp"])
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-9, abs=1e-12)

    # the plan check: 1 warm-up step, 2 measured; every error is (predicted - measured) / measured
    comparison = r0["comparison"]
    assert comparison is not None and comparison.measured.steps == 2
    rows = {row.name: row for row in comparison.rows}
    assert {"step time", "pipeline", "outside pipeline"} <= set(rows)
    for s in range(fields["pp"] * fields["virtual_stages"]):
        for what in ("F", "B"):
            row = rows[f"stage {s} {what}"]
            assert math.isfinite(row.predicted) and row.predicted > 0 and row.measured > 0
            assert row.error == pytest.approx((row.predicted - row.measured) / row.measured, rel=1e-12)
    for r in range(fields["pp"]):  # memory per pipeline rank (its virtual stages together)
        mem = rows[f"{'stage' if fields['virtual_stages'] == 1 else 'rank'} {r} peak memory"]
        assert mem.measured is None or mem.measured > 0
    step = rows["step time"]
    assert comparison.step_time_error == pytest.approx((step.predicted - step.measured) / step.measured)
    record = [json.loads(line) for line in r0["metrics"].splitlines() if "plan_check" in line]
    assert len(record) == 1
    assert record[0]["error_step_time"] == pytest.approx(comparison.step_time_error)
    assert record[0]["measured_step_time_s"] == pytest.approx(step.measured)
    # threshold 0: it re-planned, from a corrected profile whose prediction of the current layout is closer to
    # the measurement, part by part (equal unless the communication alone exceeds it: see correct_profile)
    replanned = r0["replan"]
    assert replanned is not None and record[0]["replanned"].startswith("re-planned from measured costs")
    pred, meas, corr = comparison.candidate, comparison.measured, replanned.current
    assert abs(corr.pipeline_s - meas.pipeline_s) <= abs(pred.pipeline_s - meas.pipeline_s) + 1e-9
    outside = lambda c: c.step_time_s - c.pipeline_s  # noqa: E731
    assert abs(outside(corr) - meas.outside_pipeline_s) <= abs(outside(pred) - meas.outside_pipeline_s) + 1e-9
    assert os.path.exists(os.path.join(r0["output_dir"], "replanned.yaml")) == replanned.changed


def _auto_virtual_body(kwargs: dict[str, Any], profile: Any) -> dict[str, Any]:
    """``layout: auto`` with the profile replaced by ``profile`` and the machine's measurements by what
    a device per rank gives (no compute slots) and the default ``CommModel()``, so that the plan, not
    this machine's load, decides; the choice and the training run are real."""
    import torch.distributed as dist

    from merak_core import Trainer
    from tests.e2e.test_virtual_stages import build

    # the scale CommModel() has: the plan below is made with it
    with fixed_planning_inputs(profile, measure_split_backward_scale=lambda *a, **k: 1.0):
        model = build("gpt", profile.num_layers)
        trainer = Trainer(
            model,
            make_args(layout="auto", **kwargs),
            TokenDataset(64, model.config.vocab_size),
            loss_fn=REFERENCE_MODELS["gpt"].loss,
        )
        history = trainer.train()
    state = trainer.full_state_dict()  # collective
    t = trainer.args
    return {
        "fields": {k: getattr(t, k) for k in ("dp", "tp", "pp", "schedule", "virtual_stages")},
        "batch": (t.per_device_train_batch_size, t.gradient_accumulation_steps),
        "stages": sorted(trainer.model.stage_modules),
        "losses": [h["loss"] for h in history],
        "state": state if dist.get_rank() == 0 else None,
    }


def test_layout_auto_chooses_virtual_stages_where_predicted_faster_and_trains_like_one_process():
    # Four layers whose weights fit one device only when split in two (no dp=2), one head (no tp=2) and
    # a bubble that dominates: two stages per rank are predicted faster than one (tests/core/
    # test_planner_virtual_stages.py checks that ranking without processes).
    from merak_core.planner import CommModel, ModelProfile, plan
    from merak_core.planner.choices import AUTO_VIRTUAL_STAGES, VIRTUAL_STAGE_SCHEDULES
    from tests.e2e.test_virtual_stages import _reference

    profile = ModelProfile(
        layer_forward_s=[1e-2] * 4,
        layer_backward_s=[2e-2] * 4,
        layer_activation_bytes=[1e3] * 4,
        layer_param_bytes=[1e8] * 4,
        boundary_bytes=1e3,
        num_heads=1,
    )
    kwargs = dict(
        max_steps=3,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=2,
        memory_per_device=int(1.3e9),
        plan_probe_tp=False,
        plan_check_steps=0,
    )
    results = run_on_ranks(2, _auto_virtual_body, kwargs, profile)
    r0 = results[0]
    assert all(r["fields"] == r0["fields"] and r["batch"] == r0["batch"] for r in results)
    fields = r0["fields"]
    assert (fields["dp"], fields["tp"], fields["pp"], fields["virtual_stages"]) == (1, 1, 2, 2)
    assert fields["schedule"] in VIRTUAL_STAGE_SCHEDULES
    best = plan(  # what the run planned from: 2 ranks with a device each, the job's batch
        profile,
        world_size=2,
        memory_per_device=kwargs["memory_per_device"],
        global_batch_size=4,
        comm=CommModel(),
        virtual_stages=AUTO_VIRTUAL_STAGES,
    )[0]
    expected = best.training_fields()
    assert {
        **fields,
        "per_device_train_batch_size": r0["batch"][0],
        "gradient_accumulation_steps": r0["batch"][1],
    } == {k: expected[k] for k in (*fields, "per_device_train_batch_size", "gradient_accumulation_steps")}
    assert [len(r["stages"]) for r in results] == [2, 2]  # two of the four stages on each rank
    mbs, accum = r0["batch"]
    ref_losses, ref_state = _reference(
        "gpt", 4, {**kwargs, "per_device_train_batch_size": mbs, "gradient_accumulation_steps": accum}
    )
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-9, abs=1e-12)
    assert sorted(r0["state"]) == sorted(ref_state)
    for key, ref in ref_state.items():
        assert_tensors_close(r0["state"][key], ref, name=f"auto v=2 param {key}", rtol=1e-8, atol=1e-10)


def _manual_check_body(kwargs: dict[str, Any]) -> Any:
    import torch.distributed as dist

    from merak_core import Trainer

    args = make_args(**kwargs)
    model = build_model("gpt")
    trainer = Trainer(
        model, args, TokenDataset(64, model.config.vocab_size), loss_fn=REFERENCE_MODELS["gpt"].loss
    )
    trainer.train()
    if dist.get_rank() != 0:
        return None
    return trainer.plan_context is not None, trainer.plan_check.comparison


def test_manual_layout_plan_check_profiles_first_and_compares_every_stage():
    # a manual 1x1x2 layout with stage-aware recomputation: the Trainer builds the profile itself
    kwargs = dict(
        dp=1,
        tp=1,
        pp=2,
        max_steps=3,
        plan_check_steps=3,
        schedule="1f1b",
        recompute="stage_aware",
        memory_budget="1GiB",
        gradient_accumulation_steps=2,
    )
    has_context, comparison = run_on_ranks(2, _manual_check_body, kwargs)[0]
    assert has_context and comparison is not None
    c = comparison.candidate
    assert (c.dp, c.tp, c.pp, c.schedule, c.recompute, c.num_microbatches) == (
        1,
        1,
        2,
        "1f1b",
        "stage_aware",
        2,
    )
    names = [row.name for row in comparison.rows]
    assert names == [
        "step time",
        "pipeline",
        "outside pipeline",
        "stage 0 F",
        "stage 0 B",
        "stage 1 F",
        "stage 1 B",
        "stage 0 peak memory",
        "stage 1 peak memory",
    ]
    for row in comparison.rows[:7]:
        assert row.measured > 0 and row.error == pytest.approx((row.predicted - row.measured) / row.measured)


JOB = """\
model: {factory: factories.py:build_model}
data: {factory: factories.py:build_datasets}
training:
  layout: auto
  memory_per_device: 1GiB
  dtype: float64
  per_device_train_batch_size: 4
  gradient_accumulation_steps: 2
  learning_rate: 3.0e-3
  max_steps: 4
  save_steps: 2
  logging_steps: 1
  plan_check_steps: 3
  plan_error_threshold: 0.0
  seed: 0
"""

FACTORIES = """\
import sys

sys.path.insert(0, %(repo)r)

from examples.addition.data import build_datasets as _datasets  # noqa: E402
from examples.addition.model import build_model as _model  # noqa: E402


def build_model():
    return _model(depth=2, width=32, heads=4, vocab_size=13, context=16)


def build_datasets():
    return _datasets(train_size=256, eval_size=16, num_digits=2)[0]
"""


@pytest.mark.slow
def test_merak_train_with_layout_auto(tmp_path: Path):
    """``merak train`` (torchrun, 2 processes): launch plans, trains the choice, checks and names the job file."""
    (tmp_path / "job.yaml").write_text(JOB)
    (tmp_path / "factories.py").write_text(FACTORIES % {"repo": str(REPO)})
    roots = [
        str(Path(importlib.import_module(n).__file__).resolve().parents[1])  # type: ignore[arg-type]
        for n in ("merak_core", "merak_pipe", "merak_graph", "merak_tp")
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(roots))
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "merak_core.cli",
            "train",
            "job.yaml",
            f"training.output_dir={out}",
            "--nproc-per-node",
            "2",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    chosen = re.search(r"layout auto: training with dp=(\d+) tp=(\d+) pp=(\d+) schedule=(\S+)", log)
    assert chosen is not None, log[-4000:]
    dp, tp, pp, _ = chosen.groups()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and f"/2 dp={dp} tp={tp} pp={pp}" in summary["layout"], summary
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    check = [r for r in records if "plan_check" in r]
    assert len(check) == 1 and check[0]["plan_check"].startswith(f"dp{dp}-tp{tp}-pp{pp} ")
    assert check[0]["replanned"].startswith("re-planned from measured costs")
    assert "plan check over 2 steps" in log and "step time (ms)" in log
    written = out / "replanned.yaml"
    assert written.exists() == check[0]["replanned_changed"]
    if written.exists():  # the job file (factories made absolute) with the suggested fields
        raw = yaml.safe_load(written.read_text())
        assert (
            raw["training"]["layout"] == "manual"
            and Path(raw["model"]["factory"].split(":")[0]).is_absolute()
        )
        assert f"merak train {written} --resume latest" in check[0]["replanned"]


def _auto_lora_body() -> dict[str, Any]:
    from merak_core import LoraConfig, Trainer

    args = make_args(
        layout="auto",
        max_steps=1,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        memory_per_device="1GiB",
        plan_check_steps=0,
    )
    model = build_model("gpt")
    lora = LoraConfig(r=2, alpha=4, target_modules=["q_proj", "v_proj"])
    trainer = Trainer(
        model,
        args,
        TokenDataset(16, model.config.vocab_size),
        loss_fn=REFERENCE_MODELS["gpt"].loss,
        lora=lora,
    )
    history = trainer.train()
    return {"profile": trainer.plan_context.profile, "losses": [h["loss"] for h in history]}


def test_layout_auto_profiles_a_lora_job_with_its_adapters():
    # The Trainer hands model.lora to the planner: the profile counts the frozen weights as weights only.
    results = run_on_ranks(2, _auto_lora_body)
    prof = results[0]["profile"]
    model = build_model("gpt")
    per_block = 2 * 2 * 2 * model.config.hidden_size * 8  # q and v: A (2 x h) and B (h x 2), float64
    assert prof.layer_trainable_bytes is not None and prof.shared_trainable_bytes == 0.0
    assert prof.layer_trainable_bytes == [float(per_block)] * prof.num_layers
    assert all(math.isfinite(x) for x in results[0]["losses"])
