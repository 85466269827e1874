"""``data.labels: unshifted``: transformers-convention labels (``labels = input_ids``) train as transformers does.

The data give ``labels = input_ids`` with right padding labelled -100, a different amount per sample,
so the microbatches count different numbers of tokens. Under ``labels: unshifted`` Merak shifts the
labels where it reads them ([Note: unshifted labels] in ``merak_core.data.loader``), and then:

- on one batch, its default loss and the gradient of the logits equal transformers' own
  ``ForCausalLMLoss`` bit for bit (float32), and the float64 formula ``logits[:, :-1]`` against
  ``labels[:, 1:]``, -100 ignored;
- at pp=2, tp=2 and dp=2 (2 ranks each) two SGD steps give the losses and every parameter of a
  single-process float64 run whose microbatch loss is that formula (SGD without clipping: the
  parameters after a step are the parameters minus lr times every gradient, so the gradients
  are compared, scale included);
- a tiny transformers GPT-2 at pp=2: the loss and the parameters after an SGD step equal one
  process that backpropagates the model's own loss, ``model(..., labels=labels).loss``;
- the job file's ``data.labels`` is parsed and checked (the launch check's refusal of
  ``labels = input_ids`` under ``shifted`` is a row of ``test_preflight.py``).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from tests.e2e._trainer_support import reference_microbatches
from tests.support.compare import assert_tensors_close
from tests.support.dist import run_on_ranks
from tests.support.hf_models import tiny_gpt2_config
from tests.support.models import GPT, DecoderConfig

SEQ = 8
LR = 0.5


class HFTokens(Dataset):
    """transformers-style samples: ``labels`` is ``input_ids``, the right padding (0 to 3 tokens) is -100."""

    def __init__(self, size: int, vocab: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, vocab, (size, SEQ), generator=g)
        self.pads = torch.randint(0, 4, (size,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids, labels = self.ids[i].clone(), self.ids[i].clone()
        pad = int(self.pads[i])
        if pad:
            ids[SEQ - pad :] = 0
            labels[SEQ - pad :] = -100
        return {"input_ids": ids, "labels": labels}


def transformers_formula(logits_btv: torch.Tensor, labels_bt: torch.Tensor) -> torch.Tensor:
    """Output t predicts label t + 1: the mean cross-entropy over the labels other than -100."""
    return F.cross_entropy(
        logits_btv[:, :-1].reshape(-1, logits_btv.size(-1)), labels_bt[:, 1:].reshape(-1), ignore_index=-100
    )


# ----------------------------------------------------------------------------- one batch


def test_shifted_in_the_data_path_is_transformers_causal_lm_loss() -> None:
    from transformers.loss.loss_utils import ForCausalLMLoss

    from merak_core import default_loss
    from merak_core.data.loader import shift_labels

    vocab = 11
    g = torch.Generator().manual_seed(3)
    labels = torch.randint(0, vocab, (3, 7), generator=g)
    labels[0, 5:] = -100
    labels[1, 2] = -100
    labels[2, 0] = -100
    logits = torch.randn(3, 7, vocab, generator=g, requires_grad=True)

    ours = default_loss(logits, shift_labels(labels))
    (ours_grad,) = torch.autograd.grad(ours, logits)
    theirs = ForCausalLMLoss(logits, labels, vocab_size=vocab)
    (their_grad,) = torch.autograd.grad(theirs, logits)
    assert torch.equal(ours, theirs) and torch.equal(ours_grad, their_grad)

    wide = logits.detach().double().requires_grad_()
    ours64 = default_loss(wide, shift_labels(labels))
    ref64 = transformers_formula(wide, labels)
    assert ours64.item() == pytest.approx(ref64.item(), rel=1e-14)
    assert_tensors_close(
        torch.autograd.grad(ours64, wide)[0], torch.autograd.grad(ref64, wide)[0], rtol=1e-12, atol=1e-15
    )
    assert shift_labels(labels)[:, -1].eq(-100).all()


def test_unshifted_labels_that_are_not_token_labels_are_refused() -> None:
    from merak_core.data.loader import label_split

    split = label_split("unshifted")
    with pytest.raises(ValueError, match=r"1-d torch.int64 tensor of shape \[4\].*data.labels: shifted"):
        split((torch.zeros(4, 3), torch.zeros(4, dtype=torch.long)))
    with pytest.raises(ValueError, match="torch.float32"):
        split({"x": torch.zeros(2, 3), "labels": torch.zeros(2, 3)})


# ----------------------------------------------------------------------------- the job file


def _job(tmp: Path, data: str, training: str = "") -> Path:
    (tmp / "job_fns.py").write_text(
        "import torch\n\ndef model():\n    return torch.nn.Linear(2, 2)\n\ndef data():\n    return [0]\n"
    )
    path = tmp / "job.yaml"
    path.write_text(f"model: {{factory: job_fns.py:model}}\ndata: {data}\ntraining: {{dp: 1{training}}}\n")
    return path


def test_job_file_data_labels_is_parsed_and_checked(tmp_path: Path) -> None:
    from merak_core.job import JobConfig

    assert JobConfig.from_yaml(_job(tmp_path, "{factory: job_fns.py:data}")).training.labels == "shifted"
    job = JobConfig.from_yaml(_job(tmp_path, "{factory: job_fns.py:data, labels: unshifted}"))
    assert job.training.labels == "unshifted" and job.data.kwargs == {}
    path = _job(tmp_path, "{factory: job_fns.py:data}")
    assert JobConfig.from_yaml(path, ["data.labels=unshifted"]).training.labels == "unshifted"
    with pytest.raises(
        ValueError, match="data.labels='shift' is invalid: expected 'shifted' .* or 'unshifted'"
    ):
        JobConfig.from_yaml(_job(tmp_path, "{factory: job_fns.py:data, labels: shift}"))
    # ``training.labels`` is what TrainingArguments.to_yaml writes: the same setting, unless it disagrees.
    job = JobConfig.from_yaml(_job(tmp_path, "{factory: job_fns.py:data}", ", labels: unshifted"))
    assert job.training.labels == "unshifted"
    path = _job(tmp_path, "{factory: job_fns.py:data, labels: unshifted}", ", labels: unshifted")
    assert JobConfig.from_yaml(path).training.labels == "unshifted"
    with pytest.raises(ValueError, match="training.labels='unshifted' disagrees with data.labels='shifted'"):
        JobConfig.from_yaml(
            _job(tmp_path, "{factory: job_fns.py:data, labels: shifted}", ", labels: unshifted")
        )
    text = "{format: text, path: c.txt, tokenizer: t/, seq_len: 4, labels: unshifted}"
    with pytest.raises(ValueError, match="data.labels=unshifted with text data.*remove data.labels"):
        JobConfig.from_yaml(_job(tmp_path, text))


def test_training_arguments_labels_is_checked() -> None:
    from merak_core import TrainingArguments

    with pytest.raises(
        ValueError, match=r"labels='hf' is invalid: expected one of \('shifted', 'unshifted'\)"
    ):
        TrainingArguments(labels="hf")


# ----------------------------------------------------------------------------- every layout


def _gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(DecoderConfig(num_layers=2)).double()


def _args(**overrides: Any) -> Any:
    from merak_core import TrainingArguments

    values: dict[str, Any] = dict(
        output_dir=tempfile.mkdtemp(prefix="merak-unshifted-"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=LR,
        lr_scheduler_type="constant",
        max_steps=2,
        max_grad_norm=0.0,
        weight_decay=0.0,
        logging_steps=1,
        dtype="float64",
        seed=7,
        labels="unshifted",
    )
    values.update(overrides)
    return TrainingArguments(**values)


def _sgd(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    return torch.optim.SGD(groups, lr=LR)


def train_body(kwargs: dict[str, Any]) -> tuple[list[float], Any]:
    import torch.distributed as dist

    from merak_core import Trainer

    model = _gpt()
    data = HFTokens(32, model.config.vocab_size)
    trainer = Trainer(model, _args(**kwargs), data, optimizer_factory=_sgd)  # the default loss
    history = trainer.train()
    state = trainer.full_state_dict()
    return [h["loss"] for h in history], state if dist.get_rank() == 0 else None


def _reference(kwargs: dict[str, Any], dp: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    args = _args(**kwargs)
    model = _gpt()
    data = HFTokens(32, model.config.vocab_size)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for chunks in reference_microbatches(len(data), args, dp):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for chunk in chunks:
            batch = torch.utils.data.default_collate([data[i] for i in chunk])
            loss = transformers_formula(model(batch["input_ids"]), batch["labels"]) / len(chunks)
            loss.backward()
            total += float(loss.detach())
        opt.step()
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "layout", [(1, 1, 2), (1, 2, 1), (2, 1, 1)], ids=lambda t: f"dp{t[0]}_tp{t[1]}_pp{t[2]}"
)
def test_unshifted_labels_train_like_one_process(layout: tuple[int, int, int]) -> None:
    dp, tp, pp = layout
    kwargs = {"dp": dp, "tp": tp, "pp": pp}
    results = run_on_ranks(dp * tp * pp, train_body, kwargs)
    ref_losses, ref_state = _reference(kwargs, dp)
    losses, state = results[0]
    for rank, (other, _) in enumerate(results):
        assert other == pytest.approx(losses, rel=1e-12), f"rank {rank} reports other losses"
    assert losses == pytest.approx(ref_losses, rel=1e-10, abs=1e-12)
    assert sorted(state) == sorted(ref_state)
    for key, ref in ref_state.items():
        assert_tensors_close(state[key], ref, name=f"{layout} param {key}", rtol=1e-9, atol=1e-11)


# ----------------------------------------------------------------------------- a transformers model


def _hf_gpt2() -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tiny_gpt2_config(40, n_embd=16, n_head=2, n_positions=16, use_cache=False)
    return tf.GPT2LMHeadModel(cfg).double()


def hf_body(kwargs: dict[str, Any]) -> tuple[list[float], Any]:
    import torch.distributed as dist

    from merak_core import Trainer

    trainer = Trainer(_hf_gpt2(), _args(**kwargs), HFTokens(16, 40), optimizer_factory=_sgd)
    history = trainer.train()
    state = trainer.full_state_dict()
    return [h["loss"] for h in history], state if dist.get_rank() == 0 else None


@pytest.mark.transformers
def test_transformers_model_matches_its_own_loss_at_pp2() -> None:
    pytest.importorskip("transformers")
    kwargs = {"dp": 1, "tp": 1, "pp": 2, "max_steps": 1}
    losses, state = run_on_ranks(2, hf_body, kwargs)[0]
    model = _hf_gpt2()
    data = HFTokens(16, 40)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    (chunks,) = reference_microbatches(len(data), _args(**kwargs), 1)
    total = 0.0
    for chunk in chunks:
        batch = torch.utils.data.default_collate([data[i] for i in chunk])
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss / len(chunks)  # its own loss
        loss.backward()
        total += float(loss.detach())
    opt.step()
    # transformers computes its loss in float32 (logits.float()): float32 tolerances.
    assert losses[0] == pytest.approx(total, rel=1e-6)
    for key, ref in model.state_dict().items():
        if key in state:
            assert_tensors_close(state[key], ref, name=f"gpt2 pp2 param {key}", rtol=1e-5, atol=1e-7)
    assert {n for n, _ in model.named_parameters()} <= set(state)
