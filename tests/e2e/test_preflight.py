"""Bad input before launch: ``merak train`` finds each mistake of a job in the launching process.

Every row is a job file (plus overrides and flags) with one mistake and the words its error
must contain: the key, the value and the fix. The table runs ``merak train ... --dry-run``
in this process (the checks run, nothing is launched) under the no-collective guard of
``_bad_input_support.py``; a few rows run the real ``merak train`` as a subprocess (no
``--dry-run``) and check that the error is printed once, the exit status is 2 and torchrun
never started. The model and data factories are in ``_bad_input_jobs.py``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from merak_core.run.exitcodes import BAD_INPUT
from tests.e2e._bad_input_support import dry_run_train

REPO = Path(__file__).resolve().parents[2]
JOBS = "tests.e2e._bad_input_jobs"


@dataclass(frozen=True)
class Case:
    """One mistake: job-file sections (merged over a good job), extra argv, and the words of the error."""

    words: tuple[str, ...]
    model: dict = field(default_factory=dict)
    data: dict = field(default_factory=dict)
    training: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)
    argv: tuple[str, ...] = ()
    text: str | None = None
    """The whole job file instead of the sections (``{out}`` is replaced by the output dir)."""


def _job(case: Case, tmp: Path) -> Path:
    path = tmp / "job.yaml"
    if case.text is not None:
        path.write_text(case.text.replace("{out}", str(tmp / "out")))
        return path
    model = {"factory": f"{JOBS}:build_lm", **case.model}
    data = {"factory": f"{JOBS}:data", **case.data}
    training = {
        "output_dir": str(tmp / "out"),
        "dp": 1,
        "per_device_train_batch_size": 4,
        "max_steps": 2,
        **case.training,
    }
    path.write_text(yaml.safe_dump({"model": model, "data": data, **case.extra, "training": training}))
    return path


GOOD_TEXT = f"""model:
  factory: {JOBS}:build_lm
data:
  factory: {JOBS}:data
training:
  output_dir: {{out}}
  dp: 1
