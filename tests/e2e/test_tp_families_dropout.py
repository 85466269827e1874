"""Dropout under tensor parallelism in the Trainer: replicated activations agree, recomputation replays.

The Trainer seeds the default generator identically on every TP rank, so dropout on
replicated activations (the residual stream, a row layer's output) draws the same mask on
every TP rank; the plan's rng regions (attention probabilities of the local heads) draw
from the TP stream, one per TP rank, derived from the default generator so that a
recomputed segment draws the same masks again.
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch

from tests.support.dist import run_on_ranks
from tests.support.models import REFERENCE_MODELS, DecoderConfig


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, size: int) -> None:
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, 96, (size, 9), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ids[i, :-1], self.ids[i, 1:]


def _args(**kw: Any) -> Any:
    from merak_core.config import TrainingArguments

    values: dict[str, Any] = dict(
        output_dir=tempfile.mkdtemp(prefix="merak-tpdrop-"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-2,
        max_steps=3,
        dtype="float64",
        logging_steps=1,
        seed=11,
    )
    values.update(kw)
    return TrainingArguments(**values)


def _train(kwargs: dict[str, Any], watch: str | None) -> dict[str, Any]:
    import torch.distributed as dist

    from merak_core import Trainer
    from tests.support.models import GPT

    torch.manual_seed(0)
    model = GPT(DecoderConfig(num_layers=2, dropout=0.3)).double()
    trainer = Trainer(model, _args(**kwargs), _Tokens(24), loss_fn=REFERENCE_MODELS["gpt"].loss)
    seen: list[torch.Tensor] = []
    if watch is not None:
        module = dict(trainer.model.module.named_modules())[watch]
        module.register_forward_hook(lambda _m, _i, out: seen.append(out.detach().clone()))
    history = trainer.train()
    agree = None
    if watch is not None:
        layout = trainer.layout
        stacked = torch.stack(seen)
        everyone = [torch.empty_like(stacked) for _ in range(layout.tp)]
        dist.all_gather(everyone, stacked, group=layout.tp_group)
        agree = all(torch.equal(e, stacked) for e in everyone)
    state = trainer.full_state_dict()
    return {
        "losses": [h["loss"] for h in history if "loss" in h],
        "agree": agree,
        "n_seen": len(seen),
        "state": state if dist.get_rank() == 0 else None,
    }


def test_replicated_activations_drop_identically_on_every_tp_rank() -> None:
    """The residual stream after each block (dropout in the MLP, replicated) is equal on the TP ranks."""
    results = run_on_ranks(2, _train, dict(tp=2), "blocks.1")
    assert results[0]["n_seen"] == 3 * 2, results[0]["n_seen"]  # every microbatch of every step
    assert all(r["agree"] for r in results), "TP ranks drew different masks for a replicated activation"
    assert results[0]["losses"] == results[1]["losses"]


def test_recompute_replays_the_tp_dropout_masks() -> None:
    """tp=2 with full recomputation is bit-identical to the run without (attention dropout on the TP
    stream, residual dropout on the default stream)."""
    plain = run_on_ranks(2, _train, dict(tp=2, recompute="none"), None)[0]
    recomputed = run_on_ranks(2, _train, dict(tp=2, recompute="full"), None)[0]
    assert plain["losses"] == recomputed["losses"]
    for key, value in plain["state"].items():
        assert torch.equal(value, recomputed["state"][key]), key


def test_derived_tp_stream_follows_the_default_generator() -> None:
    """A derived state's masks are a function of the default generator's state (what recomputation restores);
    a stored state's are not."""
    import merak_tp

    def masks(tracker: merak_tp.RNGTracker) -> torch.Tensor:
        with tracker.fork("tp"):
            return torch.rand(5)

    derived = merak_tp.RNGTracker()
    derived.add("tp", 7, derived=True)
    stored = merak_tp.RNGTracker()
    stored.add("tp", 7)
    torch.manual_seed(1)
    snapshot = torch.get_rng_state()
    first, first_stored = masks(derived), masks(stored)
    second_draw = masks(derived)
    torch.set_rng_state(snapshot)  # what a recompute does before running the segment again
    assert torch.equal(masks(derived), first), "the derived stream did not replay"
    assert not torch.equal(masks(stored), first_stored), (
        "a stored stream replays only if it is snapshotted too"
    )
    assert not torch.equal(first, second_draw), "two forks drew the same mask"
    other = merak_tp.RNGTracker()
    other.add("tp", 8, derived=True)  # another TP rank's seed
    torch.set_rng_state(snapshot)
    assert not torch.equal(masks(other), first), "TP ranks share a stream"
