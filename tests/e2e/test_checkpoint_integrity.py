"""Checkpoint integrity: checksums of every file, verified at load; ``latest`` skips corrupt checkpoints;
a checkpoint with NaN or inf is never committed.

The corruption is the one reported: 16 bytes flipped inside one ``.distcp`` shard, which used
to load silently (values near 1e37, every later loss NaN).
"""

from __future__ import annotations

import json
import logging
import zlib
from pathlib import Path

import pytest
import torch

from tests.e2e import _checkpoint_support as support
from tests.support.dist import run_on_ranks

KWARGS = dict(max_steps=4, save_steps=2)


def _train(tmp_path: Path) -> dict:
    """A pp=2 run with checkpoints at steps 2 and 4 (each stage's rank writes its own shard file)."""
    return run_on_ranks(
        2, support.train_body, "gpt", support.layout_kwargs(1, 1, 2, output_dir=str(tmp_path), **KWARGS)
    )[0]


def test_manifest_lists_every_file_with_its_checksum(tmp_path: Path) -> None:
    _train(tmp_path)
    step = tmp_path / "checkpoints" / "step_4"
    files = json.loads((step / "merak_checkpoint.json").read_text())["files"]
    on_disk = sorted(p.name for p in step.iterdir() if p.name != "merak_checkpoint.json")
    assert sorted(files) == on_disk and ".metadata" in files and "__1_0.distcp" in files
    for name, entry in files.items():
        data = (step / name).read_bytes()
        assert entry == {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}, name


def test_flipped_bytes_in_a_shard_name_the_file_and_step(tmp_path: Path) -> None:
    full = _train(tmp_path)
    root = tmp_path / "checkpoints"
    support.flip_bytes(str(root / "step_4" / "__1_0.distcp"))
    kwargs = support.layout_kwargs(1, 1, 2, output_dir=str(tmp_path), **KWARGS)
    # Named explicitly: a clear error, nothing loaded.
    named = run_on_ranks(2, support.resume_latest_body, "gpt", kwargs, str(root / "step_4"))
    for res in named:
        assert res["error"].startswith("CheckpointCorruptError: ")
        assert "(step 4) is corrupt: file '__1_0.distcp' has crc32" in res["error"]
        assert "the manifest says" in res["error"] and str(root / "step_4") in res["error"]
    # 'latest' falls back to step 2 with one warning naming what it skipped, and the run continues exactly.
    resumed = run_on_ranks(2, support.resume_latest_body, "gpt", kwargs, "latest")
    assert [r["resumed_step"] for r in resumed] == [2, 2]
    warnings = resumed[0]["warnings"]
    assert len(warnings) == 1 and "skipping checkpoint" in warnings[0] and "step_4" in warnings[0]
    assert "'__1_0.distcp'" in warnings[0] and resumed[1]["warnings"] == []  # rank 0 only
    assert resumed[0]["losses"] == {s: full["losses"][s] for s in (3, 4)}
    assert (root / "latest").read_text().strip() == "step_4"  # re-saved, good again
    assert run_on_ranks(2, support.resume_latest_body, "gpt", kwargs, "latest")[0]["warnings"] == []


def test_latest_pointer_path_in_export_skips_corrupt_checkpoints(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from merak_core.checkpoint.weights import export_full_state_dict, read_checkpoint_model

    _train(tmp_path)
    root = tmp_path / "checkpoints"
    good = read_checkpoint_model(root / "latest")
    assert all(torch.equal(good[k], v) for k, v in read_checkpoint_model(root / "step_4").items())
    step_2 = read_checkpoint_model(root / "step_2")
    support.flip_bytes(str(root / "step_4" / "__0_0.distcp"))
    with caplog.at_level(logging.WARNING, logger="merak_core"):
        out = export_full_state_dict(root / "latest", tmp_path / "model.pt")
    assert out is not None and sorted(out) == sorted(step_2)
    assert all(torch.equal(out[k], step_2[k]) for k in step_2)  # step 2's weights, not step 4's
    assert [
        r.getMessage()
        for r in caplog.records
        if "skipping checkpoint" in r.getMessage()
        and "step_4" in r.getMessage()
        and "'__0_0.distcp'" in r.getMessage()
    ]
    from merak_core.checkpoint import CheckpointCorruptError

    with pytest.raises(CheckpointCorruptError, match=r"\(step 4\) is corrupt: file '__0_0.distcp'"):
        read_checkpoint_model(root / "step_4")
    support.flip_bytes(str(root / "step_2" / "__1_0.distcp"))
    with pytest.raises(
        CheckpointCorruptError,
        match=r"no checkpoint under .* verifies; skipped: step_4: .* \| "
        r"step_2: .*'__1_0.distcp'",
    ):
        export_full_state_dict(root, tmp_path / "model2.pt")  # the checkpoints directory means its latest


def test_flipped_metadata_and_missing_shard_are_corrupt(tmp_path: Path) -> None:
    _train(tmp_path)
    root = tmp_path / "checkpoints"
    kwargs = support.layout_kwargs(1, 1, 2, output_dir=str(tmp_path / "other"), **KWARGS)
    support.flip_bytes(str(root / "step_4" / ".metadata"), count=4)
    res = run_on_ranks(2, support.resume_latest_body, "gpt", kwargs, str(root / "step_4"))[0]
    assert "(step 4) is corrupt: file '.metadata' has crc32" in res["error"]
    (root / "step_2" / "__0_0.distcp").unlink()
    res = run_on_ranks(2, support.resume_latest_body, "gpt", kwargs, str(root / "latest"))[0]
    assert "no checkpoint under" in res["error"] and "verifies" in res["error"]
    assert "file '__0_0.distcp' listed in merak_checkpoint.json is missing" in res["error"]
    assert len(res["warnings"]) == 2  # step_4, then step_2, each named once


@pytest.mark.parametrize("where", ["parameter", "optimizer"])
def test_nonfinite_state_is_never_committed(tmp_path: Path, where: str) -> None:
    results = run_on_ranks(2, support.nonfinite_save_body, str(tmp_path), where)
    root = tmp_path / "checkpoints"
    for res in results:  # every rank refuses, whichever rank holds the bad value
        error = res["error"]
        assert error is not None and error.startswith("step 3: refusing to save checkpoint step_3")
        assert "1 tensors hold NaN or inf" in error
        assert "the previous checkpoint step_2 and the 'latest' pointer are unchanged" in error
        expected = "parameter " if where == "parameter" else "optimizer state "
        assert expected in error and ("(rank 1)" if where == "parameter" else "(rank 0)") in error
        assert "exp_avg_sq" in error or where == "parameter"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_2"]
    assert (root / "latest").read_text().strip() == "step_2"


def test_weights_from_the_latest_pointer_into_another_layout(tmp_path: Path) -> None:
    _train(tmp_path)
    root = tmp_path / "checkpoints"
    support.flip_bytes(str(root / "step_4" / "__1_0.distcp"))
    kwargs = support.layout_kwargs(1, 2, 1, output_dir=str(tmp_path / "tp2"), max_steps=2)
    loaded = run_on_ranks(2, support.load_weights_from_checkpoint_body, "gpt", kwargs, str(root / "latest"))[
        0
    ]
    from merak_core.checkpoint.weights import read_checkpoint_model

    expected = read_checkpoint_model(root / "step_2")  # step 4 is corrupt: latest means step 2
    assert sorted(loaded) == sorted(expected) and all(torch.equal(loaded[k], expected[k]) for k in expected)
