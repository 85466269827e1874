"""Hugging Face folders, checked and sliced in one process (no process group).

Bad folders fail with the path and the fix; a folder that does not fit the model fails before any
collective (:meth:`PretrainedWeights.match`); a rank's TP slice read from a safetensors slice equals
the same block cut from the full tensor, for fused sections of unequal sizes and ``Conv1D``
weights; an exported folder round-trips through :func:`write_hf_folder`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.e2e._pretrained_support import read_folder, save_tiny_model
from tests.support.hf_models import tiny_gpt2_config

GPT2_DROPOUT = {"resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1}  # GPT2Config's defaults

pytestmark = pytest.mark.transformers


def test_folder_errors_name_the_path_and_the_fix(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    from merak_core.hf import PretrainedFolder

    with pytest.raises(ValueError, match="is not a directory.*save_pretrained"):
        PretrainedFolder(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="has no config.json"):
        PretrainedFolder(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        PretrainedFolder(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"neither model.safetensors.*pytorch_model.bin.*safe_serialization"):
        PretrainedFolder(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "model-1.safetensors"}})
    )
    with pytest.raises(
        ValueError, match=r"lists shard files that are not in the folder: \['model-1.safetensors'\]"
    ):
        PretrainedFolder(tmp_path)


def test_sharded_folder_is_read_through_its_index(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from merak_core.hf import PretrainedFolder

    single = read_folder(save_tiny_model("llama", tmp_path / "one"))
    folder = PretrainedFolder(save_tiny_model("llama", tmp_path / "many", max_shard_size="20KB"))
    assert len(folder.files) > 1
    sharded = read_folder(folder.path)
    assert sorted(sharded) == sorted(single)
    assert all(torch.equal(sharded[k], single[k]) for k in single)


def test_match_refuses_a_folder_of_another_model(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    import transformers as tf

    from merak_core.hf import PretrainedWeights, pretrained_model

    folder = save_tiny_model("gpt2", tmp_path / "gpt2")
    model = pretrained_model(folder)
    weights = PretrainedWeights.match(model, folder)
    # The tied head is found under the embedding's name (the folder holds one of the two).
    assert "lm_head.weight" not in weights.file_names and "transformer.wte.weight" in weights.file_names
    assert next(model.parameters()).is_meta
    wider = tf.GPT2LMHeadModel(tiny_gpt2_config(96, n_embd=64, **GPT2_DROPOUT))
    with pytest.raises(
        ValueError, match=r"has shape \[96, 32\], the model built from its config.json has \[96, 64\]"
    ):
        PretrainedWeights.match(wider, folder)
    deeper = tf.GPT2LMHeadModel(tiny_gpt2_config(96, n_layer=3, **GPT2_DROPOUT))
    with pytest.raises(ValueError, match=r"lacks 12 of the model's parameters, e.g. \['transformer.h.2"):
        PretrainedWeights.match(deeper, folder)


def _tagged(
    shape: tuple[int, ...],
    *,
    dim: int | None,
    sections: int = 1,
    section_sizes: tuple[int, ...] | None = None,
    transposed: bool = False,
) -> torch.Tensor:
    from merak_tp.shard_spec import ShardSpec, set_shard_spec

    return set_shard_spec(
        torch.empty(shape, device="meta"), ShardSpec(dim, section_sizes or sections, transposed)
    )


@pytest.mark.parametrize("as_slice", [True, False], ids=["safetensors", "tensor"])
def test_local_shard_of_fused_and_transposed_weights(tmp_path: Path, as_slice: bool) -> None:
    """q/k/v fused with 8 + 4 + 4 rows (grouped-query) and a Conv1D (in, out) weight, at tp=2."""
    safetensors = pytest.importorskip("safetensors")
    from safetensors.torch import save_file

    from merak_core.hf import read_local_shard

    full = {
        "qkv": torch.arange(16 * 3, dtype=torch.float64).reshape(16, 3),
        "conv": torch.arange(6 * 8, dtype=torch.float64).reshape(6, 8),
    }  # Conv1D: (in=6, out=8)
    save_file(full, str(tmp_path / "w.safetensors"))
    handle = safetensors.safe_open(str(tmp_path / "w.safetensors"), framework="pt")
    entry = handle.get_slice if as_slice else full.__getitem__
    for rank in range(2):
        qkv = read_local_shard(
            entry("qkv"), _tagged((8, 3), dim=0, sections=3, section_sizes=(8, 4, 4)), 2, rank
        )
        want = torch.cat(
            [
                full["qkv"][rank * 4 : rank * 4 + 4],
                full["qkv"][8 + rank * 2 : 10 + rank * 2],
                full["qkv"][12 + rank * 2 : 14 + rank * 2],
            ]
        )
        assert torch.equal(qkv, want)
        # Column-parallel Linear layout (out, in) = (4, 6) per rank, from the (in, out) file tensor.
        conv = read_local_shard(entry("conv"), _tagged((4, 6), dim=0, transposed=True), 2, rank)
        assert torch.equal(conv, full["conv"][:, rank * 4 : rank * 4 + 4].t())
        assert torch.equal(read_local_shard(entry("conv"), _tagged((6, 8), dim=None), 2, rank), full["conv"])


def test_write_hf_folder_round_trips_and_copies_the_tokenizer(tmp_path: Path) -> None:
    tf = pytest.importorskip("transformers")
    from merak_core.hf import PretrainedFolder, write_hf_folder

    source = save_tiny_model("gpt2", tmp_path / "src")
    (source / "tokenizer.json").write_text('{"version": "1.0"}')
    state = read_folder(source)
    out = write_hf_folder(state, tmp_path / "out", source=PretrainedFolder(source), max_shard_size="30KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and sorted(index["weight_map"]) == sorted(state)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())
    assert json.loads((out / "config.json").read_text())["dtype"] == "float64"
    assert (out / "tokenizer.json").read_text() == '{"version": "1.0"}'
    back = read_folder(out)
    assert all(torch.equal(back[k], state[k]) for k in state)
    loaded = tf.AutoModelForCausalLM.from_pretrained(str(out))
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    # A second export into the same folder as one file leaves no stale shard behind.
    write_hf_folder(state, out, source=PretrainedFolder(source))
    assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors"]


def test_a_state_is_checked_against_the_model_of_the_config(tmp_path: Path) -> None:
    """``merak export --pretrained``: names and shapes against the model config.json builds, before writing."""
    pytest.importorskip("transformers")
    from merak_core.hf import PretrainedFolder
    from merak_core.hf.export import check_state_fits

    gpt2 = PretrainedFolder(save_tiny_model("gpt2", tmp_path / "gpt2"))
    llama = PretrainedFolder(save_tiny_model("llama", tmp_path / "llama"))
    state = read_folder(gpt2.path)
    check_state_fits(
        state, gpt2, checkpoint="ckpt"
    )  # the folder's own tensors: the tied lm_head is one of them
    with pytest.raises(ValueError) as info:
        check_state_fits(state, llama, checkpoint="ckpt")
    message = str(info.value)
    assert message.startswith(
        f"checkpoint 'ckpt' does not hold the model {str(llama.path / 'config.json')!r}"
    )
    assert "(LlamaForCausalLM)" in message and "28 of its 28 tensors are not in that model" in message
    assert "of the model's parameters are not in the checkpoint, e.g. ['lm_head.weight'" in message
    # The same names at another width: the first shape that differs is named.
    config = json.loads((gpt2.path / "config.json").read_text())
    wider = tmp_path / "wider"
    wider.mkdir()
    (wider / "config.json").write_text(json.dumps({**config, "n_embd": 64}))
    for name in ("model.safetensors",):
        (wider / name).write_bytes((gpt2.path / name).read_bytes())
    with pytest.raises(
        ValueError,
        match=r"shapes differ, e\.g\. 'transformer\.h\.0\.attn\.c_attn\.bias' is \[96\] in "
        r"the checkpoint, \[192\] in the model",
    ):
        check_state_fits(state, PretrainedFolder(wider), checkpoint="ckpt")
