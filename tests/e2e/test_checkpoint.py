"""DCP checkpoints: bit-identical resume, resharding across layouts, atomic commit, retention, bad checkpoints.

Every comparison is against an uninterrupted run of the same job (float64 reference
models): resume under the same layout must reproduce every later loss bit for bit;
a checkpoint loaded under another layout must give the same logical parameters
exactly and the same next losses to rounding.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.e2e import _checkpoint_support as support
from tests.support.compare import assert_tensors_close
from tests.support.dist import WorkerError, run_on_ranks


def _world(dp: int, tp: int, pp: int) -> int:
    return dp * tp * pp


def _assert_states_equal(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str
) -> None:
    assert sorted(actual) == sorted(expected), what
    for key in expected:
        assert torch.equal(actual[key], expected[key]), f"{what}: {key} differs"


@pytest.mark.parametrize("layout", [(2, 1, 2), (2, 2, 2)], ids=lambda t: "dp{}_tp{}_pp{}".format(*t))
def test_resume_is_bit_identical(tmp_path: Path, layout: tuple[int, int, int]) -> None:
    dp, tp, pp = layout
    zero = 1 if tp > 1 else 0  # one case with ZeRO-1 sharded optimizer states
    kwargs = support.layout_kwargs(
        dp, tp, pp, output_dir=str(tmp_path), max_steps=4, save_steps=2, zero_stage=zero
    )
    full = run_on_ranks(_world(*layout), support.train_body, "gpt", kwargs)
    assert full[0]["checkpoints"] == ["step_2", "step_4"]
    resumed = run_on_ranks(_world(*layout), support.train_body, "gpt", kwargs, "step_2")
    assert resumed[0]["resumed_step"] == 2
    for rank, (a, b) in enumerate(zip(full, resumed, strict=True)):
        assert sorted(b["losses"]) == [3, 4]
        for step in (3, 4):
            assert b["losses"][step] == a["losses"][step], f"rank {rank} step {step}: not bit-identical"
    _assert_states_equal(resumed[0]["final_state"], full[0]["final_state"], "final parameters")


RESHARD = [((2, 2, 2), (1, 2, 4)), ((2, 2, 2), (1, 1, 1)), ((1, 1, 1), (2, 2, 2))]


@pytest.mark.parametrize("case", RESHARD, ids=lambda c: "{}x{}x{}_to_{}x{}x{}".format(*c[0], *c[1]))
def test_reshard_across_layouts(
    tmp_path: Path, case: tuple[tuple[int, int, int], tuple[int, int, int]]
) -> None:
    src, dst = case
    name = "llama" if src == (1, 1, 1) else "gpt"  # tied embeddings across stages / GQA sharded over TP
    common = dict(output_dir=str(tmp_path), max_steps=4, save_steps=2, zero_stage=1)
    full = run_on_ranks(_world(*src), support.train_body, name, support.layout_kwargs(*src, **common))
    saved = support.saved_state_body(str(tmp_path / "checkpoints" / "step_2"))
    common["output_dir"] = str(tmp_path / "resharded")
    resumed = run_on_ranks(
        _world(*dst),
        support.train_body,
        name,
        support.layout_kwargs(*dst, **common),
        str(tmp_path / "checkpoints" / "step_2"),
    )
    head = resumed[0]
    assert head["resumed_step"] == 2
    _assert_states_equal(head["loaded_state"], saved, f"logical parameters after loading under {dst}")
    for step in (3, 4):
        assert head["losses"][step] == pytest.approx(full[0]["losses"][step], rel=1e-11, abs=1e-12), step
    for key, ref in full[0]["final_state"].items():
        assert_tensors_close(
            head["final_state"][key], ref, name=f"{src}->{dst} final {key}", rtol=1e-8, atol=1e-10
        )


@pytest.mark.transformers
def test_reshard_transformers_gpt2_fused_and_transposed(tmp_path: Path) -> None:
    """GPT-2's c_attn is a fused (3 sections) Conv1D: gathered over TP, saved in (in, out) orientation."""
    pytest.importorskip("transformers")
    from tests.tp._hf_bodies import build

    common = dict(output_dir=str(tmp_path), max_steps=4, save_steps=2)
    full = run_on_ranks(2, support.train_body, "hf_gpt2", support.layout_kwargs(1, 2, 1, **common))
    saved = support.saved_state_body(str(tmp_path / "checkpoints" / "step_2"))
    model = build("gpt2")
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert {name: tuple(t.shape) for name, t in saved.items()} == shapes  # the unsharded model's layout
    common["output_dir"] = str(tmp_path / "tp1")
    resumed = run_on_ranks(
        1,
        support.train_body,
        "hf_gpt2",
        support.layout_kwargs(1, 1, 1, **common),
        str(tmp_path / "checkpoints" / "step_2"),
    )[0]
    _assert_states_equal(resumed["loaded_state"], saved, "tp=1 parameters after loading the tp=2 checkpoint")
    for step in (3, 4):
        assert resumed["losses"][step] == pytest.approx(full[0]["losses"][step], rel=1e-11), step


