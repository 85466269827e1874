"""The parallel layout: dp/cp/tp/pp degrees, this rank's coordinates, the device mesh and groups.

One :class:`ParallelLayout` is built once per job (by :func:`init` from torchrun's
environment, or by :meth:`ParallelLayout.build` when the default process group
already exists) and then passed explicitly to everything that communicates; there
is no module-level parallel state.

[Note: rank order] Global ranks are laid out on a 4-D mesh of shape
``(pp, dp, cp, tp)`` in C order: TP is the fastest-varying axis (ranks ``r`` and
``r + 1`` are TP peers, so a TP group sits on one node / NVLink island), then
context parallel (CP, also within a node by default), then DP, PP the
outermost::

    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

At ``cp=1`` this is ``(pp_rank * dp + dp_rank) * tp + tp_rank``, the 3-D order
every earlier layout used. The process groups are created with
``dist.new_group`` (every rank creates every group, in the same order, each with
an explicit timeout) and wrapped into a ``torch.distributed.device_mesh.DeviceMesh``
with axes named ``"pp"``, ``"dp"``, ``"cp"``, ``"tp"``, so DTensor-based code can
use ``layout.mesh["tp"]``. CP ranks hold the same parameters (like DP replicas),
so the gradient sync runs over ``dp_cp_group`` (same pp and tp coordinates).

Not done here: placing models, building pipelines, or choosing degrees (the
planner does that); the layout only validates and describes them. The rank formulas and the
DP x CP / EP group construction live in :mod:`merak_core.parallel.rank_grid`, the device choice in
:mod:`merak_core.parallel.devices` (import their names from there).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from merak_core.parallel import _compat
from merak_core.parallel.devices import (
    _env_int,
    _use_device,
    _wants_cuda,
    default_backend,
    select_device,
)
from merak_core.parallel.rank_grid import (
    _dp_cp_groups,
    _ep_groups,
    check_ep,
    coords_of,
    cp_rank_of,
    rank_of,
    resolve_degrees,
)

logger = logging.getLogger(__name__)

MESH_AXES: tuple[str, str, str, str] = ("pp", "dp", "cp", "tp")
"""Names of the device-mesh axes, outermost first."""

DEFAULT_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True, kw_only=True, eq=False)
class ParallelLayout:
    """Degrees, this rank's coordinates, the device mesh and the DP/CP/TP/PP process groups."""

    dp: int
    """Data-parallel degree (replicas)."""
    tp: int
    """Tensor-parallel degree (ranks that shard one layer)."""
    pp: int
    """Pipeline-parallel degree (stages)."""
    rank: int
    """This process's rank in the default process group."""
    world_size: int
    """Number of processes; always ``dp * cp * tp * pp``."""
    device: torch.device
    """The device this rank computes on (:func:`select_device`: ``cuda:LOCAL_RANK % visible GPUs`` or ``cpu``)."""
    mesh: DeviceMesh = field(repr=False)
    """4-D device mesh with axes ``("pp", "dp", "cp", "tp")``."""
    dp_group: ProcessGroup = field(repr=False)
    """This rank's data-parallel group (same pp, cp and tp coordinates)."""
    tp_group: ProcessGroup = field(repr=False)
    """This rank's tensor-parallel group (same pp, dp and cp coordinates)."""
    pp_group: ProcessGroup = field(repr=False)
    """This rank's pipeline group (same dp, cp and tp coordinates), ordered by stage."""
    timeout: timedelta = DEFAULT_TIMEOUT
    """Timeout of every group this layout created."""
    cp: int = 1
    """Context-parallel degree (ranks that split one sample's sequence)."""
    cp_group: ProcessGroup | None = field(default=None, repr=False)
    """This rank's context-parallel group (same pp, dp and tp coordinates); a one-rank group at cp=1."""
    dp_cp_group: ProcessGroup | None = field(default=None, repr=False)
    """The ranks holding the same parameters (same pp and tp): DP x CP, the gradient-sync group. None
    means ``dp_group`` (cp=1)."""
    ep: int = 1
    """Expert-parallel degree, carved out of dp (see [Note: expert-parallel groups]); 1: off."""
    ep_group: ProcessGroup | None = field(default=None, repr=False)
    """This rank's expert-parallel group: the ``ep`` DP ranks ``dp_rank // ep * ep + j`` of its stage/tp/cp
    coordinate, between which tokens travel to their experts. None at ep=1."""
    expert_replica_group: ProcessGroup | None = field(default=None, repr=False)
    """The ``dp / ep`` ranks holding the same experts (same ep rank in every DP block of ``ep``): the expert
    gradients' sync group. None at ep=1."""

    @property
    def grad_sync_group(self) -> ProcessGroup:
        """The group gradients are averaged over: DP, times CP when cp > 1 (CP ranks are replicas for the parameters)."""
        return self.dp_cp_group if self.dp_cp_group is not None else self.dp_group

    # ------------------------------------------------------------------ coordinates

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage index."""
        return coords_of(self.rank, dp=self.dp, tp=self.tp, cp=self.cp)[0]

    @property
    def dp_rank(self) -> int:
        """This rank's index in its DP group."""
        return coords_of(self.rank, dp=self.dp, tp=self.tp, cp=self.cp)[1]

    @property
    def tp_rank(self) -> int:
        """This rank's index in its TP group."""
        return coords_of(self.rank, dp=self.dp, tp=self.tp, cp=self.cp)[2]

    @property
    def cp_rank(self) -> int:
        """This rank's index in its CP group (which part of each sample's sequence it holds)."""
        return cp_rank_of(self.rank, tp=self.tp, cp=self.cp)

    @property
    def ep_rank(self) -> int:
        """This rank's index in its EP group (which block of ``experts / ep`` experts it holds)."""
        return self.dp_rank % self.ep

    @property
    def ep_ranks(self) -> list[int]:
        """Global ranks of this rank's EP group, in group-rank order (see [Note: expert-parallel groups])."""
        first = self.dp_rank - self.ep_rank
        return [self.rank_of(pp=self.pp_rank, dp=first + j, tp=self.tp_rank) for j in range(self.ep)]

    @property
    def expert_replica_ranks(self) -> list[int]:
        """Global ranks holding this rank's experts (same ep rank, every DP block), in DP order."""
        return [
            self.rank_of(pp=self.pp_rank, dp=b * self.ep + self.ep_rank, tp=self.tp_rank)
            for b in range(self.dp // self.ep)
        ]

    @property
    def is_first_stage(self) -> bool:
        """True on pipeline stage 0 (the ranks that read inputs)."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """True on the last pipeline stage (the ranks that read labels and compute the loss)."""
        return self.pp_rank == self.pp - 1

    def rank_of(self, *, pp: int, dp: int, tp: int, cp: int | None = None) -> int:
        """Global rank at mesh coordinates (pp, dp, cp, tp); ``cp=None``: this rank's cp coordinate."""
        cp_coord = self.cp_rank if cp is None else cp
        checks = (("pp", pp, self.pp), ("dp", dp, self.dp), ("cp", cp_coord, self.cp), ("tp", tp, self.tp))
        for name, value, size in checks:
            if not 0 <= value < size:
                raise ValueError(f"{name} coordinate {value} is outside [0, {size}) for layout {self}")
        return rank_of(pp, dp, tp, dp=self.dp, tp=self.tp, cp=self.cp, cp_rank=cp_coord)

    def coords_of(self, rank: int) -> tuple[int, int, int]:
        """Mesh coordinates ``(pp, dp, tp)`` of global ``rank`` (its cp coordinate: :func:`cp_rank_of`)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside [0, {self.world_size})")
        return coords_of(rank, dp=self.dp, tp=self.tp, cp=self.cp)

    def stage_rank(self, stage: int) -> int:
        """Global rank of pipeline stage ``stage`` in this rank's pipeline (same dp, cp, tp)."""
        return self.rank_of(pp=stage, dp=self.dp_rank, tp=self.tp_rank)

    @property
    def dp_ranks(self) -> list[int]:
        """Global ranks of this rank's DP group, in group-rank order."""
        return [self.rank_of(pp=self.pp_rank, dp=d, tp=self.tp_rank) for d in range(self.dp)]

    @property
    def cp_ranks(self) -> list[int]:
        """Global ranks of this rank's CP group, in group-rank order (sequence-shard order)."""
        return [self.rank_of(pp=self.pp_rank, dp=self.dp_rank, tp=self.tp_rank, cp=c) for c in range(self.cp)]

    @property
    def tp_ranks(self) -> list[int]:
        """Global ranks of this rank's TP group, in group-rank order."""
        return [self.rank_of(pp=self.pp_rank, dp=self.dp_rank, tp=t) for t in range(self.tp)]

    @property
    def pp_ranks(self) -> list[int]:
        """Global ranks of this rank's pipeline, stage 0 first."""
        return [self.stage_rank(s) for s in range(self.pp)]

    def describe(self) -> str:
        """One line for logs: degrees and this rank's coordinates."""
        if self.ep > 1:
            return (
                f"rank {self.rank}/{self.world_size} dp={self.dp} (ep={self.ep}) cp={self.cp} tp={self.tp} "
                f"pp={self.pp} (pp_rank={self.pp_rank}, dp_rank={self.dp_rank}, ep_rank={self.ep_rank}, "
                f"cp_rank={self.cp_rank}, tp_rank={self.tp_rank}) on {self.device}"
            )
        if self.cp == 1:
            return (
                f"rank {self.rank}/{self.world_size} dp={self.dp} tp={self.tp} pp={self.pp} "
                f"(pp_rank={self.pp_rank}, dp_rank={self.dp_rank}, tp_rank={self.tp_rank}) on {self.device}"
            )
        return (
            f"rank {self.rank}/{self.world_size} dp={self.dp} cp={self.cp} tp={self.tp} pp={self.pp} "
            f"(pp_rank={self.pp_rank}, dp_rank={self.dp_rank}, cp_rank={self.cp_rank}, "
            f"tp_rank={self.tp_rank}) on {self.device}"
        )

    # ------------------------------------------------------------------ construction

    @classmethod
    def build(
        cls,
        dp: int | None = None,
        tp: int = 1,
        pp: int = 1,
        *,
        cp: int = 1,
        ep: int = 1,
        device: torch.device | str | None = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
    ) -> ParallelLayout:
        """Build the layout over an already initialised default process group.

        Collective: every rank must call it with the same degrees. Degrees are
        validated against the world size before any group is created. The groups
        are created axis by axis in ``MESH_AXES`` order, then (cp > 1 only) the
        DP x CP gradient-sync groups.
        """
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ParallelLayout.build needs an initialised default process group: call "
                "merak_core.init(...) instead, or torch.distributed.init_process_group first"
            )
        world_size = dist.get_world_size()
        dp, tp, pp = resolve_degrees(world_size, dp, tp, pp, cp=cp)
        check_ep(dp, ep)
        rank = dist.get_rank()
        dev = select_device(device)
        _use_device(dev)
        grid = torch.arange(world_size, dtype=torch.int).reshape(pp, dp, cp, tp)
        mine = coords_of(rank, dp=dp, tp=tp, cp=cp)
        # Every rank creates every group in the same order (new_group is collective).
        groups: dict[str, ProcessGroup] = {}
        for axis_index, axis in enumerate(MESH_AXES):
            moved = grid.movedim(axis_index, -1).reshape(-1, grid.shape[axis_index])
            for ranks_t in moved:
                ranks = [int(r) for r in ranks_t]
                # backend=None: the default group's backend configuration (e.g. cpu:gloo,cuda:nccl).
                group = _compat.new_group(ranks, timeout, None)
                if rank in ranks:
                    groups[axis] = group
        dp_cp_group = _dp_cp_groups(grid, rank, timeout) if cp > 1 else None
        ep_group, replica_group = _ep_groups(grid, rank, ep, timeout) if ep > 1 else (None, None)
        mesh = DeviceMesh.from_group(
            [groups[axis] for axis in MESH_AXES], dev.type, mesh=grid, mesh_dim_names=MESH_AXES
        )
        layout = cls(
            dp=dp,
            tp=tp,
            pp=pp,
            cp=cp,
            rank=rank,
            world_size=world_size,
            device=dev,
            mesh=mesh,
            dp_group=groups["dp"],
            tp_group=groups["tp"],
            pp_group=groups["pp"],
            cp_group=groups["cp"],
            dp_cp_group=dp_cp_group,
            ep=ep,
            ep_group=ep_group,
            expert_replica_group=replica_group,
            timeout=timeout,
        )
        assert (layout.pp_rank, layout.dp_rank, layout.tp_rank) == mine
        logger.info("parallel layout: %s", layout.describe())
        return layout

    @classmethod
    def from_groups(
        cls,
        *,
        dp_group: ProcessGroup,
        tp_group: ProcessGroup,
        pp_group: ProcessGroup,
        device: torch.device | str | None = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
    ) -> ParallelLayout:
        """Wrap groups someone else created (a cp=1 layout); checks they follow [Note: rank order].

        Collective: the size-1 CP groups are created here.
        """
        dp, tp, pp = (dist.get_world_size(g) for g in (dp_group, tp_group, pp_group))
        world_size = dist.get_world_size()
        resolve_degrees(world_size, dp, tp, pp)
        rank = dist.get_rank()
        pp_rank, dp_rank, tp_rank = coords_of(rank, dp=dp, tp=tp)
        expected = {
            "dp": [rank_of(pp_rank, d, tp_rank, dp=dp, tp=tp) for d in range(dp)],
            "tp": [rank_of(pp_rank, dp_rank, t, dp=dp, tp=tp) for t in range(tp)],
            "pp": [rank_of(s, dp_rank, tp_rank, dp=dp, tp=tp) for s in range(pp)],
        }
        for axis, group in (("dp", dp_group), ("tp", tp_group), ("pp", pp_group)):
            got = dist.get_process_group_ranks(group)
            if got != expected[axis]:
                raise ValueError(
                    f"{axis}_group of rank {rank} holds ranks {got}, but the (pp, dp, tp) layout with "
                    f"dp={dp} tp={tp} pp={pp} expects {expected[axis]}: build the groups with "
                    "ParallelLayout.build or follow rank = (pp_rank*dp + dp_rank)*tp + tp_rank"
                )
        dev = select_device(device)
        _use_device(dev)
        grid = torch.arange(world_size, dtype=torch.int).reshape(pp, dp, 1, tp)
        # cp=1: every rank is its own CP group (new_group is collective: all ranks create all of them).
        cp_group = None
        for r in range(world_size):
            group = _compat.new_group([r], timeout, None)
            if r == rank:
                cp_group = group
        assert cp_group is not None
        mesh = DeviceMesh.from_group(
            [pp_group, dp_group, cp_group, tp_group], dev.type, mesh=grid, mesh_dim_names=MESH_AXES
        )
        return cls(
            dp=dp,
            tp=tp,
            pp=pp,
            rank=rank,
            world_size=world_size,
            device=dev,
            mesh=mesh,
            dp_group=dp_group,
            tp_group=tp_group,
            pp_group=pp_group,
            cp_group=cp_group,
            timeout=timeout,
        )


