"""Rank bodies for the transformers tests (tiny, randomly initialised models; no downloads)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

import merak_tp
from merak_tp.shard_spec import get_shard_spec
from tests.support.compare import assert_grads_match, assert_tensors_close, named_grads
from tests.support.hf_models import tiny_decoder_fields, tiny_gpt2_config
from tests.support.models import lm_loss
from tests.tp._bodies import _deferrable, gathered_grads, tp_group

VOCAB = 96


def build(name: str) -> Any:
    import transformers as tf

    common: dict[str, Any] = {"vocab_size": VOCAB}
    if name == "gpt2":
        cfg = tiny_gpt2_config(**common)
        model = tf.GPT2LMHeadModel(cfg)
    elif name in ("llama", "qwen2"):
        cls_cfg, cls = (
            (tf.LlamaConfig, tf.LlamaForCausalLM)
            if name == "llama"
            else (tf.Qwen2Config, tf.Qwen2ForCausalLM)
        )
        heads = {"num_attention_heads": 8, "num_key_value_heads": 4}
        cfg = cls_cfg(**tiny_decoder_fields(VOCAB, tie_word_embeddings=False, **heads))
        model = cls(cfg)
    elif name == "bert":
        cfg = tf.BertConfig(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            max_position_embeddings=64,
            **common,
        )
        model = tf.BertForMaskedLM(cfg)
    else:
        raise ValueError(name)
    return model.double()


def hf_body(name: str, tp: int, chunks: int, sp: bool, vocab_loss: bool) -> dict[str, Any]:
    group = tp_group(tp)
    torch.manual_seed(0)
    ref = build(name)
    model = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (4, 8), generator=g)
    labels = torch.randint(0, VOCAB, (4, 8), generator=g)
    labels[0, :2] = -100
    ref.train()
    model.train()
    out_ref = ref(input_ids=ids, use_cache=False).logits
    loss_ref = lm_loss(out_ref, labels)
    loss_ref.backward()
    merak_tp.parallelize(
        model, group=group, overlap_chunks=chunks, sequence_parallel=sp, vocab_parallel_loss=vocab_loss
    )
    for _step in range(2):
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, use_cache=False).logits
        if vocab_loss:
            loss = merak_tp.vocab_parallel_cross_entropy(out, labels, group=group)
            out_full = merak_tp.gather_from_tp_region(out.detach(), group)
        else:
            loss = lm_loss(out, labels)
            out_full = out
        loss.backward()
    assert_tensors_close(out_full, out_ref.detach(), name="logits")
    assert_tensors_close(loss, loss_ref.detach(), name="loss")
    grads = gathered_grads(model, group)
    for pname, p in model.named_parameters():
        if get_shard_spec(p).transposed:  # a transformers Conv1D, now in Linear layout
            grads[pname] = grads[pname].t()
    assert_grads_match(grads, named_grads(ref))
    for pname, p in model.named_parameters():
        if merak_tp.is_replicated(p):
            gmax = p.grad.clone()  # type: ignore[union-attr]
            dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=group)
            assert_tensors_close(p.grad, gmax, name=f"replicated grad {pname}")  # type: ignore[arg-type]
    return {n: _deferrable(m) for n, m in model.named_modules() if isinstance(m, merak_tp.TPRegion)}