"""

CASES = {
    # ------------------------------------------------------------------ the job file itself
    "training_is_a_list": Case(
        ("the 'training' section must be a mapping", "got list", "'key: value' lines"),
        text=GOOD_TEXT.split("training:")[0] + "training:\n  - max_steps: 3\n",
    ),
    "training_is_a_string": Case(
        ("the 'training' section must be a mapping", "got str 'max_steps=3'"),
        text=GOOD_TEXT.split("training:")[0] + "training: max_steps=3\n",
    ),
    "duplicate_training_key": Case(
        ("line 9: key 'max_steps' appears twice in one mapping (first at line 8)", "remove one of them"),
        text=GOOD_TEXT + "  max_steps: 3\n  max_steps: 30\n",
    ),
    "duplicate_section": Case(
        ("line 8: key 'model' appears twice in one mapping (first at line 1)",),
        text=GOOD_TEXT + f"model:\n  factory: {JOBS}:build_untyped\n",
    ),
    "yaml_syntax_error": Case(
        ("job.yaml: not valid YAML", "line 8, column 14"), text=GOOD_TEXT + "  max_steps: [3\n"
    ),
    "override_yaml_syntax_error": Case(
        ("override 'training.tp_plan={a: 1'", "not valid YAML"), argv=("training.tp_plan={a: 1",)
    ),
    "loss_is_a_mapping": Case(
        ("'loss' must be 'file.py:function' or 'package.module:function'", "got dict"),
        extra={"loss": {"factory": "x.py:f"}},
    ),
    "seed_too_large": Case(
        ("seed=100000000000000000000000 is invalid", "an integer in [0, 4294967295]"),
        argv=("training.seed=100000000000000000000000",),
    ),
    "seed_in_exponent_notation": Case(
        ("seed='1e23' has the wrong type", "expected int, got str"), argv=("training.seed=1e23",)
    ),
    "comm_timeout_zero": Case(
        ("comm_timeout_s=0.0 is invalid", "a positive number of seconds"), training={"comm_timeout_s": 0}
    ),
    "timeout_flag_negative": Case(("comm_timeout_s=-5.0 is invalid",), argv=("--timeout", "-5")),
    # ------------------------------------------------------------------ output_dir
    "output_dir_is_a_file": Case(
        ("training.output_dir=", "afile' exists and is not a directory", "choose a directory path")
    ),
    "output_dir_under_a_file": Case(("afile' is a file, so the directory cannot be created",)),
    "output_dir_not_writable": Case(
        (
            "training.output_dir='/proc/merak-out' cannot be created",
            "'/proc' is not writable",
            "choose a writable directory",
        ),
        training={"output_dir": "/proc/merak-out"},
    ),
    "resume_latest_without_checkpoint": Case(
        ("--resume latest:", "holds no checkpoint", "--resume auto"), argv=("--resume", "latest")
    ),
    "resume_missing_path": Case(
        (
            "--resume '/nonexistent/step_3': no such checkpoint",
            "pass a step_<N> directory, 'latest' or 'auto'",
        ),
        argv=("--resume", "/nonexistent/step_3"),
    ),
    # ------------------------------------------------------------------ the model
    "model_kwarg_unknown": Case(
        ("model.kwargs.widht: build_lm() takes no argument 'widht'", "did you mean 'width'?"),
        model={"kwargs": {"widht": 8}},
    ),
    "model_kwarg_wrong_type": Case(
        (
            "model.kwargs.width='8' has the wrong type for build_lm(): expected int, got str",
            "fix model.kwargs.width",
        ),
        model={"kwargs": {"width": "8"}},
    ),
    "model_kwarg_nested_not_integer": Case(
        (
            "model.kwargs.depth=2.5 breaks model.factory",
            "'float' object cannot be interpreted as an integer",
            "fix model.kwargs.depth",
        ),
        model={"factory": f"{JOBS}:build_untyped", "kwargs": {"depth": 2.5}},
    ),
    "model_factory_not_a_module": Case(
        ("returned dict, not a torch.nn.Module",), model={"factory": f"{JOBS}:build_not_a_module"}
    ),
    "model_factory_raises": Case(
        (
            "model.factory",
            "build_failing' failed",
            "RuntimeError: weights file model.bin not found",
            "_bad_input_jobs.py:",
        ),
        model={"factory": f"{JOBS}:build_failing"},
    ),
    # ------------------------------------------------------------------ the TP plan
    "tp_plan_pattern_matches_nothing": Case(
        (
            "training.tp_plan: layers pattern 'hiden' matches no module of TinyLM",
            "closest module names: ['hidden']",
        ),
        training={"dp": None, "tp": 2, "tp_plan": {"hiden": "column"}},
        argv=("--nproc-per-node=2",),
    ),
    "tp_does_not_divide_a_size": Case(
        ("training.tp=3 does not divide hidden.out_features=8", "choose a TP degree that divides 8"),
        training={"dp": 1, "tp": 3, "tp_plan": {"hidden": "column", "head": "row"}},
    ),
    "tp_style_on_wrong_module": Case(
        ("training.tp=2, tp_plan 'user': embed: style 'column' needs an nn.Linear", "got Embedding"),
        training={"dp": 1, "tp": 2, "tp_plan": {"embed": "column", "hidden": "row"}},
    ),
    # ------------------------------------------------------------------ data
    "data_factory_returns_int": Case(
        ("data.factory returned int (8) as the training set", "return a dataset"),
        data={"kwargs": {"kind": "int"}},
    ),
    "data_factory_returns_dict": Case(
        (
            "data.factory returned a dict with keys ['eval', 'train']",
            "the pair (train_dataset, eval_dataset)",
        ),
        data={"kwargs": {"kind": "dict"}},
    ),
    "data_empty": Case(("the training set from data.factory is empty",), data={"kwargs": {"kind": "empty"}}),
    "data_factory_raises": Case(
        ("data.factory", "failed with kwargs {'kind': 'failing'}", "FileNotFoundError: data/train.jsonl"),
        data={"kwargs": {"kind": "failing"}},
    ),
    "data_kwarg_wrong_type": Case(
        ("data.kwargs.size='many' has the wrong type for data(): expected int",),
        data={"kwargs": {"size": "many"}},
    ),
    "ragged_samples": Case(
        (
            "samples 0 and 5 of the training set have different shapes at ['input_ids']: [6] vs [4]",
            "pad_sequence",
            "collate: file.py:function",
        ),
        data={"kwargs": {"ragged_at": 5}},
    ),
    "collate_fails": Case(
        (
            "the job's collate function cannot build a batch from the first 4 samples",
            "KeyError: 'attention_mask'",
        ),
        extra={"collate": f"{JOBS}:broken_collate"},
    ),
    "float_labels": Case(
        (
            "labels have dtype torch.float32",
            "cross-entropy) needs integer class ids",
            "'loss: file.py:function'",
        ),
        data={"kwargs": {"label_dtype": "float32"}},
    ),
    "int32_labels": Case(
        ("labels have dtype torch.int32", "needs torch.long (int64) class ids", ".long()"),
        data={"kwargs": {"label_dtype": "int32"}},
    ),
    "float_input_ids": Case(
        ("batch input_ids has dtype torch.float32", "num_embeddings=16", "return integer token ids"),
        data={"kwargs": {"float_ids": True}},
    ),
    "token_id_beyond_vocabulary": Case(
        ("batch input_ids holds token id 16 (sample 1 of the first batch)", "vocabulary of 16 (ids 0..15)"),
        data={"kwargs": {"max_id": 16}},
    ),
    "negative_token_id": Case(
        ("batch input_ids holds token id -3 (sample 1 of the first batch)",), data={"kwargs": {"max_id": -3}}
    ),
    "labels_equal_input_ids_under_shifted": Case(
        (
            "the first training batch has labels equal to its input_ids at every labelled position",
            "the model would learn to copy its input",
            "set data.labels: unshifted",
        ),
        data={"kwargs": {"hf_labels": True}},
    ),
    "data_labels_unknown_value": Case(
        ("data.labels='transformers' is invalid", "expected 'shifted'", "or 'unshifted'"),
        data={"labels": "transformers"},
    ),
    "labels_under_training_disagree": Case(
        (
            "training.labels='unshifted' disagrees with data.labels='shifted'",
            "write it once, as 'data.labels'",
        ),
        data={"labels": "shifted"},
        training={"labels": "unshifted"},
    ),
    "label_beyond_outputs": Case(
        (
            "labels hold class id 99 (sample 2 of the first batch)",
            "outside the model's 16 outputs",
            "-100 to ignore",
        ),
        data={"kwargs": {"bad_label": 99}},
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_merak_train_refuses_bad_input_before_launch(name: str, tmp_path: Path) -> None:
    case = CASES[name]
    (tmp_path / "afile").write_text("")
    if name == "output_dir_is_a_file":
        case = Case(case.words, training={"output_dir": str(tmp_path / "afile")})
    elif name == "output_dir_under_a_file":
        case = Case(case.words, training={"output_dir": str(tmp_path / "afile" / "out")})
    status, err = dry_run_train(_job(case, tmp_path), *case.argv)
    assert status == BAD_INPUT, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("merak train: error: "), err
    for word in case.words:
        assert word in lines[0], (word, lines[0])


def test_table_is_broad() -> None:
    assert len(CASES) >= 30


def test_good_job_passes_every_check(tmp_path: Path) -> None:
    """The checks accept a correct job (TP plan included) and print the torchrun command."""
    case = Case((), training={"dp": 1, "tp": 2, "tp_plan": {"hidden": "column", "head": "row"}})
    status, err = dry_run_train(_job(case, tmp_path))
    assert status == 0, err
    assert not (tmp_path / "out").exists(), "a dry run creates nothing"
    import torch.distributed as dist

    assert not dist.is_initialized(), "the TP check's fake process group is gone"


def test_transformers_labels_pass_with_data_labels_unshifted(tmp_path: Path) -> None:
    """labels = input_ids is refused under the default ``data.labels: shifted`` (a row above) and accepted,
    shifted as the ranks shift them, under ``unshifted``."""
    case = Case((), data={"kwargs": {"hf_labels": True}, "labels": "unshifted"})
    status, err = dry_run_train(_job(case, tmp_path))
    assert status == 0, err


@pytest.mark.slow
@pytest.mark.one_process  # refused before torchrun starts
@pytest.mark.parametrize("name", ["training_is_a_list", "token_id_beyond_vocabulary"])
def test_real_merak_train_prints_the_error_once_and_starts_nothing(name: str, tmp_path: Path) -> None:
    case = CASES[name]
    job = _job(case, tmp_path)
    paths = [str(REPO)] + [
        str(REPO / "packages" / p / "src") for p in ("merak-pipe", "merak-graph", "merak-tp", "merak-core")
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "merak_core.cli", "train", str(job)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == BAD_INPUT, proc.stderr[-3000:]
    errors = re.findall(r"^merak train: error: .*$", proc.stderr, flags=re.M)
    assert len(errors) == 1 and case.words[0] in errors[0], proc.stderr[-3000:]
    assert "launching" not in proc.stderr and "[rank" not in proc.stderr + proc.stdout
