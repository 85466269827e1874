"""ZeRO-2/3 under bf16: FSDP2 gathers bf16 parameters and reduces float32 gradients.

One Trainer step at dp=2 (gloo, the in-pool ranks), bf16 autocast with float32 master
weights: the dtypes of the tensors given to the all-gathers are recorded (torch.distributed's
all-gather wrapped during the step): bf16, half the bytes of the float32 gather that ran
before. Loss and every gradient (gathered over DP by name) equal the replicated bf16 run's
(zero_stage 0: float32 weights cast by autocast) within bf16 rounding, and the gradients and
updated parameters are float32.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.support.dist import run_on_ranks

GATHERS = ("all_gather_into_tensor", "all_gather_single", "all_gather")


def bf16_body(zero_stage: int) -> dict[str, Any]:
    import tempfile

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from merak_core import Trainer
    from merak_core.config import TrainingArguments
    from tests.core.test_memory_model import _addition

    model, data, _ = _addition()
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="merak-fsdp-bf16-"),
        dp=2,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=1,
        zero_stage=zero_stage,
        bf16=True,
        max_grad_norm=0.0,
        logging_steps=1,
        seed=0,
    )
    trainer = Trainer(model, args, data)
    gathered: list[tuple[torch.dtype, int]] = []
    originals = {name: getattr(dist, name) for name in GATHERS if hasattr(dist, name)}

    def wrap(fn: Any) -> Any:
        def recording(out: Any, inp: Any, *a: Any, **k: Any) -> Any:
            first = inp if isinstance(inp, torch.Tensor) else inp[0] if isinstance(inp, list) else None
            if isinstance(first, torch.Tensor):
                gathered.append((first.dtype, first.nbytes))
            return fn(out, inp, *a, **k)

        return recording

    for name, fn in originals.items():
        setattr(dist, name, wrap(fn))
    try:
        history = trainer.train()
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    grads = {}
    for name, p in trainer.model.module.named_parameters():
        g = p.grad
        grads[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
    return {
        "loss": history[0]["loss"],
        "grads": grads,
        "param_dtypes": sorted({str(p.dtype) for p in trainer.model.module.parameters()}),
        "gathered": gathered,
    }


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_fsdp_gathers_bf16_and_matches_the_bf16_path(zero_stage: int) -> None:
    sharded = run_on_ranks(2, bf16_body, zero_stage, timeout_s=300)
    replicated = run_on_ranks(2, bf16_body, 0, timeout_s=300)
    for a, b in zip(sharded, replicated, strict=True):
        dtypes = {dtype for dtype, _ in a["gathered"]}
        assert dtypes == {torch.bfloat16}, a["gathered"][:4]  # parameters gathered in bf16 only
        assert a["param_dtypes"] == ["torch.float32"]  # float32 master weights
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-2)
        assert a["grads"].keys() == b["grads"].keys()
        total = torch.stack([g.norm() for g in b["grads"].values()]).norm()
        errs = {}
        for name, ref in b["grads"].items():
            got = a["grads"][name]
            assert got.dtype == torch.float32, name
            errs[name] = (float((got - ref).norm()), float(ref.norm()))
        for name, (err, size) in errs.items():
            # bf16 rounding (8 bits of mantissa): relative to the gradient's size, or to the whole
            # gradient's for a gradient that is zero in exact arithmetic (a key bias under softmax).
            assert err <= 3e-2 * size + 1e-3 * float(total), (name, err, size)
