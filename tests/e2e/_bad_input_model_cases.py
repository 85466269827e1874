"""Mistakes in how a model meets Merak: untraceable code under a pipeline, batch keys that match no
``forward`` parameter, outputs the default loss cannot read (rows of the bad-input table, on ranks).

Also the correct neighbours (used by ``test_model_inputs.py``): the same untraceable model kept whole
in one stage with the job key the error suggests trains as one process does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from tests.e2e._bad_input_support import CaseContext


class Gate(nn.Module):
    """Control flow on a tensor's value: neither torch.export nor fx can trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(x))
        if h.sum() > 0:  # data-dependent branch
            return h * 2
        return h


class Gated(nn.Module):
    """Linear -> Gate -> Linear -> Linear: a classifier of 3 classes over 4 features."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pre = nn.Linear(4, 8)
        self.gate = Gate()
        self.mid = nn.Linear(8, 8)
        self.out = nn.Linear(8, 3)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - the batch key
        return self.out(torch.tanh(self.mid(self.gate(torch.tanh(self.pre(input))))))


class Masked(nn.Module):
    """``forward(x, mask)``: two inputs, so a batch must name both."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.fc(x * mask)


class Features(Dataset):
    """``{keys[0]: x, keys[1]: mask, "labels": y}`` samples (float64 features, 3 classes)."""

    def __init__(self, keys: tuple[str, ...] = ("input",), size: int = 16) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(size, 4, generator=g, dtype=torch.float64)
        self.y = torch.randint(0, 3, (size,), generator=g)
        self.keys = keys

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        values = [self.x[i], torch.ones(4, dtype=torch.float64)]
        return {**dict(zip(self.keys, values, strict=False)), "labels": self.y[i]}


def _args(tmp: Path, **overrides: Any) -> Any:
    from merak_core import TrainingArguments

    values: dict[str, Any] = dict(
        output_dir=str(tmp / "out"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=2,
        dtype="float64",
        logging_steps=1,
    )
    values.update(overrides)
    return TrainingArguments(**values)


# ----------------------------------------------------------------------------- the mistakes


def trainer_pp_untraceable_model(ctx: CaseContext) -> None:
    from merak_core import Trainer, init

    layout = init(pp=2, device="cpu")
    args = _args(ctx.tmp, pp=2)
    with ctx.guard():
        Trainer(Gated().double(), args, Features(), layout=layout)


def trainer_batch_key_matches_no_parameter(ctx: CaseContext) -> None:
    from merak_core import Trainer, init

    layout = init(dp=2, device="cpu")
    args = _args(ctx.tmp, dp=2)
    with ctx.guard():  # 'maks' would have been passed by position, as the mask
        Trainer(Masked().double(), args, Features(("x", "maks")), layout=layout)


# ----------------------------------------------------------------------------- the correct neighbours


def gated_first_losses(tmp: str, pp: int) -> list[float] | None:
    """Two steps of :class:`Gated` at ``pp`` (``pp=2`` with the gate kept whole); the losses (rank 0)."""
    import torch.distributed as dist

    from merak_core import Trainer, init

    layout = init(pp=pp, device="cpu")
    plan = {"layers": {}, "trace_leaves": ["gate"]} if pp > 1 else None
    args = _args(Path(tmp), pp=pp, tp_plan=plan)
    history = Trainer(Gated().double(), args, Features(), layout=layout).train()
    return [h["loss"] for h in history] if dist.get_rank() == 0 else None


# ----------------------------------------------------------------------------- factories of the launch rows


class Scored(nn.Module):
    """Returns ``{"scores": ...}`` (``as_tuple``: ``(scores, hidden)``) instead of logits."""

    def __init__(self, as_tuple: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.hidden = nn.Linear(4, 8)
        self.out = nn.Linear(8, 3)
        self.as_tuple = as_tuple

    def forward(self, input: torch.Tensor) -> Any:  # noqa: A002 - the batch key
        hidden = torch.tanh(self.hidden(input))
        scores = self.out(hidden)
        return (scores, hidden) if self.as_tuple else {"scores": scores}


def features(keys: tuple[str, ...] = ("input",)) -> Any:
    return Features(tuple(keys))
