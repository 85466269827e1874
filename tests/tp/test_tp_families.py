"""Every transformers family with a built-in TP plan, parallelized at tp=2, equals the unsharded model.

Logits, loss and every gradient by name (float64; OLMo 2's float32 norms at float32
tolerance), also with sub-pipelined overlap and sequence parallelism where the plan
supports it. Runs in the ``transformers`` nox session.
"""

from __future__ import annotations

import pytest

from tests.support.dist import run_on_ranks

pytest.importorskip("transformers")

from tests.tp import _hf_families as F  # noqa: E402

pytestmark = pytest.mark.transformers


@pytest.mark.parametrize("name", F.FAMILIES)
def test_family_plan_at_tp2(name: str) -> None:
    sharded = run_on_ranks(2, F.family_body, name, 2, 1, False)[0]["sharded"]
    assert sharded, f"{name}: nothing was sharded"


@pytest.mark.parametrize("name", [f for f in F.FAMILIES if f not in F.MOE])
def test_family_plan_with_overlap_and_sequence_parallel(name: str) -> None:
    import merak_tp

    run_on_ranks(2, F.family_body, name, 2, 2, False)
    if merak_tp.plan_for_model(F.build_family(name)).sequence_parallel:
        run_on_ranks(2, F.family_body, name, 2, 1, True)


def test_plans_without_sequence_parallel_refuse_it() -> None:
    import merak_tp

    for name, why in (
        ("mixtral", "its experts block takes every token"),
        ("qwen3_moe", "its experts block"),
        ("opt", "OPTDecoderLayer flattens batch and sequence"),
    ):
        with pytest.raises(
            ValueError,
            match=f"TP plan 'hf_{name}' .* does not support sequence_parallel=True: "
            f"{why}.*training.sequence_parallel: false",
        ):
            merak_tp.parallelize(F.build_family(name), group=None, sequence_parallel=True)


def test_moe_plans_keep_the_experts_opaque_for_tracing() -> None:
    """The experts route tokens with data-dependent shapes (torch.export cannot trace them); their output
    shape follows the input's, so a pipeline tracer keeps them as leaves, with or without TP."""
    import merak_tp

    for name in F.MOE:
        names = merak_tp.trace_leaf_names(F.build_family(name))
        assert names == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"], (name, names)
    assert merak_tp.trace_leaf_names(F.build_family("llama")) == []
    plan = merak_tp.plan_from_mapping({"base": "hf_llama", "trace_leaves": ["*layers.1.mlp"]})
    assert merak_tp.trace_leaf_names(F.build_family("llama"), plan) == ["model.layers.1.mlp"]


def test_gemma_scaled_embedding_keeps_its_scale() -> None:
    """Gemma multiplies its embedding by sqrt(hidden): the vocab-parallel embedding keeps the factor, and a
    plan that does not declare the class is refused instead of dropping it."""
    import copy

    import torch

    import merak_tp

    ref = F.build_family("gemma")
    ids = torch.randint(3, F.VOCAB, (2, 8))
    model = merak_tp.parallelize(copy.deepcopy(ref), group=None)
    assert isinstance(model.model.embed_tokens, merak_tp.VocabParallelEmbedding)
    torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=0, atol=0)
    undeclared = merak_tp.get_plan("hf_gemma").with_options(module_kinds={})
    with pytest.raises(
        ValueError, match="GemmaTextScaledWordEmbedding subclasses nn.Embedding but overrides forward"
    ):
        merak_tp.parallelize(copy.deepcopy(ref), undeclared, group=None)


def test_falcon_multi_query_is_refused() -> None:
    import merak_tp

    model = F.build_family("falcon", new_decoder_architecture=False, multi_query=True)
    with pytest.raises(ValueError, match="multi-query attention .* cannot be split over tp=2"):
        merak_tp.get_plan("hf_falcon").check(model, 2)  # type: ignore[misc]


def test_kv_heads_fewer_than_ranks_is_refused() -> None:
    import merak_tp

    model = F.build_family("llama")
    with pytest.raises(
        ValueError,
        match=r"num_key_value_heads=2 is not divisible by the tensor-parallel size 4 "
        r"\(replicating key/value heads",
    ):
        merak_tp.get_plan("hf_llama").check(model, 4)  # type: ignore[misc]
