"""bf16 mixed precision (autocast over float32 parameters) tracks float32 training of the demo model.

The demo's model (``examples/addition``: a GPT-style decoder with tied embeddings
and a user-written TP plan) trains for 20 steps on the addition task with the
3D Trainer at a (dp, tp, pp) layout of world size 4, once with ``bf16=True``
and once in float32, from the same initial parameters and data.

Why the tolerance ([Note: bf16 tolerance]): autocast rounds the inputs of every
matrix product (linear, attention) to bfloat16, whose unit round-off is
u = 2**-8 ~ 0.39 %, and accumulates in float32; parameters, the optimizer, the
norms, the softmax and the loss reduction stay float32. The first step starts
from the same parameters, so its loss (a mean over many tokens of log-softmax
values whose inputs carry relative errors of order u, errors that partly
cancel in the mean) must agree to within u itself: ``FIRST_STEP_RTOL = u``.
Later steps also carry the drift of the parameters: Adam's updates are
normalised, so a gradient that is off by O(u) moves each update by O(u) of the
learning rate, and at a stable learning rate the trajectories stay close. We
allow any step's loss to differ by 1 % (about 2.5 u) and the mean relative
difference over the 20 steps to be 0.25 % (about 0.6 u). Measured on this
machine (torch 2.13 CPU): at most 0.005 % on the first step, at most 0.05 % on
any step, about 0.01 % on average; a genuinely unstable run (learning rate
1e-2, where one bf16 step spikes) breaks the band by 20 %, so the band detects
divergence rather than noise.

So that the test cannot pass with autocast silently off, each run records the
dtype of every matrix product it executed (forward and backward, through a
dispatch mode): bfloat16 on every rank with ``bf16=True``, only float32
without; the parameters stay float32, and the two runs must not be
bit-identical.
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.support.dist import run_on_ranks

STEPS = 20
FIRST_STEP_RTOL = 2**-8
STEP_RTOL = 0.01
MEAN_RTOL = 0.0025

TP_PLAN = {
    "layers.*.attn.query": "column",
    "layers.*.attn.key": "column",
    "layers.*.attn.value": "column",
    "layers.*.attn.out": "row",
    "layers.*.up": "column",
    "layers.*.down": "row",
}


class _MatmulDtypes(TorchDispatchMode):
    """Records the result dtypes of the matrix products that run (forward and backward) while active.

    A dispatch mode sits below autocast in the dispatcher, so it sees the products as autocast
    issued them: bfloat16 when mixed precision is on. It works on traced (torch.export) stages too,
    where module hooks would see nothing.
    """

    OPS = ("mm", "addmm", "bmm", "baddbmm")

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in self.OPS and isinstance(out, torch.Tensor):
            self.dtypes.add(str(out.dtype).replace("torch.", ""))
        return out


def train_demo(dp: int, tp: int, pp: int, bf16: bool) -> dict[str, Any]:
    """Rank body: the demo model and task, ``STEPS`` steps; losses and the dtypes the products ran in."""
    from examples.addition.data import build_datasets
    from examples.addition.model import build_model
    from merak_core import Trainer
    from merak_core.config import TrainingArguments

    torch.manual_seed(0)
    model = build_model(depth=2, width=32, heads=4, vocab_size=13, context=16)
    train_data, _ = build_datasets(train_size=2048, eval_size=8, num_digits=2)
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="merak-bf16-"),
        dp=dp,
        tp=tp,
        pp=pp,
        bf16=bf16,
        dtype="float32",
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        learning_rate=4e-3,
        warmup_steps=2,
        lr_scheduler_type="cosine",
        weight_decay=0.01,
        max_grad_norm=1.0,
        max_steps=STEPS,
        logging_steps=STEPS,
        seed=0,
        schedule="1f1b",
        tp_plan=TP_PLAN if tp > 1 else None,
    )
    trainer = Trainer(model, args, train_data)
    with _MatmulDtypes() as seen:
        history = trainer.train()
    params_dtypes = {str(p.dtype).replace("torch.", "") for p in trainer.model.module.parameters()}
    return {
        "losses": [h["loss"] for h in history],
        "matmul_dtypes": sorted(seen.dtypes),
        "param_dtypes": sorted(params_dtypes),
    }


@pytest.mark.parametrize("layout", [(1, 2, 2), (2, 1, 2)], ids=lambda t: "dp{}_tp{}_pp{}".format(*t))
def test_bf16_tracks_float32(layout: tuple[int, int, int]) -> None:
    dp, tp, pp = layout
    fp32 = run_on_ranks(4, train_demo, dp, tp, pp, False)
    bf16 = run_on_ranks(4, train_demo, dp, tp, pp, True)
    for results in (fp32, bf16):  # every rank reports the same global losses
        for rank, r in enumerate(results):
            assert r["losses"] == results[0]["losses"], f"rank {rank} reports other losses"
    ref, low = fp32[0]["losses"], bf16[0]["losses"]
    assert len(ref) == len(low) == STEPS

    # Autocast really ran: every rank's matrix products ran in bfloat16 (and only in float32 without it),
    # while the parameters stayed float32.
    assert all("bfloat16" in r["matmul_dtypes"] for r in bf16), [r["matmul_dtypes"] for r in bf16]
    assert all(r["matmul_dtypes"] == ["float32"] for r in fp32), [r["matmul_dtypes"] for r in fp32]
    assert all(r["param_dtypes"] == ["float32"] for r in bf16 + fp32)
    assert low != ref, "bf16 and float32 losses are bit-identical: autocast had no effect"

    rel = [abs(a - b) / abs(b) for a, b in zip(low, ref, strict=True)]
    report = "\n".join(
        f"step {i + 1:2d}: float32 {b:.5f}  bf16 {a:.5f}  rel diff {r:.4%}"
        for i, (a, b, r) in enumerate(zip(low, ref, rel, strict=True))
    )
    assert rel[0] <= FIRST_STEP_RTOL, f"first step (same parameters) differs too much:\n{report}"
    assert max(rel) <= STEP_RTOL, f"a step's bf16 loss left the float32 band:\n{report}"
    assert sum(rel) / len(rel) <= MEAN_RTOL, f"bf16 drifts from float32 on average:\n{report}"
    # Both runs learn: the loss falls clearly over the 20 steps.
    for name, losses in (("float32", ref), ("bf16", low)):
        assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.2, f"{name} loss did not fall:\n{report}"