def test_resume_other_optimizer_and_non_tensor_state(tmp_path: Path) -> None:
    full = run_on_ranks(1, support.sgd_body, str(tmp_path), False)[0]
    resumed = run_on_ranks(1, support.sgd_body, str(tmp_path), True)[0]
    assert resumed["note"] == ("a non-tensor state", 1)
    assert resumed["losses"] == {s: full["losses"][s] for s in (3, 4)}
    assert torch.equal(resumed["momentum"], full["momentum"])


def test_full_state_of_checkpoint_equals_trainer(tmp_path: Path) -> None:
    kwargs = support.layout_kwargs(1, 2, 2, output_dir=str(tmp_path), max_steps=2, save_steps=2)
    full = run_on_ranks(4, support.train_body, "llama", kwargs)
    saved = support.saved_state_body(str(tmp_path / "checkpoints" / "step_2"))
    _assert_states_equal(saved, full[0]["final_state"], "checkpoint model vs Trainer.full_state_dict")


def test_import_export_round_trip(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    save = support.layout_kwargs(1, 2, 2, output_dir=str(tmp_path / "a"), max_steps=2)
    load = support.layout_kwargs(2, 1, 2, output_dir=str(tmp_path / "b"), max_steps=2)
    res = run_on_ranks(4, support.import_export_body, "gpt", save, load, str(tmp_path))[0]
    _assert_states_equal(res["exported"], res["trained"], "exported vs trained")
    for key in ("imported_pt", "imported_safetensors", "imported_dict"):
        _assert_states_equal(res[key], res["trained"], key)
    assert any(not torch.equal(res["before_pt"][k], res["trained"][k]) for k in res["trained"])
    # The exported file is a plain single-device state dict of the unsharded model (a tied parameter
    # appears once, under its first name, as transformers' safetensors files do).
    model = support.build_model("gpt")
    result = model.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True), strict=False)
    assert result.unexpected_keys == [] and result.missing_keys == ["lm_head.weight"]
    assert model.lm_head.weight is model.wte.weight
    _assert_states_equal({k: p.detach() for k, p in model.named_parameters()}, res["trained"], "plain model")
    from safetensors.torch import load_file

    _assert_states_equal(load_file(str(tmp_path / "model.safetensors")), res["trained"], "safetensors file")


def test_export_from_checkpoint_directory(tmp_path: Path) -> None:
    from merak_core.checkpoint.weights import export_full_state_dict

    kwargs = support.layout_kwargs(1, 1, 2, output_dir=str(tmp_path), max_steps=2, save_steps=2)
    full = run_on_ranks(2, support.train_body, "gpt", kwargs)
    out = export_full_state_dict(tmp_path / "checkpoints" / "step_2", tmp_path / "exported.pt")
    assert out is not None
    _assert_states_equal(
        torch.load(tmp_path / "exported.pt", weights_only=True), full[0]["final_state"], "export"
    )


