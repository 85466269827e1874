"""``layout: auto`` choosing context parallelism, and training with it.

The reference Llama with one key/value head (no tp > 1) on 2 ranks, one sample per step (pp=2 would
need two microbatches, dp=2 two samples): the job says ``cp: 1`` (``dp: 1`` fixes the global batch),
no layout without context parallelism runs, so the planner turns it on by itself (issue 28 item 4:
the model and its batch allow cp=2), and the step equals the manual cp=2 run (itself tested against
one process in float64 by ``test_context_parallel.py``): the chosen degrees, the loss and every parameter.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.e2e.test_context_parallel import Tokens, _args, _sgd
from tests.support.dist import run_on_ranks


def _train(layout: str) -> tuple[tuple[int, ...], float, dict[str, torch.Tensor] | None]:
    import torch.distributed as dist

    from merak_core import Trainer
    from tests.support.models import DecoderConfig, Llama

    torch.manual_seed(0)
    model = Llama(DecoderConfig(num_layers=2, num_heads=4, num_kv_heads=1)).double()
    kw: dict[str, Any] = (
        dict(layout="auto", plan_probe_tp=False, plan_check_steps=0) if layout == "auto" else dict(cp=2)
    )
    trainer = Trainer(
        model, _args(dp=1, per_device_train_batch_size=1, **kw), Tokens(), optimizer_factory=_sgd
    )
    history = trainer.train()
    a = trainer.args
    state = trainer.full_state_dict()
    return (a.dp, a.cp, a.tp, a.pp), history[0]["loss"], state if dist.get_rank() == 0 else None


def test_layout_auto_chooses_cp_and_trains_as_the_manual_cp_run() -> None:
    auto = run_on_ranks(2, _train, "auto")
    manual = run_on_ranks(2, _train, "manual")
    assert [r[0] for r in auto] == [(1, 2, 1, 1)] * 2
    assert [r[1] for r in auto] == [r[1] for r in manual]
    got, want = auto[0][2], manual[0][2]
    assert got is not None and want is not None and set(got) == set(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name
