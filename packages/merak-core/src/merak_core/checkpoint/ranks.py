"""The collective helpers of saving and loading: a barrier that names the missing rank, rank-0 warnings.

Not done here: which collectives a save or a load runs (``save.py``, ``load.py``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

logger = logging.getLogger(__name__)

__all__ = ["barrier", "warn_rank0"]


def barrier(what: str) -> None:
    """A barrier that names the missing rank on gloo (``monitored_barrier``); timeouts of the default group."""
    if dist.get_world_size() == 1:
        return
    if dist.get_backend() == "gloo":
        try:
            dist.monitored_barrier(wait_all_ranks=True)
        except RuntimeError as exc:
            raise RuntimeError(f"rank {dist.get_rank()}: barrier '{what}' failed: {exc}") from exc
    else:
        dist.barrier()


def warn_rank0(message: str, *args: Any) -> None:
    if dist.get_rank() == 0:
        logger.warning(message, *args)