def test_retention_and_latest_pointer(tmp_path: Path) -> None:
    kwargs = support.layout_kwargs(
        1, 1, 2, output_dir=str(tmp_path), max_steps=5, save_steps=2, save_total_limit=2
    )
    full = run_on_ranks(2, support.train_body, "gpt", kwargs)
    root = tmp_path / "checkpoints"
    # Saves at 2, 4 and the final step 5; the limit keeps the newest two.
    assert full[0]["checkpoints"] == ["step_4", "step_5"]
    assert sorted(os.listdir(root)) == ["latest", "step_4", "step_5"]
    assert (root / "latest").read_text().strip() == "step_5"
    meta = json.loads((root / "step_5" / "merak_checkpoint.json").read_text())
    assert meta["step"] == 5 and meta["layout"] == {"dp": 1, "tp": 1, "pp": 2, "world_size": 2}
    assert meta["training_arguments"]["save_total_limit"] == 2
    assert "wte.weight" in meta["fingerprint"]
    # Resuming the finished run trains nothing and re-saves step 5 in place (swap through step_5.old).
    again = run_on_ranks(2, support.train_body, "gpt", kwargs, "latest")[0]
    assert again["resumed_step"] == 5 and again["losses"] == {}
    assert sorted(os.listdir(root)) == ["latest", "step_4", "step_5"]
    _assert_states_equal(
        support.saved_state_body(str(root / "step_5")), full[0]["final_state"], "re-saved step 5"
    )


def test_save_killed_midway_leaves_previous_checkpoint(tmp_path: Path) -> None:
    kwargs = support.layout_kwargs(1, 1, 2, output_dir=str(tmp_path), max_steps=4, save_steps=2)
    with pytest.raises(WorkerError, match="rank 1 died"):
        run_on_ranks(2, support.die_during_save_body, "gpt", kwargs, 1, 4)
    root = tmp_path / "checkpoints"
    assert (root / "step_2").is_dir() and not (root / "step_4").exists()
    assert (root / "latest").read_text().strip() == "step_2"
    # The interrupted save is never committed. Rank 0's DCP write fails once its peer is gone and then
    # removes the partial directory, unless the harness stops rank 0 first: either way nothing partial
    # may be loaded as a checkpoint.
    if (root / "step_4.tmp").is_dir():
        message = run_on_ranks(2, support.load_error_body, str(tmp_path / "x"), str(root / "step_4.tmp"))[0]
        assert "is partial" in message and "step_4.tmp" in message
    # The previous checkpoint still resumes; the run finishes like an uninterrupted one.
    resumed = run_on_ranks(2, support.train_body, "gpt", kwargs, "latest")
    reference = run_on_ranks(2, support.train_body, "gpt", dict(kwargs, output_dir=str(tmp_path / "ref")))
    assert resumed[0]["resumed_step"] == 2
    assert resumed[0]["losses"] == {s: reference[0]["losses"][s] for s in (3, 4)}
    assert not (root / "step_4.tmp").exists() and (root / "latest").read_text().strip() == "step_4"


def test_bad_checkpoints_raise_clear_errors(tmp_path: Path) -> None:
    other = tmp_path / "other"
    run_on_ranks(
        1,
        support.train_body,
        "llama",
        support.layout_kwargs(1, 1, 1, output_dir=str(other), max_steps=1, save_steps=1),
    )
    errors = run_on_ranks(
        1, support.error_body, str(tmp_path / "run"), str(other / "checkpoints" / "step_1")
    )[0]
    assert "no checkpoint to resume from" in errors["latest_missing"]
    assert "does not exist" in errors["no_such_dir"] and "nope" in errors["no_such_dir"]
    assert "was written for another model" in errors["other_model"]
    assert "parameters missing from the checkpoint" in errors["other_model"]
    assert str(other / "checkpoints" / "step_1") in errors["other_model"]
    assert errors["auto_none"] == "0"
    # Corrupt: a data file truncated, the metadata deleted.
    step = other / "checkpoints" / "step_1"
    data = sorted(step.glob("*.distcp"))[0]
    data.write_bytes(data.read_bytes()[:100])
    message = run_on_ranks(1, support.load_error_body, str(tmp_path / "y"), str(step), "llama")[0]
    assert "(step 1) is corrupt" in message and str(step) in message
    assert f"file {data.name!r} has 100 bytes, the manifest says" in message
    (step / ".metadata").unlink()
    message = run_on_ranks(1, support.load_error_body, str(tmp_path / "y"), str(step), "llama")[0]
    assert "is partial: DCP's .metadata file is missing" in message
