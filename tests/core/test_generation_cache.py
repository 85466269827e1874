"""Generation's pure parts in one process: the KV-cached forward against a full-sequence forward
without a cache, token choice (top-k/top-p filtering, seeded row streams) and the refusals."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from merak_core.generation.decode import _check_prompts, _microbatches
from merak_core.generation.decoders import WholeModelDecoder, cache_keyword
from merak_core.generation.sampling import SamplingOptions, filter_scores, next_tokens, row_generators

pytestmark = pytest.mark.transformers


def _tiny(name: str):
    import transformers as tf

    torch.manual_seed(0)
    if name == "gpt2":
        cfg = tf.GPT2Config(vocab_size=50, n_embd=32, n_layer=2, n_head=4, n_positions=64)
        return tf.GPT2LMHeadModel(cfg).double().eval()
    cfg = tf.LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return tf.LlamaForCausalLM(cfg).double().eval()


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_cached_steps_equal_full_forward(name: str) -> None:
    """Prefill of left-padded prompts then 4 cached one-token steps give, at every step, the last
    position's logits of a forward over the whole sequence with no cache (float64, 1e-12)."""
    model = _tiny(name)
    decoder = WholeModelDecoder(model, model.config, model.config.vocab_size)
    ids = torch.randint(1, 50, (3, 6))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    mask[2, :4] = 0
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    cache = decoder.new_cache()
    step_ids, step_pos = ids, pos
    with torch.no_grad():
        for _ in range(5):
            logits = decoder(step_ids, mask, step_pos, cache)
            full = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits[:, -1]
            assert torch.allclose(logits, full, rtol=0, atol=1e-12), (logits - full).abs().max()
            token = logits.argmax(-1, keepdim=True)
            ids = torch.cat([ids, token], 1)
            mask = torch.cat([mask, torch.ones_like(token)], 1)
            pos = torch.cat([pos, pos[:, -1:] + 1], 1)
            step_ids, step_pos = token, pos[:, -1:]
    assert cache.get_seq_length() == ids.shape[1] - 1


def test_forward_without_cache_is_refused() -> None:
    class NoCache(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None):
            return input_ids

    with pytest.raises(ValueError, match="takes no KV cache"):
        cache_keyword(NoCache())


def test_filters_match_transformers_warpers() -> None:
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    torch.manual_seed(1)
    scores = torch.randn(4, 30)
    opts = SamplingOptions(do_sample=True, temperature=0.7, top_k=9, top_p=0.8)
    expected = scores.clone()
    for warper in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(9), TopPLogitsWarper(0.8)):
        expected = warper(None, expected)
    assert torch.equal(filter_scores(scores, opts), expected)


def test_row_streams_do_not_depend_on_the_split() -> None:
    """Row r draws the same token whether it is sampled with the whole batch or in a microbatch."""
    torch.manual_seed(2)
    logits = torch.randn(5, 40)
    opts = SamplingOptions(do_sample=True, temperature=1.3, top_p=0.95, seed=11)
    whole = next_tokens(logits, opts, row_generators(11, 5, torch.device("cpu")))
    gens = row_generators(11, 5, torch.device("cpu"))
    split = torch.cat([next_tokens(logits[:2], opts, gens[:2]), next_tokens(logits[2:], opts, gens[2:])])
    assert torch.equal(whole, split)
    again = next_tokens(logits, opts, row_generators(11, 5, torch.device("cpu")))
    other = next_tokens(logits, opts, row_generators(12, 5, torch.device("cpu")))
    assert torch.equal(whole, again) and not torch.equal(whole, other)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(do_sample=True, temperature=0.0), "temperature=0.0 must be > 0"),
        (dict(top_k=-1), "top_k=-1"),
        (dict(top_p=0.0), "top_p=0.0"),
    ],
)
def test_bad_sampling_options(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingOptions(**kwargs)


def test_prompts_must_be_left_padded() -> None:
    ids = torch.ones(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"rows \[1\] .* right-padded"):
        _check_prompts(ids, torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0]]))
    _check_prompts(ids, torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]))


def test_microbatches_cover_the_rows() -> None:
    assert _microbatches(5, 2, 3) == [slice(0, 1), slice(1, 3), slice(3, 5)]
    assert _microbatches(5, 1, None) == [slice(0, 5)]
    with pytest.raises(ValueError, match="num_microbatches=6"):
        _microbatches(5, 2, 6)


