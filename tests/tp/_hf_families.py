"""Tiny random transformers models of every family with a built-in TP plan (float64, no downloads).

Every config has 4 query heads and 2 key/value heads where the family has grouped-query
attention, hidden size 32, vocabulary 96 and 2 layers, so tp=2 splits every size.
"""

from __future__ import annotations

from typing import Any

import torch

from merak_tp.shard_spec import get_shard_spec
from tests.support.hf_models import tiny_decoder_fields, tiny_gpt2_config

VOCAB = 96

FAMILIES = (
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "gemma",
    "gemma2",
    "gemma3_text",
    "phi3",
    "gpt2",
    "gpt_neox",
    "falcon",
    "olmo2",
    "starcoder2",
    "bert",
    "opt",
)
MOE = ("mixtral", "qwen3_moe")

_DECODER = tiny_decoder_fields(VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_NO_DROPOUT = dict(attention_dropout=0.0)


def _config(name: str) -> tuple[Any, Any]:
    import transformers as tf

    decoder = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM, {}),
        "mixtral": (
            tf.MixtralConfig,
            tf.MixtralForCausalLM,
            dict(num_local_experts=4, num_experts_per_tok=2, experts_implementation="eager"),
        ),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {}),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(head_dim=8)),
        "qwen3_moe": (
            tf.Qwen3MoeConfig,
            tf.Qwen3MoeForCausalLM,
            dict(
                head_dim=8,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=16,
                norm_topk_prob=True,
                experts_implementation="eager",
            ),
        ),
        "gemma": (tf.GemmaConfig, tf.GemmaForCausalLM, dict(head_dim=8)),
        "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM, dict(head_dim=8)),
        "gemma3_text": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, dict(head_dim=8, sliding_window=4)),
        "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM, dict(resid_pdrop=0.0, embd_pdrop=0.0)),
        "olmo2": (tf.Olmo2Config, tf.Olmo2ForCausalLM, {}),
        "starcoder2": (
            tf.Starcoder2Config,
            tf.Starcoder2ForCausalLM,
            dict(residual_dropout=0.0, embedding_dropout=0.0),
        ),
    }
    if name in decoder:
        cfg_cls, model_cls, extra = decoder[name]
        return cfg_cls(**{**_DECODER, **_NO_DROPOUT, **extra}), model_cls
    if name == "gpt2":
        return tiny_gpt2_config(VOCAB), tf.GPT2LMHeadModel
    if name == "gpt_neox":
        return tf.GPTNeoXConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        ), tf.GPTNeoXForCausalLM
    if name == "falcon":
        return tf.FalconConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_kv_heads=2,
            new_decoder_architecture=True,
            alibi=False,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        ), tf.FalconForCausalLM
    if name == "opt":
        return tf.OPTConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            word_embed_proj_dim=32,
            dropout=0.0,
            attention_dropout=0.0,
            pad_token_id=0,
        ), tf.OPTForCausalLM
    if name == "bert":
        return tf.BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            max_position_embeddings=64,
        ), tf.BertForMaskedLM
    raise ValueError(f"unknown family {name!r}; expected one of {FAMILIES}")


def build_family(name: str, *, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A tiny random ``name`` model in float64 with ``use_cache=False`` (same seed, same weights)."""
    cfg, model_cls = _config(name)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    cfg.use_cache = False
    torch.manual_seed(seed)
    return model_cls(cfg).double()


FLOAT32_INSIDE = ("olmo2", "mixtral", "gemma", "gemma2", "gemma3_text")
"""Families whose norms (OLMo 2, Gemma) or router (Mixtral) compute in float32 whatever the model's dtype."""


def tolerance(name: str) -> dict[str, float]:
    """float32 tolerances for the families of ``FLOAT32_INSIDE``; the float64 defaults otherwise."""
    return {"rtol": 1e-5, "atol": 1e-6} if name in FLOAT32_INSIDE else {}


def family_body(name: str, tp: int, chunks: int, sp: bool, plan: Any = None) -> dict[str, Any]:
    """Rank body: the family's built-in plan at ``tp`` equals the unsharded model (logits, loss, every grad)."""
    import copy

    import torch.distributed as dist

    import merak_tp
    from tests.support.compare import assert_grads_match, assert_tensors_close, named_grads
    from tests.support.models import lm_loss
    from tests.tp._bodies import gathered_grads, tp_group

    group = tp_group(tp)
    tol = tolerance(name)
    ref = build_family(name)
    model = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, VOCAB, (4, 8), generator=g)
    labels = torch.randint(0, VOCAB, (4, 8), generator=g)
    labels[0, :2] = -100
    ref.train()
    model.train()
    out_ref = ref(input_ids=ids).logits
    loss_ref = lm_loss(out_ref, labels)
    loss_ref.backward()
    if isinstance(plan, dict):
        plan = merak_tp.plan_from_mapping(plan)
    merak_tp.parallelize(model, plan, group=group, overlap_chunks=chunks, sequence_parallel=sp)
    for _step in range(2):
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids).logits
        loss = lm_loss(out, labels)
        loss.backward()
    assert_tensors_close(out, out_ref.detach(), name=f"{name} logits", **tol)
    assert_tensors_close(loss, loss_ref.detach(), name=f"{name} loss", **tol)
    grads = gathered_grads(model, group)
    for pname, p in model.named_parameters():
        if get_shard_spec(p).transposed:
            grads[pname] = grads[pname].t()
    assert_grads_match(grads, named_grads(ref), **tol)
    for pname, p in model.named_parameters():
        if merak_tp.is_replicated(p):
            gmax = p.grad.clone()  # type: ignore[union-attr]
            dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=group)
            assert_tensors_close(p.grad, gmax, name=f"replicated grad {pname}")  # type: ignore[arg-type]
    return {"sharded": sorted(n for n, p in model.named_parameters() if not merak_tp.is_replicated(p))}
