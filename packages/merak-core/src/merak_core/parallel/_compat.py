"""The one place where merak-core touches torch APIs that moved between versions.

Everything here is a thin shim with a public-API fallback; no other module of
merak-core imports private torch names or branches on the torch version.
"""

from __future__ import annotations

import inspect
from datetime import timedelta
from typing import Any

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
    """``dist.broadcast`` with the source given as a rank of ``group`` (with or without ``group_src=``)."""
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
    """The key-value store of the default process group; None when there is none to reach.

    torch's accessor is private; where it is missing, the store torchrun serves (``MASTER_ADDR``,
    ``MASTER_PORT``: the env:// rendezvous every launch by ``merak train`` uses) is reached as a
    client under the prefix ``merak`` (:func:`_env_store`).
    """
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    if getter is None:
        return _env_store()
    try:
        return getter()
    except (RuntimeError, ValueError):
        return None


def _env_store() -> dist.Store | None:
    """A client of the env:// rendezvous store, keys under the prefix ``merak``; None without one (or unreachable)."""
    import os

    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not dist.is_initialized() or not host or not port or not port.isdigit():
        return None
    try:
        client = dist.TCPStore(
            host, int(port), is_master=False, timeout=timedelta(seconds=30), wait_for_workers=False
        )
    except (RuntimeError, ValueError, OSError):
        return None
    return dist.PrefixStore("merak", client)


def fake_process_group_store() -> type | None:
    """The store class of torch's fake process group backend ("fake": groups record their ranks,
    collectives do nothing), or None when this torch does not ship it. Used by dry runs."""
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError:
        return None
    return FakeStore


def _fsdp_state(root: torch.nn.Module) -> Any:
    """FSDP2's state object of the ``fully_shard`` root ``root`` (the entry of the private reads below)."""
    from torch.distributed.fsdp import fully_shard

    return fully_shard.state(root)  # type: ignore[attr-defined]


def _fsdp_private_groups(root: torch.nn.Module) -> tuple[Any, list[Any]] | None:
    """(root state, every parameter group under ``root``) read from FSDP2's private state, or None when
    this torch lays that state out otherwise (an attribute missing or renamed).

    Every private name :func:`fsdp_reduce_gradients` and :func:`fsdp_unsharded_bytes` read is probed
    here, so a torch without one of them takes the public paths for both, never half of each.
    """
    from torch.distributed.fsdp import FSDPModule

    try:
        # The FSDP2 modules under ``root`` (public), in the order FSDP2 lists their states itself.
        states = [_fsdp_state(module) for module in root.modules() if isinstance(module, FSDPModule)]
        state = states[0]
        groups = [group for sub in states for group in _param_groups_of(sub)]
        if not callable(state._root_post_backward_final_callback):
            return None
        for group in groups:
            if not callable(group.post_backward):
                return None
            for fsdp_param in group.fsdp_params:
                fsdp_param.all_gather_outputs  # noqa: B018  (probe)
                fsdp_param.unsharded_accumulated_grad  # noqa: B018  (probe)
    except (AttributeError, TypeError, IndexError):
        return None
    return state, groups


