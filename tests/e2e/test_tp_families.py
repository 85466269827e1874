"""Every transformers family with a built-in TP plan trains under the Trainer like one process.

A tiny random model of each family (``tests/tp/_hf_families.py``, float64, no
downloads) is handed to ``merak_core.Trainer`` unchanged, with ``tp_plan`` left to
the built-in plan of its ``model_type``. Three optimizer steps (AdamW, warm-up,
clipping) must give the same losses and every parameter, by name, as the same
training in one process. Layouts: tp=2 with sub-pipelined overlap
(``overlap_chunks=2``) and sequence parallelism where the plan has it, and tp=2 x pp=2 with the same overlap (stages traced by
torch.export, the overlapped regions opaque leaves) for every family; the
mixture-of-experts blocks route tokens with data-dependent shapes, which
torch.export cannot trace: they stay opaque leaves too (TP's experts module, or
the plan's ``trace_leaves`` without TP, tested at pp=2).

Run with ``nox -s transformers`` or ``pytest -m transformers``.
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

pytest.importorskip("transformers")

from tests.tp import _hf_families as F  # noqa: E402

pytestmark = pytest.mark.transformers

SEQ = 8


class Tokens(Dataset):
    """Random token sequences with next-token labels (ids from 3 up: no pad/bos/eos tokens)."""

    def __init__(self, size: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, F.VOCAB, (size, SEQ + 1), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i, :-1].clone(), "labels": self.ids[i, 1:].clone()}


def lm_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    logits = getattr(output, "logits", output)
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))


def make_args(**overrides: Any) -> Any:
    from merak_core.config import TrainingArguments

    values: dict[str, Any] = dict(
        output_dir=tempfile.mkdtemp(prefix="merak-tpfam-"),
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


def train_on_ranks(name: str, kwargs: dict[str, Any]) -> tuple[list[float], Any]:
    import torch.distributed as dist

    from merak_core import Trainer

    trainer = Trainer(F.build_family(name), make_args(**kwargs), Tokens(16), loss_fn=lm_loss)
    history = trainer.train()
    state = trainer.full_state_dict()
    transposed = {n for n, p in trainer.model.named_parameters() if get_shard_spec(p).transposed}
    import merak_tp

    scatters = sum(isinstance(m, merak_tp.SequenceScatter) for m in trainer.model.module.modules())
    return (
        [h["loss"] for h in history if "loss" in h],
        (state, transposed) if dist.get_rank() == 0 else None,
        scatters,
    )


def reference(name: str, kwargs: dict[str, Any]) -> tuple[list[float], dict[str, torch.Tensor]]:
    args = make_args(**kwargs)
    model = F.build_family(name)
    params = dict(model.named_parameters())

    def microbatch_loss(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        labels = batch.pop("labels")
        return lm_loss(model(**batch), labels)

    losses = reference_steps(model, Tokens(16), args, 1, microbatch_loss)
    return losses, {n: p.detach().clone() for n, p in params.items()}


def _check(name: str, tp: int, pp: int, **overrides: Any) -> None:
    kwargs = dict(dp=1, tp=tp, pp=pp, gradient_accumulation_steps=2, **overrides)
    results = run_on_ranks(tp * pp, train_on_ranks, name, kwargs)
    ref_losses, ref_state = reference(name, kwargs)
    losses, (state, transposed), _ = results[0]
    scatters = sum(r[2] for r in results)  # the modules entering sequence parallelism, over the ranks
    assert (scatters > 0) == bool(overrides.get("sequence_parallel")), scatters
    tol = F.tolerance(name)
    assert len(losses) == 3
    assert losses == pytest.approx(ref_losses, rel=tol.get("rtol", 1e-9), abs=1e-12)
    assert sorted(state) == sorted(ref_state)
    for key, ref in ref_state.items():
        value = state[key]
        if key in transposed and value.shape != ref.shape:
            value = value.t()
        assert_tensors_close(
            value,
            ref,
            name=f"{name} tp{tp} pp{pp} param {key}",
            rtol=tol.get("rtol", 1e-8),
            atol=tol.get("atol", 1e-10),
        )


SEQUENCE_PARALLEL = tuple(f for f in F.FAMILIES if f not in (*F.MOE, "opt"))
"""Families whose plans shard the sequence between the TP blocks (``training.sequence_parallel``)."""


@pytest.mark.parametrize("name", F.FAMILIES)
def test_family_trains_at_tp2_with_overlap_and_sequence_parallel(name: str) -> None:
    """tp=2 with overlap_chunks=2, and sequence parallelism where the plan supports it (both at once: the
    overlapped regions gather and reduce-scatter the sequence)."""
    _check(name, 2, 1, overlap_chunks=2, sequence_parallel=name in SEQUENCE_PARALLEL)


def test_sequence_parallel_at_tp2_pp2() -> None:
    """Sequence parallelism inside traced stages (the scatter/gather modules are opaque leaves too)."""
    _check("llama", 2, 2, sequence_parallel=True)


def test_sequence_parallel_is_refused_before_any_process_group() -> None:
    """A plan without sequence parallelism: the Trainer refuses it from the model alone, naming the family,
    the reason and the job-file key (in this process no torchrun environment exists: the layout would fail
    with another error, so this one comes first)."""
    from merak_core import Trainer

    for name, why in (
        ("opt", "OPTDecoderLayer flattens batch and sequence"),
        ("mixtral", "its experts block"),
    ):
        with pytest.raises(
            ValueError,
            match=f"sequence_parallel=true: the TP plan 'hf_{name}' of .*model_type "
            f"'{name}'.* does not support sequence parallelism: {why}.*"
            "training.sequence_parallel: false",
        ):
            Trainer(F.build_family(name), make_args(tp=2, sequence_parallel=True), Tokens(4), loss_fn=lm_loss)


@pytest.mark.parametrize("name", F.FAMILIES)
def test_family_trains_at_tp2_pp2_with_overlap(name: str) -> None:
    """tp=2 x pp=2 with the overlapped (sub-pipelined) regions as opaque leaves of the traced stages."""
    _check(name, 2, 2, overlap_chunks=2)


def test_moe_family_trains_at_pp2_without_tp() -> None:
    """Without TP the experts (data-dependent routing) stay opaque leaves of the traced stages (the plan's
    trace_leaves), so a mixture-of-experts model pipelines too."""
    _check("qwen3_moe", 1, 2)
