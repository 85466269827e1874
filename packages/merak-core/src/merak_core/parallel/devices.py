"""Which device a rank computes on, and which backend and tensors its collectives use.

Owns the device choice of [Note: one device] (in :mod:`merak_core.parallel.layout`): :func:`select_device` (the
only place that chooses one), :func:`local_rank`, :func:`default_backend`, :func:`collective_device`,
and the reader of torchrun's integer environment variables (which :func:`~merak_core.parallel.layout.init`
uses too). Initialising the default process group stays in :mod:`merak_core.parallel.layout`
(:func:`~merak_core.parallel.layout.ensure_process_group`), which re-exports the public names.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


def _env_int(name: str, default: int | None) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"environment variable {name}={raw!r} is not an integer; launch with torchrun"
        ) from None


def _wants_cuda(backend: str) -> bool:
    """Whether a backend string runs CUDA tensors through NCCL (``"nccl"``, ``"cpu:gloo,cuda:nccl"``)."""
    text = backend.lower()
    return "nccl" in text


def local_rank() -> int:
    """This process's index on its node: ``LOCAL_RANK``, else the default group's rank, else 0."""
    value = _env_int("LOCAL_RANK", None)
    if value is not None:
        if value < 0:
            raise ValueError(f"LOCAL_RANK={value} is negative; launch with torchrun")
        return value
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0


def select_device(device: torch.device | str | None = None, *, backend: str | None = None) -> torch.device:
    """The device this rank computes on (see [Note: one device]); the only place that chooses one.

    ``device``: ``"cpu"``, ``"cuda"`` (GPU ``local_rank() % device_count()``), ``"cuda:i"``
    (that GPU, which must be visible), or None: CUDA when the backend runs NCCL (``backend``,
    else the default group's, e.g. ``"nccl"`` or ``"cpu:gloo,cuda:nccl"``) and CUDA is
    available, CPU for a gloo-only backend; with no backend and no group, CUDA when available.
    Pure: no process group is touched and ``set_device`` is not called.
    """
    if device is None:
        if backend is None and dist.is_available() and dist.is_initialized():
            backend = str(dist.get_backend())
        wanted_cuda = _wants_cuda(backend) if backend is not None else True
        device = "cuda" if wanted_cuda and torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ValueError(f"device={str(device)!r} was requested but CUDA is not available: pass device='cpu'")
    if dev.index is None:
        return torch.device("cuda", local_rank() % count)
    if dev.index >= count:
        raise ValueError(
            f"device={str(device)!r}: this process sees {count} CUDA device(s) (indices 0..{count - 1}, "
            "after CUDA_VISIBLE_DEVICES): pass device='cuda' to take LOCAL_RANK's device"
        )
    return dev


def default_backend(device: torch.device) -> str:
    """The process-group backend for ``device``: ``nccl`` on CUDA, ``gloo`` otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


def collective_device(group: ProcessGroup | None = None) -> torch.device:
    """The device of the tensors ``group``'s collectives take: this rank's GPU for a NCCL backend, else CPU.

    For code that makes its own small tensors to reduce or broadcast (flags, timings, metrics): an
    NCCL group moves only tensors on the rank's own GPU.
    """
    backend = str(dist.get_backend(group))
    if _wants_cuda(backend) and torch.cuda.is_available():
        return select_device("cuda")
    return torch.device("cpu")


def _use_device(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.set_device(dev)


__all__ = ["autocast", "collective_device", "default_backend", "local_rank", "select_device"]


def autocast(bf16: bool, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """bf16 autocast on ``device`` when ``bf16``, else a context that does nothing."""
    if bf16:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
