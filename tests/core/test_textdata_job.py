"""Text data in a job file: the ``data: {format: ...}`` section, its overrides, and the launch checks that
refuse a bad one before torchrun starts, naming the key and the fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from merak_core.data.text import TokenSamples
from merak_core.data.text.job import job_text_spec
from merak_core.job import JobConfig
from tests.support.text import make_tokenizer, sentences, write_jsonl


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("job")
    make_tokenizer(root / "tok")
    write_jsonl(root / "train.jsonl", [{"body": s} for s in sentences(60, seed=41)])
    return root


def _raw(**data: Any) -> dict[str, Any]:
    section = {
        "format": "jsonl",
        "path": "train.jsonl",
        "text_field": "body",
        "tokenizer": "tok",
        "seq_len": 8,
        "eval_fraction": 0.1,
        "cache_dir": "cache",
    }
    section.update(data)
    return {
        "model": {"factory": "tests.support.text:text_model"},
        "data": section,
        "training": {"dp": 1, "tp": 1, "pp": 1, "per_device_train_batch_size": 2, "max_steps": 1},
    }


def _write(folder: Path, raw: dict[str, Any], name: str = "job.yaml") -> Path:
    path = folder / name
    path.write_text(yaml.safe_dump(raw))
    return path


def test_a_text_section_builds_the_datasets_with_paths_from_the_job_folder(folder: Path) -> None:
    job = JobConfig.from_yaml(_write(folder, _raw()), ["data.seq_len=6"])
    spec = job_text_spec(job)
    assert spec is not None and spec.path == str(folder / "train.jsonl") and spec.seq_len == 6
    train, evaluation = job.build_datasets()
    assert isinstance(train, TokenSamples) and isinstance(evaluation, TokenSamples)
    assert train.seq_len == 6 and train[0]["input_ids"].shape == (6,)
    assert len(evaluation) >= 1 and evaluation.sample_id(0) == len(train)
    assert (
        job_text_spec(
            JobConfig.from_dict(
                {**_raw(), "data": {"factory": "tests.support.text:sentences", "kwargs": {"count": 3}}}
            )
        )
        is None
    )


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"seq_len": 0}, r"data.seq_len=0: expected a positive integer"),
        ({"seqlen": 8}, r"unknown key data.seqlen \(did you mean 'seq_len'\?\)"),
        ({"format": "csv"}, r"data.format='csv': expected one of"),
        ({"factory": "x.py:f"}, r"data has both 'format' \(text data\) and 'factory'"),
    ],
)
def test_bad_keys_are_refused_when_the_job_file_is_read(
    folder: Path, data: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        JobConfig.from_dict(_raw(**data), base_dir=str(folder), source="job.yaml")


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (
            {"path": "missing.jsonl"},
            r"data.path='.*missing.jsonl' does not exist .*point data.path at the jsonl file",
        ),
        ({"tokenizer": "no-tok"}, r"data.tokenizer='.*no-tok' does not exist"),
        (
            {"text_field": "text"},
            r"data.text_field='text': line 1 of .* has no field 'text' \(it has \['body'\]\); "
            r"set data.text_field",
        ),
    ],
)
def test_launch_checks_name_the_key_and_the_fix(
    folder: Path, data: dict[str, Any], match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from merak_core.cli import main
    from merak_core.run.exitcodes import BAD_INPUT

    raw = _raw(**data)
    raw["training"]["output_dir"] = str(folder / "out")
    job = _write(folder, raw, "bad.yaml")
    assert main(["train", str(job), "--dry-run"]) == BAD_INPUT  # the launching process: no torchrun started
    err = capsys.readouterr().err
    assert err.startswith("merak train: error: ")
    import re

    assert re.search(match, err), err


def test_the_launch_checks_catch_a_tokenizer_larger_than_the_model(folder: Path) -> None:
    from merak_core.checks import preflight

    raw = _raw()
    raw["model"]["kwargs"] = {"vocab_size": 100}  # the tokenizer has 300 ids
    raw["training"]["output_dir"] = str(folder / "out")
    with pytest.raises(ValueError, match="outside the model.s vocabulary of 100"):
        preflight(JobConfig.from_dict(raw, base_dir=str(folder)))
