"""Tiny transformers 5.x models (GPT-2, Llama, Qwen2) train under the 3D Trainer like one process.

A user's ``transformers`` model, built from a small config and randomly
initialised (no download), is handed to ``merak_core.Trainer`` unchanged; the
Trainer picks the built-in TP plan for its type, traces it, cuts it into
pipeline stages and trains. Three optimizer steps (AdamW, warm-up + linear
decay, weight decay, global-norm clipping, 2-4 microbatches) must give the same
losses and the same parameters, by name, as the same training in one process on
the same data, in float64 (tolerances as in ``test_trainer_layouts``). The data
carry an ``attention_mask`` with padding, so the mask travels through the
pipeline as a second input.

Run with ``nox -s transformers`` or ``pytest -m transformers`` (transformers is
an optional extra; without it these tests are skipped, not failed).

Stages traced by torch.export are specialised to the training microbatch, so the Trainer evaluates
them in microbatches of that size (a test below checks it against the single-process reference).
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

from merak_tp.shard_spec import get_shard_spec
from tests.e2e._trainer_support import reference_steps
from tests.support.compare import assert_tensors_close
from tests.support.dist import run_on_ranks
from tests.support.hf_models import tiny_decoder_fields, tiny_gpt2_config

pytestmark = pytest.mark.transformers

VOCAB = 96
SEQ = 8
EVAL_SIZE = 16
MODELS = ("gpt2", "llama", "qwen2")
LAYOUTS = [(2, 1, 2), (2, 2, 1), (1, 1, 4)]
"""Layouts that work for every model: DP x PP (torch.export-traced stages), DP x TP, four stages."""


def build_hf_model(name: str) -> torch.nn.Module:
    """A tiny, randomly initialised causal LM in float64 (same seed, same weights on every rank)."""
    import transformers as tf

    torch.manual_seed(0)
    if name == "gpt2":
        cfg = tiny_gpt2_config(VOCAB, use_cache=False)
        model = tf.GPT2LMHeadModel(cfg)
    elif name in ("llama", "qwen2"):
        cfg_cls, model_cls = (
            (tf.LlamaConfig, tf.LlamaForCausalLM)
            if name == "llama"
            else (tf.Qwen2Config, tf.Qwen2ForCausalLM)
        )
        cfg = cfg_cls(**tiny_decoder_fields(VOCAB, use_cache=False))
        model = model_cls(cfg)
    else:
        raise ValueError(f"unknown model {name!r}; expected one of {MODELS}")
    return model.double()


class PaddedTokens(Dataset):
    """Random token sequences with next-token labels; every third sample is right-padded (mask 0, label -100).

    With ``with_mask=False`` the samples carry no ``attention_mask`` (the padding is then attended to,
    which is fine for a loss comparison: both runs see the same tokens).
    """

    def __init__(self, size: int, seed: int = 0, *, with_mask: bool = True) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (size, SEQ + 1), generator=g)
        self.with_mask = with_mask

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.ids[i, :-1].clone()
        labels = self.ids[i, 1:].clone()
        mask = torch.ones(SEQ, dtype=torch.long)
        if i % 3 == 0:
            mask[SEQ - 2 :] = 0
            labels[SEQ - 3 :] = -100  # the last real token predicts nothing; padding predicts nothing
            ids[SEQ - 2 :] = 0
        if not self.with_mask:
            return {"input_ids": ids, "labels": labels}
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def lm_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over counted tokens, in the logits' own dtype (float64 here)."""
    logits = getattr(output, "logits", output)
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100
    )