def init(
    dp: int | None = None,
    tp: int = 1,
    pp: int = 1,
    *,
    cp: int = 1,
    ep: int = 1,
    backend: str | None = None,
    device: torch.device | str | None = None,
    timeout: timedelta = DEFAULT_TIMEOUT,
) -> ParallelLayout:
    """Initialise distributed training and return the :class:`ParallelLayout`.

    Reads torchrun's ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` (a plain
    ``python script.py`` is one rank), validates ``dp*cp*tp*pp == WORLD_SIZE``
    (``dp=None`` infers it) before any collective, initialises the default
    process group if nobody did (:func:`ensure_process_group`: the device from
    :func:`select_device`, ``nccl`` for a CUDA device, ``gloo`` otherwise, eager
    initialisation on CUDA), then builds every group with ``timeout``.
    """
    if dist.is_initialized():
        check_ep(resolve_degrees(dist.get_world_size(), dp, tp, pp, cp=cp)[0], ep)
        return ParallelLayout.build(dp, tp, pp, cp=cp, ep=ep, device=device, timeout=timeout)
    world_size = _env_int("WORLD_SIZE", 1)
    assert world_size is not None
    check_ep(resolve_degrees(world_size, dp, tp, pp, cp=cp)[0], ep)
    dev = ensure_process_group(device, backend=backend, timeout=timeout)
    return ParallelLayout.build(dp, tp, pp, cp=cp, ep=ep, device=dev, timeout=timeout)


