"""LoRA's pure parts, in one process: the config, target matching (PEFT's), the layer's math at tp = 1
(PEFT's), the adapters' initial values at any TP split, the job key."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from merak_core.lora import LoraConfig
from merak_core.lora.apply import apply_lora, logical_name, target_names
from merak_core.lora.init import full_initial_adapter, initialise_adapters
from tests.support.hf_models import tiny_decoder_fields, tiny_gpt2_config


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(r=0), "r=0: the rank must be a positive integer"),
        (dict(r=2.5), "positive integer"),
        (dict(dropout=1.0), r"dropout=1.0: expected a probability in \[0, 1\)"),
        (dict(target_modules=[]), "non-empty list"),
        (dict(target_modules="q_proj"), "expected a list of module names"),
        (dict(target_modules=["all-linear", "q_proj"]), "give it alone"),
        (dict(alpha=float("nan")), "finite number"),
    ],
)
def test_config_refuses(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LoraConfig(**kwargs)


def test_config_scaling_and_job_mapping(tmp_path: Path) -> None:
    config = LoraConfig.from_mapping(
        {"r": 4, "alpha": 8, "target_modules": "all-linear", "from": "ad"}, base_dir=tmp_path
    )
    assert config.scaling == 2.0 and config.all_linear and config.from_dir == str(tmp_path / "ad")
    with pytest.raises(ValueError, match="unknown key model.lora.rank"):
        LoraConfig.from_mapping({"rank": 4})


def test_job_file_model_lora(tmp_path: Path) -> None:
    from merak_core.job import JobConfig

    (tmp_path / "m.py").write_text(
        "import torch\ndef model():\n    return torch.nn.Linear(2, 2)\ndef data():\n    return [(torch.zeros(2), 0)] * 4\n"
    )
    raw = {
        "model": {"factory": "m.py:model", "lora": {"r": 2, "target_modules": ["q"]}},
        "data": {"factory": "m.py:data"},
    }
    job = JobConfig.from_dict(raw, base_dir=str(tmp_path))
    assert job.model.lora == LoraConfig(r=2, target_modules=["q"])
    raw["training"] = {"zero_stage": 3, "dp": 2}  # ZeRO-2/3 shard the adapters alone (tests/e2e/test_lora.py)
    assert JobConfig.from_dict(raw, base_dir=str(tmp_path)).training.zero_stage == 3


def _tiny(name: str) -> nn.Module:
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if name == "gpt2":
        return tf.GPT2LMHeadModel(tiny_gpt2_config(32, n_embd=16, n_head=2, n_positions=16)).eval()
    cfg = tf.LlamaConfig(
        **tiny_decoder_fields(32, hidden_size=16, intermediate_size=32, max_position_embeddings=2048)
    )
    return tf.LlamaForCausalLM(cfg)


@pytest.mark.transformers
@pytest.mark.parametrize(
    ("name", "targets"),
    [
        ("gpt2", "all-linear"),
        ("gpt2", ["c_attn", "mlp.c_proj"]),
        ("llama", "all-linear"),
        ("llama", ["q_proj", "v_proj", "down_proj"]),
        ("llama", ["self_attn.o_proj", "layers.1.mlp.up_proj"]),
    ],
)
def test_targets_are_peft_targets(name: str, targets: str | list[str]) -> None:
    peft = pytest.importorskip("peft")
    ours = target_names(_tiny(name), LoraConfig(r=2, target_modules=targets))
    wrapped = peft.get_peft_model(_tiny(name), peft.LoraConfig(r=2, target_modules=targets))
    theirs = [
        n.removeprefix("base_model.model.")
        for n, m in wrapped.named_modules()
        if isinstance(m, peft.tuners.lora.LoraLayer)
    ]
    assert ours == theirs


@pytest.mark.transformers
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_layer_matches_peft_at_tp1(name: str, dtype: torch.dtype) -> None:
    """Same adapters (B nonzero): the same output and the same adapter gradients as PEFT, in float64; in
    bfloat16 the adapters are float32 as PEFT keeps them (its autocast_adapter_dtype), and the outputs equal."""
    peft = pytest.importorskip("peft")
    targets = ["c_attn", "c_fc"] if name == "gpt2" else ["q_proj", "gate_proj", "o_proj"]
    reference = peft.get_peft_model(
        _tiny(name).to(dtype), peft.LoraConfig(r=3, lora_alpha=6, target_modules=targets)
    )
    ref_adapters = {
        k.removeprefix("base_model.model.").replace(".default", ""): p
        for k, p in reference.named_parameters()
        if "lora_" in k
    }
    with torch.no_grad():
        for p in ref_adapters.values():
            p.normal_(0, 0.1)  # B nonzero, so the adapters change the output
    model = _tiny(name).to(dtype)
    apply_lora(model, LoraConfig(r=3, alpha=6, target_modules=targets))
    ours = {logical_name(n): p for n, p in model.named_parameters() if p.requires_grad}
    assert sorted(ours) == sorted(ref_adapters)
    wide = torch.float32 if dtype == torch.bfloat16 else dtype
    assert all(p.dtype == wide == ref_adapters[k].dtype for k, p in ours.items())
    with torch.no_grad():
        for k, p in ours.items():
            p.copy_(ref_adapters[k])
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(1))
    out, ref = model(input_ids=ids).logits, reference(input_ids=ids).logits
    if dtype == torch.bfloat16:
        assert out.dtype == torch.bfloat16 and torch.equal(out, ref)
        return
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    out.square().sum().backward()
    ref.square().sum().backward()
    for k, p in ours.items():
        assert ref_adapters[k].grad is not None and float(ref_adapters[k].grad.abs().max()) > 0, k
        torch.testing.assert_close(p.grad, ref_adapters[k].grad, rtol=1e-10, atol=1e-12, msg=k)
    assert all(p.grad is None for n, p in model.named_parameters() if not p.requires_grad)


def test_initial_adapters_are_the_same_at_every_tp_split() -> None:
    """A Kaiming-uniform within nn.Linear's bound, B zero; each rank's block of a sectioned split is the
    block of the one whole draw (so the initial adapters do not depend on the layout)."""
    from merak_tp.shard_spec import ShardSpec, set_shard_spec

    full_a = full_initial_adapter("h.0.c_attn.lora_A.weight", (4, 12), seed=7, dtype=torch.float64)
    assert float(full_a.abs().max()) <= 1 / math.sqrt(12) and float(full_a.abs().max()) > 0
    assert full_initial_adapter("h.0.c_attn.lora_A.weight", (4, 12), seed=7, dtype=torch.float64).equal(
        full_a
    )
    assert not full_initial_adapter("h.1.c_attn.lora_A.weight", (4, 12), seed=7, dtype=torch.float64).equal(
        full_a
    )
    spec_a = ShardSpec(1)  # row-parallel A: split on in
    blocks = []
    for rank in range(2):
        a = set_shard_spec(nn.Parameter(torch.empty(4, 6, dtype=torch.float64)), spec_a)
        b = set_shard_spec(
            nn.Parameter(torch.full((8, 4), 9.0, dtype=torch.float64)), ShardSpec(0, (8, 4, 4))
        )
        named = [("h.0.c_attn.lora_A.weight", a), ("h.0.c_attn.lora_B.weight", b), ("h.0.c_attn.weight", b)]
        assert initialise_adapters(named, tp=2, tp_rank=rank, seed=7) == 2
        assert b.eq(0).all()
        blocks.append(a.detach())
    assert torch.equal(torch.cat(blocks, dim=1), full_a)


def test_merge_needs_a_lora_checkpoint() -> None:
    from merak_core.hf.adapters import checkpoint_lora

    with pytest.raises(ValueError, match=r"--merge: checkpoint 'ck' is not a LoRA run's .* drop --merge"):
        checkpoint_lora({"lora": None}, merge=True, checkpoint="ck")
    assert checkpoint_lora({}, merge=False, checkpoint="ck") is None
    assert checkpoint_lora({"lora": {"r": 2, "alpha": 4.0}}, merge=True, checkpoint="ck") == LoraConfig(
        r=2, alpha=4
    )


def test_adapter_dropout_refused_with_sub_pipelined_tp() -> None:
    """Dropout at tp > 1 is exact (tests/core/test_lora_dropout_tp.py) except under sub-pipelined TP, refused."""
    from types import SimpleNamespace

    from merak_core.lora import check_lora_arguments

    drop = LoraConfig(r=2, dropout=0.1, target_modules=["q"])
    check_lora_arguments(tp=2, dp=1, args=SimpleNamespace(zero_stage=3, overlap_chunks=1), config=drop)
    with pytest.raises(ValueError, match=r"dropout=0.1 with training.overlap_chunks=2.*overlap_chunks: 1"):
        check_lora_arguments(tp=2, dp=1, args=SimpleNamespace(zero_stage=0, overlap_chunks=2), config=drop)
    check_lora_arguments(tp=1, dp=1, args=SimpleNamespace(zero_stage=0, overlap_chunks=2), config=drop)
