"""What a checkpoint saves and restores, handed to :class:`~merak_core.checkpoint.CheckpointManager` explicitly.

The manager never sees the loop that owns these parts: it gets the run's arguments and layout,
the composed model, the optimizer and its learning-rate schedule, the data position (the
training loader's state) and the train state (the optimizer steps done, which :meth:`load` sets).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from merak_core.config import TrainingArguments
    from merak_core.parallel.compose import ParallelModel
    from merak_core.parallel.layout import ParallelLayout

__all__ = ["CheckpointParts", "TrainState"]


@dataclass
class TrainState:
    """The loop's position that a checkpoint carries."""

    global_step: int = 0
    """Optimizer steps done."""


@dataclass
class CheckpointParts:
    """Everything a checkpoint of one rank holds (see the module docstring)."""

    args: TrainingArguments
    layout: ParallelLayout
    device: torch.device
    model: ParallelModel
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    """The optimizer's ``LambdaLR`` (its position is saved; its function comes from the run)."""
    train_loader: Any
    """The data position: a :class:`~merak_core.data.loader.StageAwareDataLoader`, or None without training data."""
    train: TrainState
    rng_tracker: Any = None
    """A ``merak_tp.RNGTracker`` whose stored states are saved per rank, if any."""
    pretrained: str | None = None
    """The Hugging Face folder the run started from, recorded in the metadata for ``merak export``."""
