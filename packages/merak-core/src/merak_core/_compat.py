"""The one place where merak-core touches torch APIs that moved between versions.

Everything here is a thin shim with a public-API fallback; no other module of
merak-core imports private torch names or branches on the torch version.
"""

from __future__ import annotations

import inspect
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

_BROADCAST_HAS_GROUP_SRC = "group_src" in inspect.signature(dist.broadcast).parameters


def group_to_global_rank(group: ProcessGroup, group_rank: int) -> int:
    """The default-group rank of rank ``group_rank`` of ``group``."""
    return dist.get_global_rank(group, group_rank)


def broadcast_from_group_rank(
    tensor: torch.Tensor, group_src: int, group: ProcessGroup | None, *, async_op: bool
) -> dist.Work | None:
    """``dist.broadcast`` with the source given as a rank of ``group`` (any torch >= 2.4)."""
    if _BROADCAST_HAS_GROUP_SRC:
        return dist.broadcast(tensor, group=group, group_src=group_src, async_op=async_op)
    src = group_src if group is None else group_to_global_rank(group, group_src)
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def new_group(ranks: list[int], timeout: timedelta, backend: str | None) -> ProcessGroup:
    """``dist.new_group`` over ``ranks`` with an explicit timeout (collective over every rank)."""
    group = dist.new_group(ranks=ranks, timeout=timeout, backend=backend)
    if group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
        # Ranks outside ``ranks`` get a sentinel back; callers only keep their own groups.
        return dist.GroupMember.NON_GROUP_MEMBER  # type: ignore[return-value]
    return group


def default_store() -> dist.Store | None:
    """The key-value store of the default process group (None when torch does not expose it)."""
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    if getter is None:
        return None
    try:
        return getter()
    except (RuntimeError, ValueError):
        return None


def fake_process_group_store() -> type | None:
    """The store class of torch's fake process group backend ("fake": groups record their ranks,
    collectives do nothing), or None when this torch does not ship it. Used by dry runs."""
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError:
        return None
    return FakeStore


def fsdp_reduce_gradients(root: torch.nn.Module) -> None:
    """Run FSDP2's post-backward of every parameter group under ``root`` now, then its end-of-backward callback.

    For gradients accumulated with ``set_requires_gradient_sync(False)`` over backwards that the
    caller drives (pipeline microbatches): the same calls torch.distributed.pipelining makes for
    its REDUCE_GRAD action. Private FSDP2 state; the only place merak-core touches it.
    """
    from torch.distributed.fsdp import fully_shard

    state = fully_shard.state(root)  # type: ignore[attr-defined]
    for sub_state in state._state_ctx.all_states:
        for param_group in sub_state._fsdp_param_groups:
            param_group.post_backward()
    state._root_post_backward_final_callback()


def fsdp_unsharded_bytes(root: torch.nn.Module) -> tuple[int, int]:
    """(gathered parameter bytes, unsharded gradient bytes) FSDP2 holds now for the groups under ``root``.

    Storages FSDP2 has freed (resharded parameters) count 0; an accumulated gradient counts once.
    Private FSDP2 state, read for memory measurements only.
    """
    from torch.distributed.fsdp import fully_shard

    state = fully_shard.state(root)  # type: ignore[attr-defined]
    params = grads = 0
    for sub_state in state._state_ctx.all_states:
        for param_group in sub_state._fsdp_param_groups:
            for fsdp_param in param_group.fsdp_params:
                for tensor in getattr(fsdp_param, "all_gather_outputs", []):
                    params += tensor.untyped_storage().nbytes()
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                for grad in (getattr(unsharded, "grad", None), fsdp_param.unsharded_accumulated_grad):
                    if grad is not None:
                        grads += grad.numel() * grad.element_size()
    return params, grads
