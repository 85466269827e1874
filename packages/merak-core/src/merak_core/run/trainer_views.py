"""The Trainer's read-only views of its step engine and train state (a mixin of properties).

Owns the accessors :class:`merak_core.trainer.Trainer` exposes over its parts: the pipeline runner,
optimizer, scheduler, parameters and DP sync of :class:`merak_core.run.engine.ParallelEngine`, the last
step's timings and gradient norm, the global step (kept in the checkpointed
:class:`~merak_core.checkpoint.parts.TrainState`) and the RNG tracker checkpoints carry. No logic of
its own: each property reads (or sets) one attribute of the part that owns it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from merak_core.checkpoint.parts import CheckpointParts, TrainState
    from merak_core.run.engine import ParallelEngine


class EngineViews:
    """Properties over ``engine``, ``train_state`` and ``checkpoint_parts`` (set by the Trainer)."""

    engine: ParallelEngine
    train_state: TrainState
    checkpoint_parts: CheckpointParts

    @property
    def runner(self) -> Any:
        """The pipeline runner (:class:`merak_pipe.PipelineRunner`)."""
        return self.engine.runner

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.engine.optimizer

    @property
    def lr_scheduler(self) -> torch.optim.lr_scheduler.LambdaLR:
        return self.engine.lr_scheduler

    @property
    def params(self) -> list[nn.Parameter]:
        """This rank's parameters (each once)."""
        return self.engine.params

    @property
    def dp_sync(self) -> Any:
        return self.engine.dp_sync

    @property
    def schedule_name(self) -> str:
        """The merak-pipe schedule the runner runs."""
        return self.engine.schedule_name

    @property
    def last_pipeline_s(self) -> float:
        """Seconds of the last step's pipeline part."""
        return self.engine.last_pipeline_s

    @property
    def last_grad_norm(self) -> float | None:
        """The last step's gradient norm before clipping (None when ``max_grad_norm`` is 0)."""
        return self.engine.last_grad_norm

    @property
    def global_step(self) -> int:
        """Optimizer steps done (the train state a checkpoint carries)."""
        return self.train_state.global_step

    @global_step.setter
    def global_step(self, value: int) -> None:
        self.train_state.global_step = value

    @property
    def rng_tracker(self) -> Any:
        """A ``merak_tp.RNGTracker`` the model forks for dropout on TP-sharded activations, if any:
        checkpoints save and restore its states per rank (see :mod:`merak_core.checkpoint.state`)."""
        return self.checkpoint_parts.rng_tracker

    @rng_tracker.setter
    def rng_tracker(self, tracker: Any) -> None:
        self.checkpoint_parts.rng_tracker = tracker


__all__ = ["EngineViews"]
