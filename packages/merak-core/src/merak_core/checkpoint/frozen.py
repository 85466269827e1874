"""Adapter-only checkpoints: a LoRA run saves what trains, and a fingerprint of the frozen base.

[Note: adapter-only checkpoints] A LoRA run (``model.lora``) freezes every weight but its
adapters, so the frozen base is the same bytes as the model it started from (the pretrained
folder, or the factory's model): a checkpoint writes the adapters and their optimizer state only
(``model/<adapter>``, ``optim/<adapter>/...``; the adapters of every TP rank, as any TP-sharded
parameter: a ``DTensor`` over the TP mesh, so no rank's shard is lost), and records in its
metadata ``adapter_only: true`` and ``base``: the pretrained folder it started from (None for a
factory's model) and a fingerprint of the frozen weights. Resuming, exporting or evaluating
takes the base from the run being built (``model.pretrained`` or the factory) and the adapters
from the checkpoint; the base is checked against the fingerprint first, and a different one is
refused by name (adapters trained on one base are meaningless on another).

The fingerprint of a frozen parameter is ``[sum(x), sum(|x|), sum(x^2)]`` of the full logical
tensor in float64 (a TP-sharded one summed over the TP group), which does not depend on the
layout; two layouts' fingerprints of one base differ by the summation order's rounding only,
so they are compared to a relative ``1e-9`` (of ``sum(|x|)`` for the signed sum).

Not done here: writing and reading the DCP files (``save.py``, ``load.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from merak_core.checkpoint.files import CheckpointError
from merak_core.checkpoint.specs import tensor_specs

if TYPE_CHECKING:
    from merak_core.checkpoint.parts import CheckpointParts

__all__ = ["RTOL", "base_fingerprint", "check_base", "frozen_names", "tensor_fingerprint"]

RTOL = 1e-9
"""Relative tolerance between two layouts' fingerprints of one base (summation order only)."""


def frozen_names(parts: CheckpointParts) -> set[str]:
    """Logical names of this rank's frozen parameters in a LoRA run (empty for a full fine-tune)."""
    if parts.model.lora is None:
        return set()
    return {name for name, (p, _) in tensor_specs(parts).items() if not p.requires_grad}


def tensor_fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """``[sum(x), sum(|x|), sum(x^2)]`` of ``tensor`` in float64 (pure)."""
    x = tensor.detach().to(torch.float64)
    return torch.stack([x.sum(), x.abs().sum(), (x * x).sum()])


def base_fingerprint(parts: CheckpointParts) -> dict[str, list[float]]:
    """The fingerprint of every frozen parameter of the whole model (collective over the world: every
    rank calls it; one all-reduce over TP and one all-gather of the per-stage results)."""
    names = sorted(frozen_names(parts))
    specs = tensor_specs(parts)
    layout = parts.layout
    stats = torch.zeros(len(names), 3, dtype=torch.float64)
    sharded = torch.zeros(len(names), dtype=torch.bool)
    for i, name in enumerate(names):
        p, spec = specs[name]
        stats[i] = tensor_fingerprint(p).cpu()
        sharded[i] = spec.dim is not None
    if layout.tp > 1 and names:
        # Replicated parameters: only TP rank 0's terms, so the TP sum is the whole tensor's.
        summed = torch.where(sharded[:, None] | (layout.tp_rank == 0), stats, torch.zeros_like(stats))
        summed = summed.to(parts.device)
        dist.all_reduce(summed, group=layout.tp_group)
        stats = summed.cpu()
    local = {name: [float(v) for v in stats[i]] for i, name in enumerate(names)}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    merged: dict[str, list[float]] = {}
    for part in gathered:
        merged.update(part)
    return dict(sorted(merged.items()))


def check_base(
    directory: Path, saved: Mapping[str, Any], mine: Mapping[str, list[float]], now: str | None
) -> None:
    """Refuse to put ``directory``'s adapters on a base other than the one they were trained on (pure).

    ``saved``: the checkpoint's ``base`` record; ``mine``: :func:`base_fingerprint` of this run;
    ``now``: this run's pretrained folder (None: a factory's model).
    """
    theirs = saved.get("fingerprint", {})
    if set(theirs) != set(mine):
        missing = sorted(set(theirs) ^ set(mine))
        raise CheckpointError(
            f"checkpoint {str(directory)!r} holds adapters only, trained on a base whose frozen parameters "
            f"differ from this run's by name: {missing[:6]}; build the run with the base it was trained on "
            f"(model.pretrained: {saved.get('pretrained')!r}) and the same model.lora target_modules"
        )
    differ = [name for name in sorted(mine) if not _close(theirs[name], mine[name])]
    if differ:
        was = saved.get("pretrained")
        raise CheckpointError(
            f"checkpoint {str(directory)!r} holds adapters only (adapter-only LoRA checkpoint), trained on a "
            f"base ({'model.pretrained: ' + repr(was) if was else 'a factory model'}) whose frozen weights "
            f"differ from this run's ({'model.pretrained: ' + repr(now) if now else 'a factory model'}) in "
            f"{len(differ)} parameters, e.g. {differ[:4]}: adapters are only meaningful on the base they were "
            "trained on. Set model.pretrained (or the factory) to that base"
        )


def _close(theirs: list[float], mine: list[float]) -> bool:
    s0, a0, q0 = theirs
    s1, a1, q1 = mine
    scale = max(abs(a0), abs(a1), 1e-300)
    return (
        abs(s0 - s1) <= RTOL * scale
        and math.isclose(a0, a1, rel_tol=RTOL, abs_tol=1e-300)
        and math.isclose(q0, q1, rel_tol=RTOL, abs_tol=1e-300)
    )
