"""``model.lora`` against the model built on the meta device: its targets match linear modules."""

from __future__ import annotations

from torch import nn

from merak_core.checks.base import PreflightError
from merak_core.lora import LoraConfig


def check_lora_targets(model: nn.Module, lora: LoraConfig | None) -> list[str]:
    """What was checked (nothing without LoRA); :class:`PreflightError` for targets that match nothing
    (with the nearest module names) or a module LoRA cannot wrap."""
    if lora is None:
        return []
    from merak_core.lora.apply import check_targets

    try:
        targets = check_targets(model, lora)
    except ValueError as exc:
        raise PreflightError(str(exc)) from None
    return [f"model.lora wraps {len(targets)} linear modules"]
