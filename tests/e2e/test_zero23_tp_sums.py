"""ZeRO-2/3 at tp=2 keeps merak-tp's gradient sums of replicated weights (found with issue 24).

merak-tp completes the partial gradient of a replicated weight applied to this rank's heads only
(Qwen3's per-head q/k norms) or to its tokens only (sequence parallelism) with a hook on the
parameter. FSDP2 replaces the parameters with sharded ones and feeds their gradients itself, so
the hooks never ran: the norms trained on half their gradient, without a word. A transformers
Qwen3 at dp2 x tp2 (ZeRO 2 and 3, with sequence parallelism) against three steps in one process
(float64): the losses and every parameter by name.
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

from merak_tp.shard_spec import get_shard_spec
from tests.e2e._trainer_support import make_args, reference_steps
from tests.support.compare import assert_tensors_close
from tests.support.dist import run_on_ranks

pytest.importorskip("transformers")

from tests.tp import _hf_families as F  # noqa: E402

pytestmark = pytest.mark.transformers


class Tokens(Dataset):
    """Random token sequences with next-token labels."""

    def __init__(self, size: int = 32, seq: int = 8) -> None:
        self.ids = torch.randint(3, F.VOCAB, (size, seq + 1), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i, :-1].clone(), "labels": self.ids[i, 1:].clone()}


def lm_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    logits = output.logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))


def train_on_ranks(kwargs: dict[str, Any]) -> tuple[list[float], Any]:
    import torch.distributed as dist

    from merak_core import Trainer

    args = make_args(**kwargs, output_dir=tempfile.mkdtemp(prefix="merak-zero-tp-"))
    trainer = Trainer(F.build_family("qwen3"), args, Tokens(), loss_fn=lm_loss)
    losses = [h["loss"] for h in trainer.train() if "loss" in h]
    state = trainer.full_state_dict()
    transposed = {n for n, p in trainer.model.named_parameters() if get_shard_spec(p).transposed}
    return losses, (state, transposed) if dist.get_rank() == 0 else None


@pytest.mark.parametrize(
    "extra", [{"zero_stage": 2, "sequence_parallel": True}, {"zero_stage": 3}], ids=["zero2-sp", "zero3"]
)
def test_zero23_at_tp2_sums_the_replicated_gradients(extra: dict[str, Any]) -> None:
    kwargs = dict(dp=2, tp=2, pp=1, gradient_accumulation_steps=1, **extra)
    losses, (state, transposed) = run_on_ranks(4, train_on_ranks, kwargs)[0]
    model = F.build_family("qwen3")

    def microbatch_loss(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return lm_loss(model(input_ids=batch["input_ids"]), batch["labels"])

    ref_losses = reference_steps(model, Tokens(), make_args(**kwargs), 2, microbatch_loss)
    assert losses == pytest.approx(ref_losses, rel=1e-9, abs=1e-12)
    for key, ref in model.named_parameters():
        value = state[key].t() if key in transposed and state[key].shape != ref.shape else state[key]
        assert_tensors_close(value, ref.detach(), name=f"{extra} {key}", rtol=1e-8, atol=1e-10)