def token_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-example share of counted tokens predicted right (a ``compute_metrics`` function)."""
    counted = labels != -100
    hits = (logits.argmax(-1) == labels) & counted
    return {"accuracy": hits.sum(1).double() / counted.sum(1).clamp(min=1)}


def make_args(**overrides: Any) -> Any:
    from merak_core.config import TrainingArguments

    values: dict[str, Any] = dict(
        output_dir=tempfile.mkdtemp(prefix="merak-hf-"),
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-2,
        max_steps=3,
        dtype="float64",
        max_grad_norm=0.5,
        logging_steps=1,
        warmup_steps=1,
        lr_scheduler_type="linear",
        weight_decay=0.1,
        seed=7,
    )
    values.update(overrides)
    return TrainingArguments(**values)


def train_hf_on_ranks(
    name: str, args_kwargs: dict[str, Any], with_mask: bool, metrics: bool = False
) -> tuple[list[float], Any, set[str], float]:
    """Rank body: the Trainer on the HF model; (losses, full state dict on rank 0, transposed names, eval loss).

    The last item names the parameters merak-tp stored transposed (a transformers ``Conv1D`` turned
    into ``Linear`` layout, GPT-2 under TP) are given back in their own layout.
    """
    import torch.distributed as dist

    from merak_core import Trainer

    data = PaddedTokens(48, with_mask=with_mask)
    eval_data = PaddedTokens(EVAL_SIZE, seed=1, with_mask=with_mask)
    trainer = Trainer(
        build_hf_model(name),
        make_args(**args_kwargs),
        data,
        eval_data,
        loss_fn=lm_loss,
        compute_metrics=token_accuracy if metrics else None,
    )
    history = trainer.train()  # evaluates once at the end
    state = trainer.full_state_dict()
    transposed = {name for name, p in trainer.model.named_parameters() if get_shard_spec(p).transposed}
    return (
        [h["loss"] for h in history],
        state if dist.get_rank() == 0 else None,
        transposed,
        trainer.last_eval["eval_loss"],
    )


def reference_training(
    name: str, args_kwargs: dict[str, Any], dp: int, with_mask: bool, eval_micro_batch_size: int | None = None
) -> tuple[list[float], dict[str, Any], float]:
    """The same run in one process: each global batch split into dp * num_microbatches equal chunks.

    The evaluation after training averages the loss of every ``eval_micro_batch_size`` (default:
    ``per_device_eval_batch_size``) chunk of the eval set in order (whole global eval batches only,
    as the Trainer reads them).
    """
    args = make_args(**args_kwargs)
    model = build_hf_model(name)
    data = PaddedTokens(48, with_mask=with_mask)
    params = dict(model.named_parameters())  # tied parameters once

    def microbatch_loss(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        labels = batch.pop("labels")
        return lm_loss(model(**batch), labels)

    losses = reference_steps(model, data, args, dp, microbatch_loss)
    eval_data = PaddedTokens(EVAL_SIZE, seed=1, with_mask=with_mask)
    ebs, num_micro = (
        eval_micro_batch_size or args.per_device_eval_batch_size,
        args.gradient_accumulation_steps,
    )
    usable = len(eval_data) // (ebs * num_micro * dp) * (ebs * num_micro * dp)
    with torch.no_grad():
        chunk_losses = []
        for lo in range(0, usable, ebs):
            batch = torch.utils.data.default_collate([eval_data[i] for i in range(lo, lo + ebs)])
            labels = batch.pop("labels")
            chunk_losses.append(float(lm_loss(model(**batch), labels)))
    return losses, {n: p.detach().clone() for n, p in params.items()}, sum(chunk_losses) / len(chunk_losses)


class Conv1DLayoutError(AssertionError):
    """The full state dict holds a transformers Conv1D weight transposed."""


def _check(
    name: str,
    layout: tuple[int, int, int],
    with_mask: bool,
    eval_micro_batch_size: int | None = None,
    **overrides: Any,
) -> None:
    """Losses, every parameter by name and the final eval loss equal single-process training.

    transformers ``Conv1D`` weights must come back in their own ``[in, out]`` layout.
    """
    dp, tp, pp = layout
    kwargs = dict(dp=dp, tp=tp, pp=pp, gradient_accumulation_steps=max(2, pp), **overrides)
    results = run_on_ranks(dp * tp * pp, train_hf_on_ranks, name, kwargs, with_mask)
    ref_losses, ref_state, ref_eval = reference_training(name, kwargs, dp, with_mask, eval_micro_batch_size)
    losses, state, _, eval_loss = results[0]
    transposed = set().union(*(t for _, _, t, _ in results))
    for rank, (other, _, _, other_eval) in enumerate(results):
        assert other == pytest.approx(losses, rel=1e-12), f"rank {rank} reports other losses"
        assert other_eval == pytest.approx(eval_loss, rel=1e-12), f"rank {rank} reports another eval loss"
    assert losses == pytest.approx(ref_losses, rel=1e-9, abs=1e-12)
    assert eval_loss == pytest.approx(ref_eval, rel=1e-9, abs=1e-12)
    assert sorted(state) == sorted(ref_state)
    for key, ref in ref_state.items():
        value = state[key]
        if key in transposed and tuple(value.shape) != tuple(ref.shape):
            raise Conv1DLayoutError(
                f"{key}: full_state_dict holds the transposed Conv1D weight "
                f"{tuple(value.shape)}, the model has {tuple(ref.shape)}"
            )
        assert_tensors_close(value, ref, name=f"{name} {dp}x{tp}x{pp} param {key}", rtol=1e-8, atol=1e-10)


def _ids(t: tuple[int, int, int]) -> str:
    return "dp{}_tp{}_pp{}".format(*t)


@pytest.mark.parametrize("layout", LAYOUTS, ids=_ids)
@pytest.mark.parametrize("name", MODELS)
def test_hf_model_trains_like_one_process(name: str, layout: tuple[int, int, int]) -> None:
    """Llama and Qwen2 with an attention mask; GPT-2 without one (with one: below)."""
    pytest.importorskip("transformers")
    _check(name, layout, with_mask=name != "gpt2")


@pytest.mark.parametrize("name", MODELS)
def test_hf_model_tp_and_pp(name: str) -> None:
    """TP and PP together: the TP layers stay opaque leaves under torch.export."""
    pytest.importorskip("transformers")
    _check(name, (1, 2, 2), with_mask=name != "gpt2")


@pytest.mark.parametrize("layout", [(2, 1, 2), (2, 2, 1)], ids=_ids)
def test_gpt2_with_attention_mask(layout: tuple[int, int, int]) -> None:
    """Dict inputs go in by keyword: GPT-2's forward(input_ids, past_key_values, attention_mask, ...)."""
    pytest.importorskip("transformers")
    _check("gpt2", layout, with_mask=True)


def test_gpt2_full_state_dict_keeps_conv1d_layout() -> None:
    pytest.importorskip("transformers")
    _check("gpt2", (1, 2, 1), with_mask=False)


def test_hf_evaluate_with_another_batch_size_after_export() -> None:
    """torch.export specialises the stages to the training microbatch: evaluation then runs in
    microbatches of that size whatever per_device_eval_batch_size says (the reference does the same)."""
    pytest.importorskip("transformers")
    _check("llama", (2, 1, 2), with_mask=True, per_device_eval_batch_size=4, eval_micro_batch_size=2)


def test_hf_evaluate_with_metrics_at_pp1() -> None:
    """compute_metrics gets the logits even when the runner hands back a ModelOutput as a dict."""
    pytest.importorskip("transformers")
    kwargs = dict(dp=2, tp=2, pp=1, gradient_accumulation_steps=2, max_steps=1)
    results = run_on_ranks(4, train_hf_on_ranks, "llama", kwargs, True, True)
    assert all(r[3] == pytest.approx(results[0][3], rel=1e-12) for r in results)