def _param_groups_of(state: Any) -> list[Any]:
    """The parameter groups of one FSDP2 state: a list where torch supports several per state, else the one."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = state._fsdp_param_group  # torch with one group per state; AttributeError when neither exists
    return [] if group is None else [group]


def fsdp_can_defer_reduce(root: torch.nn.Module) -> bool:
    """True when :func:`fsdp_reduce_gradients` can run on this torch (FSDP2's private state is as expected).

    When False, a caller keeps FSDP2's gradient sync on for every backward instead (public API: one
    reduce-scatter per backward, the same sum; more communication, no unsharded gradients between
    backwards), see [Note: one gradient sync per step] in ``merak_core.parallel.fsdp``.
    """
    return _fsdp_private_groups(root) is not None


def fsdp_reduce_gradients(root: torch.nn.Module) -> None:
    """Run FSDP2's post-backward of every parameter group under ``root`` now, then its end-of-backward callback.

    For gradients accumulated with ``set_requires_gradient_sync(False)`` over backwards that the
    caller drives (pipeline microbatches): the same calls torch.distributed.pipelining makes for
    its REDUCE_GRAD action. Private FSDP2 state: callers check :func:`fsdp_can_defer_reduce` before
    the step's backwards and otherwise sync every backward; this refuses rather than guess.
    """
    found = _fsdp_private_groups(root)
    if found is None:
        raise RuntimeError(
            f"torch {torch.__version__}: FSDP2's private post-backward state is not where merak-core reads it; "
            "the deferred gradient reduce-scatter cannot run. Arm the step only after fsdp_can_defer_reduce() "
            "said True (ShardedDataParallel does: it syncs every backward otherwise)"
        )
    state, groups = found
    for param_group in groups:
        param_group.post_backward()
    state._root_post_backward_final_callback()


def _private_unsharded_bytes(groups: list[Any]) -> tuple[int, int]:
    params = grads = 0
    for param_group in groups:
        for fsdp_param in param_group.fsdp_params:
            for tensor in fsdp_param.all_gather_outputs:
                params += tensor.untyped_storage().nbytes()
            # Created at the first all-gather: absent before it (nothing gathered, no gradient).
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            for grad in (getattr(unsharded, "grad", None), fsdp_param.unsharded_accumulated_grad):
                if grad is not None:
                    grads += grad.numel() * grad.element_size()
    return params, grads


def _public_unsharded_bytes(root: torch.nn.Module) -> tuple[int, int]:
    """What :func:`fsdp_unsharded_bytes` counts, from the parameters ``root`` has registered now.

    While a unit is gathered FSDP2 registers its unsharded parameters (plain tensors, views of the
    all-gather output) in place of the sharded DTensors, with the unsharded gradients on them; a
    resharded unit registers DTensors again. Exact when no unsharded gradient outlives its unit's
    gathering, which holds when every backward syncs (the fallback of :func:`fsdp_can_defer_reduce`);
    an all-gather prefetched for a unit that has not registered its result yet is not seen.
    """
    from torch.distributed.tensor import DTensor

    params = grads = 0
    storages: set[int] = set()
    for param in root.parameters():
        if isinstance(param, DTensor):
            continue
        storage = param.untyped_storage()
        if storage.nbytes() > 0 and storage.data_ptr() not in storages:
            storages.add(storage.data_ptr())
            params += storage.nbytes()
        if param.grad is not None:
            grads += param.grad.numel() * param.grad.element_size()
    return params, grads


def fsdp_unsharded_bytes(root: torch.nn.Module) -> tuple[int, int]:
    """(gathered parameter bytes, unsharded gradient bytes) FSDP2 holds now for the groups under ``root``.

    Storages FSDP2 has freed (resharded parameters) count 0; an accumulated gradient counts once.
    Read from FSDP2's private state where it is as expected, else from the registered parameters
    (:func:`_public_unsharded_bytes`, the same numbers when every backward syncs, which is what
    runs then). For memory measurements only.
    """
    found = _fsdp_private_groups(root)
    if found is None:
        return _public_unsharded_bytes(root)
    return _private_unsharded_bytes(found[1])


def foreach_norm(tensors: list[torch.Tensor], norm_type: float, dtype: torch.dtype) -> list[torch.Tensor]:
    """Each tensor's ``norm_type``-norm, computed in ``dtype`` (tensors of one device and dtype).

    torch's multi-tensor kernel (``torch._foreach_norm``: private by name, stable, what
    ``torch.nn.utils.clip_grad_norm_`` uses) where present, else one ``vector_norm`` per tensor.
    """
    multi = getattr(torch, "_foreach_norm", None)
    if multi is not None:
        return list(multi(tensors, norm_type, dtype=dtype))
    return [torch.linalg.vector_norm(t, norm_type, dtype=dtype) for t in tensors]


def foreach_mul_(tensors: list[torch.Tensor], scale: torch.Tensor) -> None:
    """Multiply every tensor in place by the 0-d ``scale`` (same device and dtype as the tensors).

    ``torch._foreach_mul_`` where present, else one ``mul_`` per tensor (the same products).
    """
    multi = getattr(torch, "_foreach_mul_", None)
    if multi is not None:
        multi(tensors, scale)
        return
    for t in tensors:
        t.mul_(scale)


def dtensor_offsets(tensor: Any) -> tuple[int, ...]:
    """Where a DTensor's local shard starts in its global tensor (a ZeRO-2/3 parameter's place).

    torch's own answer is DCP's hook ``DTensor.__create_chunk_list__`` (one chunk per rank for the
    shardings Merak makes). Without it the offsets follow from the public placements: each
    ``Shard(dim)`` over a mesh dimension of ``n`` ranks cuts ``dim`` as ``torch.chunk`` does (pieces of
    ``ceil(size / n)``, the last ones shorter or empty), the rank's piece at its mesh coordinate.
    """
    hook = getattr(tensor, "__create_chunk_list__", None)
    if hook is not None:
        (chunk,) = hook()
        return tuple(int(o) for o in chunk.offsets)
    from torch.distributed.tensor import Shard

    offsets = [0] * tensor.ndim
    sizes = list(tensor.shape)
    coordinate = tensor.device_mesh.get_coordinate()
    if coordinate is None:  # a rank outside the mesh holds nothing
        return tuple(offsets)
    for mesh_dim, placement in enumerate(tensor.placements):
        if isinstance(placement, Shard):
            n, at = tensor.device_mesh.size(mesh_dim), coordinate[mesh_dim]
            piece = -(-sizes[placement.dim] // n)
            offsets[placement.dim] += min(at * piece, sizes[placement.dim])
            sizes[placement.dim] = max(0, min(piece, sizes[placement.dim] - at * piece))
    return tuple(offsets)


def read_items_for_chunks(fqn: str, stored: Any, chunks: list[Any]) -> list[Any]:
    """DCP's read items that fill the ``chunks`` (``ChunkStorageMetadata``: offsets and sizes in the full
    tensor) of the tensor ``fqn`` from the checkpoint's chunks of it (``stored``: its
    ``TensorStorageMetadata``): one ``ReadItem`` per overlap of a requested and a stored chunk.

    torch's ``planner_helpers.create_read_items_for_chunk_list`` (a helper module DCP's own planner uses,
    not documented) where present, else :func:`_read_items_from_overlaps`: the same items from the public
    ``ReadItem`` / ``MetadataIndex`` and the overlap arithmetic, in (requested, stored) chunk order where
    torch's order follows its sweep (the items are a set to DCP: each names its target and its source).
    """
    try:
        from torch.distributed.checkpoint import planner_helpers
    except ImportError:
        planner_helpers = None  # type: ignore[assignment]
    create = getattr(planner_helpers, "create_read_items_for_chunk_list", None)
    if create is not None:
        return list(create(fqn, stored, chunks))
    return _read_items_from_overlaps(fqn, stored, chunks)


def _read_items_from_overlaps(fqn: str, stored: Any, chunks: list[Any]) -> list[Any]:
    """Every (requested chunk, stored chunk) pair that overlaps, as the ``ReadItem`` that copies the
    overlap: offsets relative to each chunk (``dest_offsets`` in the requested one, ``storage_offsets`` in
    the stored one), indexes naming the chunks by offsets and position (see :func:`read_items_for_chunks`)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    items = []
    for dest_at, chunk in enumerate(chunks):
        for storage_at, saved in enumerate(stored.chunks):
            starts = [max(a, b) for a, b in zip(chunk.offsets, saved.offsets, strict=True)]
            ends = [
                min(a + n, b + m)
                for a, n, b, m in zip(chunk.offsets, chunk.sizes, saved.offsets, saved.sizes, strict=True)
            ]
            if any(
                a >= b + m or b >= a + n
                for a, n, b, m in zip(chunk.offsets, chunk.sizes, saved.offsets, saved.sizes, strict=True)
            ):
                continue  # apart along a dim; as torch's test, an empty chunk inside the other one overlaps it
            items.append(
                ReadItem(
                    type=LoadItemType.TENSOR,
                    dest_index=MetadataIndex(fqn, chunk.offsets, dest_at),
                    dest_offsets=torch.Size(s - o for s, o in zip(starts, chunk.offsets, strict=True)),
                    storage_index=MetadataIndex(fqn, saved.offsets, storage_at),
                    storage_offsets=torch.Size(s - o for s, o in zip(starts, saved.offsets, strict=True)),
                    lengths=torch.Size(e - s for s, e in zip(starts, ends, strict=True)),
                )
            )
    return items
