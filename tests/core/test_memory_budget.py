"""`memory_per_device` set tight: what the planner chooses fits when measured; what it rejects would not.

Two ranks, the demo model (examples/addition). The budget lies below the predicted peak of the
configuration the planner prefers without a limit, so that one is rejected; the planner then keeps
only what fits under its margin ([Note: memory margin] in merak_core.planner.memory). Both
configurations run one real step under the saved-tensor meter (planner.memory_check): the chosen
one's measured peak is within the budget on every stage, the rejected one's exceeds it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from merak_core.planner import plan, profile_model
from merak_core.planner.memory import usable_memory
from tests.core.test_memory_model import MODELS, _batch, _measure_candidate
from tests.support.dist import run_on_ranks

WORLD, GLOBAL_BATCH = 2, 8


def _measured_peak(cand: Any) -> list[float]:
    """Per stage, the measured peak bytes of one step of ``cand`` (collective)."""
    import tempfile

    from merak_core import Trainer
    from merak_core.config import TrainingArguments

    model, data, _ = MODELS["addition"]()
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="merak-budget-"),
        dp=cand.dp,
        tp=cand.tp,
        pp=cand.pp,
        per_device_train_batch_size=cand.micro_batch_size,
        gradient_accumulation_steps=cand.num_microbatches,
        max_steps=1,
        zero_stage=1 if cand.dp > 1 else 0,
        logging_steps=1,
        seed=0,
    )
    trainer = Trainer(model, args, data)
    trainer.train()  # one step: the optimizer states exist
    inputs, labels = _batch(data, GLOBAL_BATCH // cand.dp)
    return [m.total_bytes for m in _measure_candidate(trainer, cand, inputs, labels)]


def budget_body() -> dict[str, Any]:
    import torch.distributed as dist

    model, data, _ = MODELS["addition"]()
    inputs, _ = _batch(data, 4)
    measured = [profile_model(model, inputs["input_ids"], repeats=1) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(measured, 0)
    n = measured[0].num_layers
    prof = dataclasses.replace(measured[0], layer_forward_s=[1e-3] * n, layer_backward_s=[2e-3] * n)
    kw: dict[str, Any] = dict(world_size=WORLD, global_batch_size=GLOBAL_BATCH, zero_stage=1)
    unlimited = plan(prof, memory_per_device=1e15, **kw)
    preferred = unlimited[0]
    # Just under the preferred configuration's predicted peak: it must be rejected, and what is
    # chosen instead must be predicted under the budget less the margin.
    budget = 0.97 * max(preferred.device_peak_bytes)
    chosen = plan(prof, memory_per_device=budget, **kw)
    return {
        "budget": budget,
        "preferred": preferred,
        "chosen": chosen[0],
        "kept": [(c.layout, c.schedule, c.num_microbatches, c.recompute) for c in chosen],
        "preferred_measured": _measured_peak(preferred),
        "chosen_measured": _measured_peak(chosen[0]),
    }


def test_tight_memory_per_device_chosen_fits_when_measured_and_rejected_would_not() -> None:
    out = run_on_ranks(WORLD, budget_body, timeout_s=600)[0]
    budget, preferred, chosen = out["budget"], out["preferred"], out["chosen"]
    key = (preferred.layout, preferred.schedule, preferred.num_microbatches, preferred.recompute)
    assert key not in out["kept"], "the preferred configuration should not fit the budget"
    assert max(chosen.device_peak_bytes) <= usable_memory(budget)
    assert max(out["chosen_measured"]) <= budget, (budget, out["chosen_measured"])
    assert max(out["preferred_measured"]) > budget, (budget, out["preferred_measured"])
