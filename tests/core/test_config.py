"""TrainingArguments: validation, YAML + overrides, aliases, round trips, and the LR schedules.

The LR schedules are compared with Hugging Face's published formulas written out
independently here (and with transformers itself when it is installed).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from merak_core.config import (
    TrainingArguments,
    build_lr_scheduler,
    parse_bytes,
    parse_overrides,
    parse_recompute,
)
from merak_core.parallel.zero import ZeroOptimizer
from tests.support.dist import run_on_ranks


def test_defaults_are_hugging_face_like() -> None:
    args = TrainingArguments()
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps, args.learning_rate) == (
        8,
        1,
        5e-5,
    )
    assert (args.lr_scheduler_type, args.adam_beta1, args.adam_beta2, args.adam_epsilon) == (
        "linear",
        0.9,
        0.999,
        1e-8,
    )
    assert (args.max_grad_norm, args.max_steps, args.num_train_epochs, args.seed) == (1.0, -1, 3.0, 42)
    assert (args.dp, args.tp, args.pp, args.zero_stage, args.schedule) == (None, 1, 1, 0, "auto")
    with pytest.raises(TypeError):
        TrainingArguments(8)  # type: ignore[misc]  # keyword-only


def test_batch_size_mapping() -> None:
    args = TrainingArguments(per_device_train_batch_size=4, gradient_accumulation_steps=8, dp=2)
    assert args.num_microbatches == 8 and args.micro_batch_size == 4
    assert args.global_batch_size() == 64 and args.global_batch_size(dp=4) == 128
    with pytest.raises(ValueError, match="dp is None"):
        TrainingArguments().global_batch_size()


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (
            {"per_device_train_batch_size": 0},
            r"per_device_train_batch_size=0 is invalid: expected an integer >= 1",
        ),
        ({"gradient_accumulation_steps": 2.5}, r"gradient_accumulation_steps=2.5 is invalid"),
        ({"learning_rate": -1.0}, r"learning_rate=-1.0 is invalid: expected a number >= 0.0"),
        ({"lr_scheduler_type": "poly"}, r"lr_scheduler_type='poly' is invalid: expected one of \('constant'"),
        ({"adam_beta2": 1.0}, r"adam_beta2=1.0 is invalid: expected a number in \[0, 1\)"),
        ({"adam_epsilon": 0.0}, r"adam_epsilon=0.0 is invalid"),
        ({"max_steps": 0}, r"max_steps=0 is invalid"),
        ({"num_train_epochs": 0.0}, r"num_train_epochs=0.0 is invalid"),
        ({"dtype": "fp8"}, r"dtype='fp8' is invalid"),
        ({"bf16": True, "dtype": "float64"}, r"bf16=True with dtype='float64'.*set dtype='float32'"),
        ({"plan_probe_tp": "yes"}, r"plan_probe_tp=.yes. is invalid: expected true or false"),
        ({"schedule": "zigzag"}, r"schedule='zigzag' is invalid: expected one of \('auto'"),
        (
            {"recompute": "uniform:1.5"},
            r"recompute='uniform:1.5': the uniform fraction must be a number in \(0, 1\]",
        ),
        ({"recompute": "some"}, r"recompute='some' is not one of"),
        (
            {"zero_stage": 4},
            r"zero_stage=4 is invalid: expected 0 \(off\), 1 \(optimizer states sharded over DP\), 2",
        ),
        (
            {"zero_stage": 3, "schedule": "zb_h1"},
            r"zero_stage=3 with schedule='zb_h1'.*\(I/W\).*Use schedule 1f1b",
        ),
        ({"tp": 0}, r"tp=0 is invalid"),
        ({"dp": 0}, r"dp=0 is invalid: expected an integer >= 1 or null"),
        ({"memory_budget": "lots"}, r"cannot read memory size 'lots'"),
        ({"eval_steps": 0}, r"eval_steps=0 is invalid"),
        ({"tp_plan": {"q_proj": 1}}, r"tp_plan=.* is invalid"),
        (
            {"seed": 10**23},
            r"seed=100000000000000000000000 is invalid: expected an integer in \[0, 4294967295\]",
        ),
        ({"seed": -1}, r"seed=-1 is invalid: expected an integer >= 0"),
        ({"comm_timeout_s": 0}, r"comm_timeout_s=0.0 is invalid: expected a positive number of seconds"),
        ({"comm_timeout_s": float("inf")}, r"comm_timeout_s=inf is invalid: expected a number >= 0.0"),
    ],
)
def test_validation_names_value_and_fix(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainingArguments(**kwargs)


def test_parsers() -> None:
    assert parse_recompute("none") == ("none", 0.0)
    assert parse_recompute("full") == ("full", 1.0)
    assert parse_recompute("uniform:0.25") == ("uniform", 0.25)
    assert parse_recompute("stage_aware") == ("stage_aware", None)
    assert (
        parse_bytes("12GiB") == 12 * 2**30
        and parse_bytes("500 MB") == 500 * 10**6
        and parse_bytes(4096) == 4096
    )
    assert parse_bytes("1.5KiB") == 1536
    assert TrainingArguments(memory_budget="2GiB").memory_budget == 2 * 2**30


def test_yaml_round_trip_and_overrides(tmp_path: Path) -> None:
    path = tmp_path / "train.yaml"
    path.write_text(
        "output_dir: runs/demo\n"
        "num_microbatches: 4\n"  # alias of gradient_accumulation_steps
        "learning_rate: 3.0e-4\n"
        "lr_scheduler_type: cosine\n"
        "warmup_steps: 10\n"
        "max_steps: 100\n"
        "dp: 2\ntp: 2\npp: 2\n"
        "recompute: uniform:0.5\n"
        "memory_budget: 1GiB\n"
        "tp_plan: {q_proj: column, o_proj: row}\n"
    )
    args = TrainingArguments.from_yaml(
        path,
        [
            "learning_rate=1e-3",
            "--tp=1",
            "dp=null",
            "bf16=true",
            "output_dir=2024",
            "schedule=1f1b",
            "zero_stage=1",
        ],
    )
    assert args.gradient_accumulation_steps == 4 and args.num_microbatches == 4
    assert args.learning_rate == 1e-3 and isinstance(args.learning_rate, float)
    assert (args.tp, args.pp, args.dp, args.bf16, args.zero_stage) == (1, 2, None, True, 1)
    assert args.output_dir == "2024" and args.schedule == "1f1b"
    assert TrainingArguments(schedule="shifted-critical-path").schedule == "shifted_critical_path"
    assert args.memory_budget == 2**30 and args.recompute_mode == ("uniform", 0.5)
    assert args.tp_plan == {"q_proj": "column", "o_proj": "row"}
    out = tmp_path / "saved.yaml"
    args.to_yaml(out)
    assert TrainingArguments.from_yaml(out) == args
    assert args.with_overrides(["seed=7"]).seed == 7 and args.seed == 42
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert TrainingArguments.from_yaml(empty) == TrainingArguments()


def test_unknown_key_lists_valid_keys_and_suggests(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("learning_rat: 0.1\n")
    with pytest.raises(
        ValueError,
        match=r"unknown TrainingArguments key 'learning_rat' \(did you mean "
        r"'learning_rate'\?\)\. Valid keys: output_dir, .*zero_stage",
    ):
        TrainingArguments.from_yaml(path)
    with pytest.raises(
        ValueError,
        match=r"unknown TrainingArguments key 'gradient_accumulation' \(did you mean "
        r"'gradient_accumulation_steps'\?\)",
    ):
        parse_overrides(["gradient_accumulation=4"])


@pytest.mark.parametrize(
    "override,message",
    [
        ("tp=two", r"tp='two' has the wrong type: expected int, got str"),
        ("bf16=1", r"bf16=1 has the wrong type: expected bool, got int"),
        ("learning_rate=fast", r"learning_rate='fast' has the wrong type: expected float"),
        ("max_steps=1.5", r"max_steps=1.5 has the wrong type: expected int"),
        ("tp=null", r"tp=None has the wrong type: expected int, got null"),
        ("learning_rate", r"not of the form key=value"),
    ],
)
def test_overrides_are_type_checked(tmp_path: Path, override: str, message: str) -> None:
    path = tmp_path / "ok.yaml"
    path.write_text("seed: 1\n")
    with pytest.raises(ValueError, match=message):
        TrainingArguments.from_yaml(path, [override])


def test_field_help_covers_every_field() -> None:
    docs = TrainingArguments.field_help()
    assert set(docs) == set(TrainingArguments.field_names())
    assert "num_microbatches" in docs["gradient_accumulation_steps"]


# ---------------------------------------------------------------------------- LR schedules


def _hf_formula(kind: str, step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return step / max(1, warmup)
    if kind == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    if kind == "linear":
        return max(0.0, (total - step) / max(1, total - warmup))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))


def _lrs(kind: str, zero: bool) -> tuple[list[float], float]:
    args = TrainingArguments(learning_rate=0.1, lr_scheduler_type=kind, warmup_steps=3, max_steps=10)
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.ones(2)
    opt: torch.optim.Optimizer
    if zero:
        opt = ZeroOptimizer([p], lambda groups: torch.optim.AdamW(groups, lr=args.learning_rate))
    else:
        opt = torch.optim.AdamW([p], lr=args.learning_rate)
    sched = build_lr_scheduler(opt, args)
    lrs = []
    for _ in range(12):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    # The lr actually used by the (inner) optimizer at its last step:
    used = opt.inner.param_groups[0]["lr"] if zero else opt.param_groups[0]["lr"]  # type: ignore[attr-defined]
    return lrs, used


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
def test_lr_schedules_follow_hugging_face(kind: str) -> None:
    expected = [0.1 * _hf_formula(kind, s, 3, 10) for s in range(12)]
    lrs, _ = _lrs(kind, False)
    assert lrs == pytest.approx(expected, rel=1e-12, abs=1e-15)
    # ZeRO-1 forwards the scheduled lr to its inner optimizer on every rank.
    for lrs, used in run_on_ranks(2, _lrs, kind, True):
        assert lrs == pytest.approx(expected, rel=1e-12, abs=1e-15)
        assert used == pytest.approx(expected[11], rel=1e-12, abs=1e-15)


def test_decaying_schedule_needs_a_length() -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match="lr_scheduler_type='linear' decays to 0.*pass num_training_steps"):
        build_lr_scheduler(opt, TrainingArguments())
    sched = build_lr_scheduler(opt, TrainingArguments(), num_training_steps=4)
    seen = []
    for _ in range(5):
        seen.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert seen == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])


def test_matches_transformers_when_installed() -> None:
    transformers = pytest.importorskip("transformers")
    for kind in ("constant", "linear", "cosine"):
        args = TrainingArguments(learning_rate=1.0, lr_scheduler_type=kind, warmup_steps=2, max_steps=8)
        ours_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        theirs_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        ours = build_lr_scheduler(ours_opt, args)
        theirs = transformers.get_scheduler(
            "constant_with_warmup" if kind == "constant" else kind,
            theirs_opt,
            num_warmup_steps=2,
            num_training_steps=8,
        )
        for _ in range(9):
            assert ours.get_last_lr() == pytest.approx(theirs.get_last_lr())
            ours_opt.step()
            theirs_opt.step()
            ours.step()
            theirs.step()


def test_comm_timeout_is_a_job_setting(tmp_path: Path) -> None:
    """``training.comm_timeout_s`` (600 s by default) is a YAML key and an override, read as a timedelta."""
    import datetime

    assert TrainingArguments().comm_timeout == datetime.timedelta(seconds=600)
    path = tmp_path / "train.yaml"
    path.write_text("comm_timeout_s: 45\n")
    assert TrainingArguments.from_yaml(path).comm_timeout_s == 45.0
    assert TrainingArguments.from_yaml(path, ["comm_timeout_s=2.5"]).comm_timeout == datetime.timedelta(
        seconds=2.5
    )


def test_duplicate_yaml_key_is_an_error(tmp_path: Path) -> None:
    """YAML keeps the last of two equal keys; a config file with one twice is refused, naming both lines."""
    path = tmp_path / "train.yaml"
    path.write_text("learning_rate: 1.0e-3\nmax_steps: 10\nlearning_rate: 3.0e-3\n")
    with pytest.raises(
        ValueError,
        match=r"train.yaml: line 3: key 'learning_rate' appears twice in one mapping "
        r"\(first at line 1\)",
    ):
        TrainingArguments.from_yaml(path)
    path.write_text("max_steps: [10\n")
    with pytest.raises(ValueError, match=r"train.yaml: not valid YAML: .*line 2, column 1"):
        TrainingArguments.from_yaml(path)


def test_the_config_stores_the_registry_key() -> None:
    from merak_core.config import schedule_choices
    from merak_pipe import schedule_infos

    assert TrainingArguments(schedule="zb-v", pp=2, virtual_stages=2).schedule == "zb_v"
    assert TrainingArguments(schedule=" Zb-H1 ").schedule == "zb_h1"
    assert schedule_choices() == ("auto", *(i.key for i in schedule_infos()))
    with pytest.raises(
        ValueError, match=r"schedule='pipedream' is invalid: expected one of \('auto', 'gpipe'"
    ):
        TrainingArguments(schedule="pipedream")


def test_job_training_overrides_are_typed_like_flat_overrides() -> None:
    # One override parser: `training.output_dir=2024` is the text typed, as `output_dir=2024` is.
    from merak_core.config import parse_overrides
    from merak_core.job import JobConfig

    demo = Path(__file__).resolve().parents[2] / "examples" / "addition" / "config.yaml"
    job = JobConfig.from_yaml(demo, ["training.output_dir=2024", "training.max_steps=7"])
    assert job.training.output_dir == "2024" == parse_overrides(["output_dir=2024"])["output_dir"]
    assert job.training.max_steps == 7
    with pytest.raises(ValueError, match=r"override 'training\.max_steps' is not 'section\.key=value'"):
        JobConfig.from_yaml(demo, ["training.max_steps"])
