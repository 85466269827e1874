"""Tiny, randomly initialised transformers 5.x models trace, shard and partition exactly.

No weights are downloaded: every model is built from a small config. Run with
``nox -s transformers`` (installs the optional extra) or ``pytest -m transformers``.
"""

from __future__ import annotations

import pytest
import torch

from merak_graph import empty_init, is_meta_module, partition
from tests.graph._graph_support import run_stages
from tests.support.compare import assert_grads_match, assert_tensors_close, named_grads
from tests.support.hf_models import tiny_decoder_fields, tiny_gpt2_config

pytestmark = pytest.mark.transformers

VOCAB = 99


def _configs():  # type: ignore[no-untyped-def]
    t = pytest.importorskip("transformers")
    common = dict(vocab_size=VOCAB, max_position_embeddings=64)
    return {
        "gpt2": (
            lambda: tiny_gpt2_config(VOCAB, bos_token_id=0, eos_token_id=0),
            t.GPT2LMHeadModel,
            True,
        ),
        "llama": (
            lambda: t.LlamaConfig(**tiny_decoder_fields(VOCAB)),
            t.LlamaForCausalLM,
            False,
        ),
        "bert": (
            lambda: t.BertConfig(
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=64,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
                **common,
            ),
            t.BertForMaskedLM,
            True,
        ),
        "opt": (
            lambda: t.OPTConfig(
                hidden_size=32,
                num_hidden_layers=2,
                ffn_dim=64,
                num_attention_heads=4,
                dropout=0.0,
                word_embed_proj_dim=32,
                **common,
            ),
            t.OPTForCausalLM,
            True,
        ),
        "qwen2": (
            lambda: t.Qwen2Config(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                **common,
            ),
            t.Qwen2ForCausalLM,
            False,
        ),
    }


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 8), generator=g)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 6:] = 0  # padding in the second sequence
    return {"input_ids": ids, "attention_mask": mask}


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "opt", "qwen2"])
def test_tiny_model_stages_match_logits_and_grads(name: str) -> None:
    make_config, cls, tied = _configs()[name]
    torch.manual_seed(0)
    model = cls(make_config()).double()
    inputs = _inputs()
    labels = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))

    model.zero_grad(set_to_none=True)
    ref_logits = model(**inputs, use_cache=False).logits
    ref_loss = _loss(ref_logits, labels)
    ref_loss.backward()
    ref_grads = named_grads(model)

    part = partition(model, 3, example_inputs=inputs, static_kwargs={"use_cache": False})
    stages = [part.build_stage(i, device="cpu", state_dict=model.state_dict()) for i in range(3)]
    out, loss, grads = run_stages(part, stages, tuple(inputs.values()), labels, _loss)
    assert_tensors_close(out, ref_logits.detach(), name=f"{name} logits")
    assert_tensors_close(loss, ref_loss.detach(), name=f"{name} loss")
    assert_grads_match(grads, ref_grads)
    shared = {g.name: {s for s, _ in g.stages} for g in part.shared_parameters}
    if tied:
        (embedding,) = shared
        assert model.get_parameter(embedding) is model.get_output_embeddings().weight
        assert shared[embedding] == {0, 2}
    else:
        assert shared == {}


def test_meta_built_llama_is_partitioned_and_one_stage_built() -> None:
    make_config, cls, _ = _configs()["llama"]
    torch.manual_seed(0)
    real = cls(make_config()).double()
    with empty_init():
        meta = cls(make_config()).double()
    inputs = _inputs()
    part = partition(
        meta,
        2,
        example_inputs={k: v.to("meta") for k, v in inputs.items()},
        static_kwargs={"use_cache": False},
    )
    stages = [part.build_stage(i, device="cpu", state_dict=real.state_dict()) for i in range(2)]
    assert is_meta_module(meta)
    out = stages[1](*stages[0](*inputs.values()))
    assert_tensors_close(out, real(**inputs, use_cache=False).logits, name="logits")
    # Without a checkpoint, the model's own _init_weights initialises the stage.
    fresh = part.build_stage(1, device="cpu", init_fn=meta._init_weights)
    assert not is_meta_module(fresh)
    assert all(torch.isfinite(p).all() for p in fresh.parameters())


def test_llama_with_opaque_leaf_modules_via_export() -> None:
    """The trainer's case: modules kept whole (as tensor-parallel layers would be) in a transformers model."""
    t = pytest.importorskip("transformers")
    make_config, cls, _ = _configs()["llama"]
    torch.manual_seed(0)
    model = cls(make_config()).double()
    inputs = _inputs()
    labels = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    model.zero_grad(set_to_none=True)
    ref_logits = model(**inputs, use_cache=False).logits
    ref_loss = _loss(ref_logits, labels)
    ref_loss.backward()
    ref_grads = named_grads(model)

    leaf = t.models.llama.modeling_llama.LlamaMLP
    part = partition(
        model, 2, example_inputs=inputs, static_kwargs={"use_cache": False}, leaf_modules=(leaf,)
    )
    assert part.graph_module.meta["merak_trace_method"] == "export"
    calls = [n.target for n in part.graph_module.graph.nodes if n.op == "call_module"]
    assert calls == ["model.layers.0.mlp", "model.layers.1.mlp"]
    stages = [part.build_stage(i, device="cpu", state_dict=model.state_dict()) for i in range(2)]
    out, loss, grads = run_stages(part, stages, tuple(inputs.values()), labels, _loss)
    assert_tensors_close(out, ref_logits.detach(), name="logits")
    assert_grads_match(grads, ref_grads)
