"""The reference models run, trace with torch.fx and torch.export, and agree with their traces."""

from __future__ import annotations

import pytest
import torch
import torch.fx

from tests.support.compare import assert_tensors_close, named_grads, reference_step
from tests.support.models import REFERENCE_MODELS, build_reference

NAMES = sorted(REFERENCE_MODELS)


@pytest.mark.parametrize("name", NAMES)
def test_forward_backward_gives_every_parameter_a_gradient(name: str) -> None:
    ref = REFERENCE_MODELS[name]
    model = build_reference(name)
    out, loss, grads = reference_step(model, ref.make_inputs(2, 8, 0), ref.make_labels(2, 8, 0), ref.loss)
    assert torch.isfinite(loss)
    assert set(grads) == {n for n, _ in model.named_parameters()}
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert out.dtype == torch.float64


@pytest.mark.parametrize("name", NAMES)
def test_fx_symbolic_trace_matches_eager(name: str) -> None:
    ref = REFERENCE_MODELS[name]
    model = build_reference(name)
    gm = torch.fx.symbolic_trace(model)
    inputs = ref.make_inputs(2, 8, 1)
    assert_tensors_close(gm(*inputs), model(*inputs), name=f"{name} fx output")


@pytest.mark.parametrize("name", NAMES)
def test_torch_export_matches_eager(name: str) -> None:
    ref = REFERENCE_MODELS[name]
    model = build_reference(name)
    inputs = ref.make_inputs(2, 8, 2)
    ep = torch.export.export(model, inputs)
    assert_tensors_close(ep.module()(*inputs), model(*inputs), name=f"{name} export output")


def test_gpt_head_is_tied_to_the_input_embedding() -> None:
    model = build_reference("gpt")
    assert model.lm_head.weight is model.wte.weight
    grads = named_grads(reference_step(model, *_gpt_batch(), REFERENCE_MODELS["gpt"].loss) and model)
    assert "lm_head.weight" not in grads and "wte.weight" in grads


def _gpt_batch():
    ref = REFERENCE_MODELS["gpt"]
    return ref.make_inputs(2, 8, 3), ref.make_labels(2, 8, 3)


def test_llama_uses_grouped_query_attention() -> None:
    model = build_reference("llama")
    attn = model.layers[0].self_attn
    assert attn.num_kv_heads < attn.num_heads
    assert attn.k_proj.weight.shape[0] == attn.num_kv_heads * attn.head_dim


def test_bert_padding_is_masked() -> None:
    model = build_reference("bert").eval()
    ids, mask, types = REFERENCE_MODELS["bert"].make_inputs(1, 8, 4)
    mask[:, -1] = 0
    changed = ids.clone()
    changed[:, -1] = (ids[:, -1] + 1) % model.config.vocab_size
    out_a = model(ids, mask, types)[:, :-1]
    out_b = model(changed, mask, types)[:, :-1]
    assert_tensors_close(out_a, out_b, name="outputs at attended positions")