@pytest.mark.parametrize(("stages", "microbatches"), [(2, 1), (2, 3), (3, 2), (4, 5)])
def test_decode_round_is_merak_pipes_validated_forward_round(stages: int, microbatches: int) -> None:
    """Each rank: for every microbatch in order, receive (after the first stage), forward, send (before the
    last); decode_round validated it under NCCL's rules (merak_pipe.validate raises otherwise)."""
    from merak_core.generation.pipeline import decode_round

    rounds = decode_round(stages, microbatches)
    for stage in range(stages):
        expected = []
        for m in range(microbatches):
            expected += [f"{stage}RECV_F{m}"] if stage > 0 else []
            expected += [f"{stage}F{m}"]
            expected += [f"{stage}SEND_F{m}"] if stage < stages - 1 else []
        assert [str(a) for a in rounds[stage]] == expected


def _fake_model(**fields):
    from types import SimpleNamespace

    from merak_core.parallel.compose import ModelSource

    source = ModelSource(object, fields.pop("config", None), None, fields.pop("sequence_parallel", False))
    base = dict(source=source, stage_modules={}, layout=SimpleNamespace(pp=1), lora=None)
    return SimpleNamespace(**{**base, **fields})


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (dict(sequence_parallel=True), "sequence_parallel=true is not supported"),
        (dict(stage_modules={0: None, 2: None}), r"virtual stages \(this rank holds stages \[0, 2\]\)"),
        (dict(layout=SimpleNamespace(pp=2), lora=object()), "LoRA model under pipeline parallelism"),
        (dict(layout=SimpleNamespace(pp=1, cp=2)), r"generation at cp=2 is not supported"),
    ],
)
def test_layouts_generation_refuses(fields: dict, match: str) -> None:
    from merak_core.generation.decode import _refuse_unsupported

    with pytest.raises(ValueError, match=match):
        _refuse_unsupported(_fake_model(**fields))


def test_pipeline_stages_of_other_families_are_refused() -> None:
    from types import SimpleNamespace

    from merak_core.generation.decoders import FAMILIES, _stage_layers, family_of

    config = SimpleNamespace(model_type="gpt_neox")
    with pytest.raises(ValueError, match="this model's type is 'gpt_neox': generate at pp=1"):
        family_of(_fake_model(config=config))
    with pytest.raises(ValueError, match=r"holds decoder layers \[1, 3\]"):
        _stage_layers(["model.layers.1.mlp.weight", "model.layers.3.mlp.weight"], FAMILIES["llama"])
    assert _stage_layers(["model.layers.2.a", "model.layers.3.b", "lm_head.weight"], FAMILIES["llama"]) == [
        2,
        3,
    ]


def test_vocab_sharded_logits_are_refused() -> None:
    from merak_core.generation.decoders import check_vocab

    with pytest.raises(ValueError, match="vocab-sharded"):
        check_vocab(torch.zeros(2, 25), 50)
    check_vocab(torch.zeros(2, 50), 50)


def test_past_the_position_table_is_refused() -> None:
    from merak_core.generation.decode import _check_positions

    model = _fake_model(config=SimpleNamespace(n_positions=10))
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    _check_positions(model, mask, 7)  # positions 0..9 are fed: the 7th new token is only returned
    with pytest.raises(
        ValueError, match=r"longest prompt \(4 tokens\) plus max_new_tokens=8 .*n_positions=10"
    ):
        _check_positions(model, mask, 8)


def test_pp1_decodes_without_dropout_of_a_training_module() -> None:
    """A training run's module is in train mode: generation at pp=1 must not apply its dropout (and
    leaves the mode as it found it)."""
    from types import SimpleNamespace

    import transformers as tf

    from merak_core.generation.decode import generate

    torch.manual_seed(0)
    cfg = tf.GPT2Config(
        vocab_size=50,
        n_embd=16,
        n_layer=2,
        n_head=2,
        n_positions=32,
        resid_pdrop=0.5,
        embd_pdrop=0.5,
        attn_pdrop=0.5,
        bos_token_id=None,
        eos_token_id=None,
    )
    model = tf.GPT2LMHeadModel(cfg).double()
    ids = torch.randint(1, 50, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model.eval().generate(input_ids=ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    model.train()
    fake = _fake_model(
        config=cfg, module=model, layout=SimpleNamespace(pp=1, cp=1, device=torch.device("cpu"))
    )
    for _ in range(3):  # dropout would change the tokens between calls
        assert generate(fake, ids, max_new_tokens=6, pad_token_id=0).tolist() == expected.tolist()
    assert all(m.training for m in model.modules())
