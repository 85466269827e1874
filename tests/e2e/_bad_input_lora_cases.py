"""The LoRA rows of the bad-input table (``model.lora`` and ``Trainer(lora=...)``).

Each job is refused by ``merak train --dry-run`` (the job file's checks and the preflight, in the
launching process, before torchrun) with exit 2 and a message naming the key and the fix.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import torch
from torch import nn

from tests.e2e._bad_input_cases import _args, _merak, _Pairs
from tests.e2e._bad_input_support import CaseContext

_MODEL = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.q_proj = nn.Linear(4, 4)
        self.v_proj = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.v_proj(self.q_proj(x)))


def build_model():
    return Net()


def build_data():
    return [(torch.zeros(4), 0)] * 8
"""


def _lora_job(ctx: CaseContext, lora: str, training: str = "dp: 1\n  tp: 1\n  pp: 1") -> Path:
    (ctx.tmp / "model.py").write_text(textwrap.dedent(_MODEL))
    job = ctx.tmp / "job.yaml"
    job.write_text(
        f"model:\n  factory: model.py:build_model\n  lora: {lora}\ndata:\n  factory: model.py:build_data\n"
        f"training:\n  {training}\n  output_dir: {ctx.tmp / 'out'}\n"
    )
    return job


def lora_targets_match_nothing(ctx: CaseContext) -> None:
    job = _lora_job(ctx, "{r: 4, target_modules: [qproj, o_proj]}")
    _merak(ctx, ["train", str(job), "--dry-run"])


def lora_rank_not_positive(ctx: CaseContext) -> None:
    job = _lora_job(ctx, "{r: 0, target_modules: [q_proj]}")
    _merak(ctx, ["train", str(job), "--dry-run"])


def lora_target_not_a_linear(ctx: CaseContext) -> None:
    job = _lora_job(ctx, "{r: 4, target_modules: [embed, q_proj]}")
    _merak(ctx, ["train", str(job), "--dry-run"])


def lora_unknown_key(ctx: CaseContext) -> None:
    job = _lora_job(ctx, "{rank: 4, target_modules: [q_proj]}")
    _merak(ctx, ["train", str(job), "--dry-run"])


def trainer_lora_targets_match_nothing(ctx: CaseContext) -> None:
    """``Trainer(model, args, lora=...)``: refused from the model alone, before any process group."""
    from merak_core import Trainer
    from merak_core.lora import LoraConfig

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    args = _args(ctx)
    with ctx.guard():
        Trainer(model, args, _Pairs(), lora=LoraConfig(r=4, target_modules=["q_proj"]))
