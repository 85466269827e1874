"""Shared pieces of the end-to-end trainer tests: data, the run on ranks, the single-process reference."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import Dataset

from tests.support.models import REFERENCE_MODELS, DecoderConfig, Llama, build_reference

SEQ = 8


class TokenDataset(Dataset):
    """Deterministic random token sequences with next-token labels (a few labels ignored)."""

    def __init__(self, size: int, vocab: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (size, SEQ + 1), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        labels = self.ids[i, 1:].clone()
        labels[0] = -100
        return {"input_ids": self.ids[i, :-1], "labels": labels}


def build_model(name: str) -> torch.nn.Module:
    """The reference model; Llama with 8 query / 4 key-value heads so that tp=4 divides both."""
    if name == "llama":
        torch.manual_seed(0)
        return Llama(DecoderConfig(num_heads=8, num_kv_heads=4)).double()
    return build_reference(name)


def make_args(**overrides: Any):
    from merak_core.config import TrainingArguments

    values: dict[str, Any] = dict(
        output_dir=tempfile.mkdtemp(prefix="merak-e2e-"),
        per_device_train_batch_size=2,
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


def train_on_ranks(name: str, args_kwargs: dict[str, Any], dataset_size: int = 64) -> tuple[list[float], Any]:
    """Run on every rank: Trainer for ``max_steps``; (losses, full state dict on rank 0)."""
    import torch.distributed as dist

    from merak_core import Trainer

    args = make_args(**args_kwargs)
    model = build_model(name)
    ref = REFERENCE_MODELS[name]
    data = TokenDataset(dataset_size, model.config.vocab_size)
    trainer = Trainer(model, args, data, loss_fn=ref.loss)
    history = trainer.train()
    state = trainer.full_state_dict()
    return [h["loss"] for h in history], state if dist.get_rank() == 0 else None


def reference_optimizer(model: torch.nn.Module, args: Any) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW and the LR schedule as the Trainer builds them: matrices decay, 1-D parameters do not."""
    from merak_core.config import build_lr_scheduler

    params = dict(model.named_parameters()).values()  # tied parameters once
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        foreach=False,
    )
    return opt, build_lr_scheduler(opt, args, args.max_steps)


def reference_microbatches(dataset_size: int, args: Any, dp: int) -> list[list[list[int]]]:
    """Per step, the sample indices of each of the dp * num_microbatches chunks, in the loader's order."""
    mbs, num_micro = args.per_device_train_batch_size, args.gradient_accumulation_steps
    global_batch = mbs * num_micro * dp
    perm = torch.randperm(dataset_size, generator=torch.Generator().manual_seed(args.seed)).tolist()
    steps = []
    for step in range(args.max_steps):
        idx = perm[step * global_batch : (step + 1) * global_batch]
        steps.append([idx[i : i + mbs] for i in range(0, global_batch, mbs)])
    return steps


def reference_training(
    name: str, args_kwargs: dict[str, Any], dp: int, dataset_size: int = 64
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same run in one process: the global batch split into dp * num_microbatches equal chunks."""
    args = make_args(**args_kwargs)
    model = build_model(name)
    ref = REFERENCE_MODELS[name]
    data = TokenDataset(dataset_size, model.config.vocab_size)
    losses = reference_steps(
        model, data, args, dp, lambda batch: ref.loss(model(batch["input_ids"]), batch["labels"])
    )
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def reference_steps(
    model: torch.nn.Module,
    data: Any,
    args: Any,
    dp: int,
    microbatch_loss: Callable[[dict[str, torch.Tensor]], torch.Tensor],
) -> list[float]:
    """``args.max_steps`` single-process steps over the Trainer's microbatches; the loss of each step.

    Each global batch is split as the Trainer splits it (:func:`reference_microbatches`), the
    gradients of the microbatch losses are averaged, clipped to ``args.max_grad_norm`` and applied
    with :func:`reference_optimizer`.
    """
    opt, sched = reference_optimizer(model, args)
    losses = []
    for chunks in reference_microbatches(len(data), args, dp):
        model.zero_grad(set_to_none=True)
        total = 0.0
        for chunk in chunks:
            loss = microbatch_loss(torch.utils.data.default_collate([data[i] for i in chunk])) / len(chunks)
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        opt.step()
        sched.step()
        losses.append(total)
    return losses
