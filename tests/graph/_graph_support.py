"""Shared helpers for merak_graph tests: run stage modules like a pipeline would.

``run_stages`` runs each stage on detached copies of the previous stage's
outputs (as a pipeline receiving tensors over p2p would), then runs backward
stage by stage from the loss, passing boundary gradients back. Gradients are
gathered by ORIGINAL parameter name and summed over stages that hold the same
logical parameter (what the trainer's shared-parameter sync does).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from merak_graph import Partition


def run_stages(
    part: Partition,
    stages: Sequence[nn.Module],
    inputs: Sequence[torch.Tensor],
    labels: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(output, loss, gradients by original name, summed over shared copies)."""
    for stage in stages:
        stage.zero_grad(set_to_none=True)
    received: list[tuple[Any, ...]] = []
    sent: list[Any] = []
    values: tuple[Any, ...] = tuple(inputs)
    for i, stage in enumerate(stages):
        local = tuple(
            v.detach().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) and i > 0 else v
            for v in values
        )
        received.append(local)
        out = stage(*local)
        sent.append(out)
        values = out if isinstance(out, tuple) else (out,)
    output = sent[-1]
    assert isinstance(output, torch.Tensor), type(output)
    loss = loss_fn(output, labels)
    loss.backward()
    for i in range(len(stages) - 2, -1, -1):
        outs = sent[i] if isinstance(sent[i], tuple) else (sent[i],)
        pairs = [
            (o, r.grad)
            for o, r in zip(outs, received[i + 1], strict=True)
            if isinstance(r, torch.Tensor) and r.grad is not None
        ]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    grads: dict[str, torch.Tensor] = {}
    for i, stage in enumerate(stages):
        names = part.stage_parameter_names(i)
        for local, param in stage.named_parameters():
            assert param.grad is not None, f"stage {i} parameter {local} has no gradient"
            original = names[local]
            grads[original] = grads[original] + param.grad if original in grads else param.grad.clone()
    return output.detach(), loss.detach(), grads
