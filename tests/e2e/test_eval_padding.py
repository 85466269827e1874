"""Evaluation counts every sample once: the last partial batch is padded and masked, an eval set smaller
than one global batch works, and the metrics equal a single-process pass over every sample.

[Note: eval weighting] (``merak_core.run.evaluation``): with a loss that averages over samples (every
TokenDataset sample has the same number of counted tokens, so the token mean of a microbatch is
the mean of its samples' losses), ``eval_loss`` is the mean of the per-sample losses.
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch

from tests.e2e._checkpoint_support import layout_kwargs
from tests.e2e._trainer_support import TokenDataset, build_model, make_args
from tests.support.dist import run_on_ranks
from tests.support.models import lm_loss


def token_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per example: the share of counted tokens predicted right."""
    counted = labels != -100
    hits = (logits.argmax(-1) == labels) & counted
    return {"accuracy": hits.sum(1).double() / counted.sum(1)}


def eval_body(dp: int, pp: int, size: int, train_steps: int) -> dict[str, Any]:
    from merak_core import Trainer

    args = make_args(
        **layout_kwargs(
            dp,
            1,
            pp,
            per_device_eval_batch_size=2,
            max_steps=max(1, train_steps),
            output_dir=tempfile.mkdtemp(prefix="merak-eval-"),
        )
    )
    model = build_model("gpt")
    vocab = model.config.vocab_size
    trainer = Trainer(
        model,
        args,
        TokenDataset(64, vocab),
        TokenDataset(size, vocab, seed=1),
        loss_fn=lm_loss,
        compute_metrics=token_accuracy,
    )
    if train_steps:
        trainer.train()  # evaluates at the end, before the final save
        return {
            "last_eval": trainer.last_eval,
            "evaluate": trainer.evaluate(),
            "state": trainer.full_state_dict(),
        }
    return {"evaluate": trainer.evaluate()}


def _reference(size: int, state: dict[str, torch.Tensor] | None = None) -> dict[str, float]:
    model = build_model("gpt")
    if state is not None:
        model.load_state_dict(state, strict=False)
    data = TokenDataset(size, model.config.vocab_size, seed=1)
    losses, accuracies = [], []
    with torch.no_grad():
        for i in range(size):
            batch = torch.utils.data.default_collate([data[i]])
            logits = model(batch["input_ids"])
            losses.append(float(lm_loss(logits, batch["labels"])))
            accuracies.append(float(token_accuracy(logits, batch["labels"])["accuracy"][0]))
    return {"eval_loss": sum(losses) / size, "eval_accuracy": sum(accuracies) / size}


# Global eval batch 8 (2 per microbatch x 2 microbatches x dp 2, or x 4 microbatches at dp 1):
# 37 = 4 full batches + 5 (rank 0: 4 real rows, rank 1: 1); 3 < one batch (rank 1: none); 16: whole batches.
@pytest.mark.parametrize(
    "dp,pp,size", [(2, 1, 37), (2, 1, 3), (1, 2, 37), (2, 2, 5), (2, 2, 16)], ids=lambda v: str(v)
)
def test_eval_counts_every_sample_once(dp: int, pp: int, size: int) -> None:
    results = run_on_ranks(dp * pp, eval_body, dp, pp, size, 0)
    got = results[0]["evaluate"]
    assert all(r["evaluate"] == got for r in results), [r["evaluate"] for r in results]
    want = _reference(size)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-12), (key, got, want)


def test_eval_set_smaller_than_a_batch_after_training() -> None:
    results = run_on_ranks(2, eval_body, 2, 1, 3, 2)
    first = results[0]
    assert first["last_eval"] == first["evaluate"]
    want = _reference(3, first["state"])
    for key, value in want.items():
        assert first["evaluate"][key] == pytest.approx(value, rel=1e-12), (key, first["evaluate"], want)


def test_default_loss_reads_the_logits_of_a_model_output_cut_into_rows() -> None:
    # A transformers model at pp=1 returns a ModelOutput; evaluating a padded last batch cuts it
    # into microbatch rows, which come back as a plain dict. The default loss must read its logits
    # (it raised AttributeError: 'dict' object has no attribute 'reshape' at the end of training).
    modeling_outputs = pytest.importorskip("transformers.modeling_outputs")
    from merak_core.run.engine import default_loss
    from merak_core.run.evaluation import rows

    torch.manual_seed(0)
    logits = torch.randn(4, 3, 7, dtype=torch.float64)
    labels = torch.randint(0, 7, (4, 3))
    out = modeling_outputs.CausalLMOutput(logits=logits)
    part = rows(out, 0, 2)
    assert type(part) is modeling_outputs.CausalLMOutput  # rows keep the output's kind
    plain = rows(dict(out), 0, 2)  # a model returning a plain dict
    assert type(plain) is dict and not hasattr(plain, "logits")
    expected = torch.nn.functional.cross_entropy(logits[:2].reshape(-1, 7), labels[:2].reshape(-1))
    torch.testing.assert_close(default_loss(part, labels[:2]), expected, rtol=0, atol=0)
    torch.testing.assert_close(default_loss(plain, labels[:2]), expected, rtol=0, atol=0)
    torch.testing.assert_close(default_loss(out, labels), default_loss(logits, labels), rtol=0, atol=0)


def logits_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    """A user's loss for a transformers model: reads ``output.logits`` (as its full batches give it)."""
    logits = output.logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))


def hf_eval_body(size: int) -> dict[str, float]:
    from merak_core import Trainer
    from tests.e2e.test_transformers import VOCAB, build_hf_model

    args = make_args(**layout_kwargs(1, 1, 1, per_device_eval_batch_size=2, max_steps=1))
    trainer = Trainer(
        build_hf_model("gpt2"),
        args,
        TokenDataset(8, VOCAB),
        TokenDataset(size, VOCAB, seed=1),
        loss_fn=logits_loss,
        compute_metrics=token_accuracy,
    )
    return trainer.evaluate()


def test_custom_loss_of_a_transformers_model_on_an_eval_set_smaller_than_a_batch() -> None:
    # pp=1: the model returns a ModelOutput; a partial batch is cut into microbatch rows, which must
    # reach the user's loss as the full batches do (it got a plain dict: AttributeError 'dict' object
    # has no attribute 'logits').
    pytest.importorskip("transformers")
    from tests.e2e.test_transformers import VOCAB, build_hf_model

    size = 3  # one eval batch is 2 per microbatch x 2 microbatches
    got = run_on_ranks(1, hf_eval_body, size)[0]
    model = build_hf_model("gpt2")
    data = TokenDataset(size, VOCAB, seed=1)
    losses, accuracies = [], []
    with torch.no_grad():
        for i in range(size):
            batch = torch.utils.data.default_collate([data[i]])
            logits = model(batch["input_ids"]).logits
            losses.append(
                float(
                    torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1))
                )
            )
            accuracies.append(float(token_accuracy(logits, batch["labels"])["accuracy"][0]))
    assert got["eval_loss"] == pytest.approx(sum(losses) / size, rel=1e-12), got
    assert got["eval_accuracy"] == pytest.approx(sum(accuracies) / size, rel=1e-12), got