# ---------------------------------------------------------------------------- devices
#
# [Note: one device] Every choice of "which device does this rank compute on" goes through
# select_device: the layout's device, the Trainer's, the planner's and the launcher's. A CUDA
# rank uses GPU ``LOCAL_RANK % torch.cuda.device_count()``: with every GPU visible to every
# process that is GPU LOCAL_RANK; with one GPU visible per process (CUDA_VISIBLE_DEVICES set
# per rank) it is GPU 0 of that process. ``torch.cuda.current_device()`` is never the answer:
# it is GPU 0 on every rank until someone calls set_device, and NCCL refuses two ranks on one
# GPU. The default group is initialised eagerly (``device_id=``) on CUDA, so every
# point-to-point op and collective of a group runs on one communicator.


def ensure_process_group(
    device: torch.device | str | None = None,
    *,
    backend: str | None = None,
    timeout: timedelta = DEFAULT_TIMEOUT,
) -> torch.device:
    """Initialise the default process group as :func:`init` does (if nobody did); this rank's device.

    The device comes from :func:`select_device` (``device``, else from ``backend``, else CUDA when
    available) and becomes the current CUDA device; ``backend`` defaults to ``nccl`` for a CUDA
    device and ``gloo`` otherwise; on CUDA the group is initialised eagerly with ``device_id``
    (one communicator for every op). A plain single process needs no launcher (a local store).
    With a group already there: the device for its backend, and nothing is initialised.
    """
    if dist.is_initialized():
        dev = select_device(device)
        _use_device(dev)
        return dev
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    assert world_size is not None and rank is not None
    dev = select_device(device, backend=backend)
    if backend is None:
        backend = default_backend(dev)
    elif dev.type == "cuda" and not _wants_cuda(backend):
        raise ValueError(
            f"backend={backend!r} cannot move tensors on {dev}: use backend='nccl' (or "
            "'cpu:gloo,cuda:nccl'), or device='cpu'"
        )
    _use_device(dev)
    kwargs: dict[str, object] = {"timeout": timeout}
    if dev.type == "cuda":
        kwargs["device_id"] = dev
    if world_size == 1 and "MASTER_ADDR" not in os.environ:
        # A plain single-process run: no launcher, no rendezvous needed.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)  # type: ignore[arg-type]
    else:
        dist.init_process_group(backend, rank=rank, world_size=world_size, **kwargs)  # type: ignore[arg-type]
    logger.info("initialised %s process group: rank %d of %d on %s", backend, rank, world_size, dev)
    world = dist.group.WORLD
    if world is not None:
        atexit.register(_destroy_at_exit, world)
    return dev


# [Note: teardown at exit] A script that initialised its groups through init() and ends without
# dist.destroy_process_group() leaves gloo's worker threads running into the interpreter's
# shutdown. A worker that drops its last reference to a finished collective (the tensors in it)
# after that point needs the GIL, which a finalising interpreter no longer gives: the process
# aborts ("terminate called without an active exception", SIGABRT, torchrun exit 1), in about one
# run in six on a loaded 2-core machine. So the group init() created is destroyed at exit, while
# the interpreter is whole: every group of the layout with it, the worker threads joined. Only
# after a normal end: after an uncaught exception a collective may still wait on a dead peer, and
# destroying its group would wait with it (up to the timeout) where the process should end.


def _destroy_at_exit(world: ProcessGroup) -> None:
    """Destroy the default group this module initialised, if it is still the default one (see [Note: teardown at exit])."""
    if getattr(sys, "last_value", None) is not None:  # an uncaught exception ended the script
        return
    if dist.is_initialized() and dist.group.WORLD is world:
        dist.destroy_process_group()


__all__ = ["MESH_AXES", "ParallelLayout", "ensure_process_group", "init"]
