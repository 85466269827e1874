"""TP's gradient sums of replicated weights run once per optimizer step, not once per parameter per microbatch.

A transformers Qwen3 at tp=2 with sequence parallelism has both kinds of partial gradients merak-tp
completes by a sum over the TP group (per-head q/k norms, and the replicated weights that see only this
rank's tokens). The training engine sums them after the backward of the last microbatch in one flat
all-reduce per group and dtype (``merak_tp.grad_sums``): counted here by wrapping ``dist.all_reduce``,
the same single call per step with 2 and with 4 microbatches, and none from the per-parameter hooks.
That the sums are right (losses and every parameter against one process) is
``test_tp_families.py``'s and ``test_zero23_tp_sums.py``'s.
"""

from __future__ import annotations

import sys
import tempfile
from typing import Any

import pytest
import torch

from tests.e2e._trainer_support import make_args
from tests.e2e.test_zero23_tp_sums import Tokens, lm_loss
from tests.support.dist import run_on_ranks

pytest.importorskip("transformers")

from tests.tp import _hf_families as F  # noqa: E402

pytestmark = pytest.mark.transformers


def count_body(num_micro: int) -> dict[str, Any]:
    """All-reduces per step by their caller: the per-parameter hook or the once-per-step bucketed sum."""
    import torch.distributed as dist

    from merak_core import Trainer

    args = make_args(
        tp=2,
        sequence_parallel=True,
        gradient_accumulation_steps=num_micro,
        max_steps=2,
        output_dir=tempfile.mkdtemp(prefix="merak-tp-sums-"),
    )
    trainer = Trainer(F.build_family("qwen3"), args, Tokens(), loss_fn=lm_loss)
    calls: dict[str, int] = {}
    per_step: list[dict[str, int]] = []
    original, step = dist.all_reduce, trainer.engine.step

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        frame = sys._getframe(1)
        where = f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_code.co_name}"
        calls[where] = calls.get(where, 0) + 1
        return original(tensor, *args, **kwargs)

    def counted_step(*args: Any, **kwargs: Any) -> Any:
        calls.clear()
        result = step(*args, **kwargs)
        per_step.append(dict(calls))
        return result

    trainer.engine.step = counted_step
    dist.all_reduce = all_reduce
    try:
        trainer.train()
    finally:
        dist.all_reduce = original
    dtypes = {p.dtype for p, _ in trainer.engine.tp_sums}
    return {"per_step": per_step, "summed": len(trainer.engine.tp_sums), "dtypes": len(dtypes)}


@pytest.mark.parametrize("num_micro", [2, 4])
def test_one_bucketed_sum_per_step_whatever_the_microbatches(num_micro: int) -> None:
    for result in run_on_ranks(2, count_body, num_micro):
        assert result["summed"] > 2 and result["dtypes"] == 1, result  # q/k norms and the layer norms
        for calls in result["per_step"]:
            assert calls.get("grad_sums.py:sum_grads") == 1, calls  # one group (TP), one dtype
            assert not any(where.endswith(":hook") for where in calls), calls  # no per-parameter sum
