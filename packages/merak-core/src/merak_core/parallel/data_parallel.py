"""Data-parallel gradient synchronisation: bucketed all-reduce overlapped with backward.

:class:`DataParallelGradSync` averages the gradients of a set of parameters over
a DP process group. Parameters are packed, in reverse registration order (the
usual order in which backward produces their gradients), into buckets of about
``bucket_size_bytes``. During the backward of the *last* microbatch (the caller
arms it with :meth:`~DataParallelGradSync.prepare_last_microbatch` or the
:meth:`~DataParallelGradSync.sync_on_this_backward` context; a pipeline schedule
that drives the backwards itself arms a whole step with
:meth:`~DataParallelGradSync.prepare_step`), a
post-accumulate-grad hook copies each final gradient into its bucket; when a
bucket is full it launches an asynchronous all-reduce, so communication runs
while autograd computes the remaining gradients. :meth:`~DataParallelGradSync.finish`
launches what is left, waits, and writes the averages back into ``param.grad``.

[Note: reduction precision and memory] The buffers are float32 for bf16/fp16
parameters (a sum of many bf16 gradients loses the low bits), the parameter's
dtype otherwise (``reduce_dtype`` overrides). NCCL averages in the collective
(``ReduceOp.AVG``); gloo has no ``AVG``, so the sum is divided afterwards. The
buffers live for one step only: after ``finish`` a parameter whose dtype is the
buffer's gets a view of the averaged buffer as its gradient (autograd's
gradient is dropped, no copy back), otherwise the average is copied into its
gradient and the buffer is freed. Between steps the gradients are the only copy
(a persistent bucket would hold a second copy of every gradient for the whole
run); the next armed backward allocates fresh buffers.

[Note: bucket launch order] Collectives on one group must be issued in the same
order on every rank. Gradients may become ready in a different order on different
ranks (data-dependent control flow, unused parameters), so a ready bucket is only
launched once every bucket with a smaller index has been launched (as torch DDP
does); buckets whose parameters never receive a gradient in this backward are
launched by ``finish``. The order is therefore the bucket index order on every rank.

[Note: missing gradients] A parameter with no gradient on some rank contributes
zeros; after ``finish`` every synchronised parameter has a gradient (zero when no
rank produced one), so every DP replica applies the same optimizer update.

[Note: deferred parameters] A gradient captured by the hook is the one written back
(averaged) by ``finish``, so a gradient changed between its last backward and ``finish``
would lose that change. Parameters shared by several pipeline stages are such a case
when the pipeline runner sums their gradients over the stages at the end of its step:
pass them as ``deferred_params``. They sit in their own buckets, last, and are reduced
by ``finish`` from their final gradient (both reductions are sums, so the order
DP-then-PP or PP-then-DP gives the same average).

[Note: ZeRO-1 reduce-scatter] With ``shard_gradients=True`` each bucket is reduce-scattered:
its parameters are owned whole by DP ranks and laid out owner by owner in equal padded
segments (:mod:`merak_core.parallel.zero_layout`), so rank ``r`` receives the average of the ones it
owns; after ``finish`` the others have no gradient (their unreduced local values are
dropped). :class:`~merak_core.parallel.zero.ZeroOptimizer` steps the shard and all-gathers the
parameters with the same layout: ``2 (dp-1)/dp`` of the gradient bytes per rank and step.
At dp=2 the sums equal the all-reduce's bit for bit; at dp > 2 the backend may add the
ranks' terms in another order (float rounding).

Not done here: the sync of parameters shared across pipeline stages (tied
embeddings; that is a PP-group all-reduce the trainer composes), and sharding of
gradients beyond one step (ZeRO-2, :mod:`merak_core.parallel.fsdp`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from merak_core.parallel.dp_buckets import _Bucket, _default_reduce_dtype, _named_params, _place_by_owner
from merak_core.parallel.zero_layout import reduce_scatter_dim0

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_SIZE_BYTES = 25 * 1024 * 1024


class DataParallelGradSync:
    """Average gradients over a DP group in buckets, overlapped with the last backward.

    Args:
        params: the parameters to synchronise, or a module (its parameters that
            require grad, deduplicated; names are used in error messages).
        group: the DP process group (``layout.dp_group``); ``None`` means the default group.
        bucket_size_bytes: a bucket is closed once it holds at least this many bytes (in the
            reduction dtype), as in DDP; so buckets are this size or a little larger.
        reduce_dtype: dtype of the communication buffers; default: float32 for bf16/fp16
            parameters, else each parameter's dtype (see [Note: reduction precision and memory]).
        average: divide the sum by the DP size (the default); ``False`` keeps the sum.
        deferred_params: parameters whose gradients change after their last backward and
            before :meth:`finish` (see [Note: deferred parameters]); reduced by ``finish``.
        shard_gradients: reduce-scatter each bucket to the DP rank owning its parameters instead of
            all-reducing it (ZeRO-1, see [Note: ZeRO-1 reduce-scatter]); pass the sync to
            :class:`~merak_core.parallel.zero.ZeroOptimizer`, which all-gathers the updated parameters.

    Usage with gradient accumulation (``num_microbatches`` backwards per step)::

        sync = DataParallelGradSync(model, layout.dp_group)
        for i, batch in enumerate(microbatches):
            loss = loss_fn(model(batch.inputs), batch.labels) / num_microbatches
            if i < num_microbatches - 1:
                loss.backward()              # no communication
            else:
                with sync.sync_on_this_backward():
                    loss.backward()          # buckets all-reduced while backward runs
        optimizer.step()

    ``sync.sync()`` is the blocking, non-overlapped variant (after every backward).
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter] | nn.Module,
        group: ProcessGroup | None = None,
        *,
        bucket_size_bytes: int = DEFAULT_BUCKET_SIZE_BYTES,
        reduce_dtype: torch.dtype | None = None,
        average: bool = True,
        deferred_params: Iterable[nn.Parameter] = (),
        shard_gradients: bool = False,
    ) -> None:
        if (
            isinstance(bucket_size_bytes, bool)
            or not isinstance(bucket_size_bytes, int)
            or bucket_size_bytes < 1
        ):
            raise ValueError(
                f"bucket_size_bytes must be a positive integer, got {bucket_size_bytes!r}; "
                f"the default is {DEFAULT_BUCKET_SIZE_BYTES} (25 MiB)"
            )
        if reduce_dtype is not None and not reduce_dtype.is_floating_point:
            raise ValueError(f"reduce_dtype must be a floating dtype, got {reduce_dtype}")
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.bucket_size_bytes = bucket_size_bytes
        self.reduce_dtype = reduce_dtype
        self.average = average
        self._avg_in_collective: bool | None = None  # decided at the first launch (backend and device)
        named = _named_params(params)
        if not named:
            raise ValueError("DataParallelGradSync got no parameters that require grad")
        self._names = {id(p): name for name, p in named}
        self._params = [p for _, p in named]
        known = {id(p) for p in self._params}
        self._deferred = {id(p) for p in deferred_params}
        unknown = self._deferred - known
        if unknown:
            raise ValueError(
                f"{len(unknown)} deferred_params are not among the synchronised parameters (or do not require "
                "grad): pass parameters of the same module"
            )
        self.buckets = self._build_buckets()
        self.shards_gradients = shard_gradients and self.world_size > 1  # ZeRO-1: reduce-scatter
        self.dp_rank = dist.get_rank(group)
        if self.shards_gradients:
            for bucket in self.buckets:
                _place_by_owner(bucket, self.world_size)
        self._where: dict[int, tuple[int, int]] = {}
        for bucket in self.buckets:
            for slot, p in enumerate(bucket.params):
                self._where[id(p)] = (bucket.index, slot)
        self._armed = False
        self._fires_needed = 1
        self._next_bucket = 0
        self.buckets_launched_in_backward = 0
        """How many buckets the last armed backward launched from its hooks (before ``finish``)."""
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self._params]
        logger.debug(
            "DP grad sync over %d ranks: %d params in %d buckets (closed at >= %d bytes)",
            self.world_size,
            len(self._params),
            len(self.buckets),
            bucket_size_bytes,
        )

    # ------------------------------------------------------------------ set-up

    def _build_buckets(self) -> list[_Bucket]:
        buckets: list[_Bucket] = []
        open_by_key: dict[tuple[torch.dtype, torch.device], _Bucket] = {}
        # Backward produces late layers' grads first; deferred parameters go last, in their own
        # buckets, so they never hold back the others (see [Note: deferred parameters]).
        immediate = [p for p in reversed(self._params) if id(p) not in self._deferred]
        deferred = [p for p in reversed(self._params) if id(p) in self._deferred]
        for p in immediate + deferred:
            if deferred and p is deferred[0]:
                open_by_key = {}
            dtype = self.reduce_dtype or _default_reduce_dtype(p.dtype)
            key = (dtype, p.device)
            bucket = open_by_key.get(key)
            if bucket is None:
                bucket = _Bucket(
                    index=len(buckets), params=[], offsets=[], numel=0, dtype=dtype, device=p.device
                )
                buckets.append(bucket)
                open_by_key[key] = bucket
            bucket.params.append(p)
            bucket.offsets.append(bucket.numel)
            bucket.numel += p.numel()
            # Like DDP: a bucket closes once it holds at least bucket_size_bytes.
            if bucket.numel * torch.empty((), dtype=dtype).element_size() >= self.bucket_size_bytes:
                del open_by_key[key]
        for bucket in buckets:
            bucket.ready = [False] * len(bucket.params)
        return buckets

    def synchronises(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is one of the parameters this sync reduces."""
        return id(param) in self._where

    def owner_of(self, param: torch.Tensor) -> int:
        """The DP rank that receives ``param``'s averaged gradient (``shard_gradients``; else this rank)."""
        bucket_index, slot = self._where[id(param)]
        bucket = self.buckets[bucket_index]
        return bucket.owners[slot] if self.shards_gradients else self.dp_rank

    def bucket_names(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order (for logs and tests)."""
        return [[self._names[id(p)] for p in b.params] for b in self.buckets]

    def remove_hooks(self) -> None:
        """Detach the gradient hooks (the object is unusable afterwards)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # ------------------------------------------------------------------ arming

    @property
    def armed(self) -> bool:
        """True between :meth:`prepare_last_microbatch` and :meth:`finish`."""
        return self._armed

    def prepare_last_microbatch(self) -> None:
        """Arm the hooks: the next backward's final gradients are all-reduced as they appear."""
        self.prepare_step(1)

    def prepare_step(self, num_backwards: int) -> None:
        """Arm the hooks for ``num_backwards`` more backwards (e.g. a whole pipeline step).

        A parameter's gradient counts as final after its ``num_backwards``-th accumulation
        from now; its bucket is then filled and, in bucket order, launched. Use it when the
        backwards of one step are driven by someone else (a pipeline schedule runs one
        backward per microbatch per stage): ``prepare_step(num_microbatches)`` before the
        step, :meth:`finish` after it. Parameters that receive fewer gradients are handled
        by ``finish`` (correct, just not overlapped).
        """
        if isinstance(num_backwards, bool) or not isinstance(num_backwards, int) or num_backwards < 1:
            raise ValueError(f"num_backwards must be a positive integer, got {num_backwards!r}")
        if self._armed:
            raise RuntimeError("the gradient sync is already armed: call finish() before arming it again")
        if not self._handles:
            raise RuntimeError("this DataParallelGradSync's hooks were removed")
        self._armed = True
        self._fires_needed = num_backwards
        self._next_bucket = 0
        self.buckets_launched_in_backward = 0
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
            bucket.launched = False
            bucket.work = None
            bucket.ready = [False] * len(bucket.params)
            bucket.fires = [0] * len(bucket.params)

    @contextlib.contextmanager
    def sync_on_this_backward(self) -> Iterator[None]:
        """Context for the last microbatch's backward: arm before, :meth:`finish` after."""
        self.prepare_last_microbatch()
        try:
            yield
        except BaseException:
            self._abort()
            raise
        self.finish()

    def sync(self) -> None:
        """Blocking, non-overlapped: all-reduce every bucket now (after the last backward)."""
        self.prepare_last_microbatch()
        self.finish()

    # ------------------------------------------------------------------ hooks and comm

    def notify_grad_ready(self, params: Iterable[torch.Tensor]) -> None:
        """Count one accumulation for each of ``params``, as the post-accumulate-grad hook does.

        For code that accumulates parameter gradients itself (``torch.autograd.grad`` then
        ``param.grad += g``, e.g. a split weight-gradient backward): autograd's hooks do not
        fire then, so without this call such gradients are reduced by :meth:`finish` only
        (correct, not overlapped).
        """
        for p in params:
            if id(p) not in self._where:
                raise ValueError(
                    "notify_grad_ready got a parameter this DataParallelGradSync does not synchronise"
                )
            self._on_grad_ready(p)

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self._armed or id(param) in self._deferred:
            return
        bucket_index, slot = self._where[id(param)]
        bucket = self.buckets[bucket_index]
        if bucket.ready[slot]:
            raise RuntimeError(
                f"parameter {self._names[id(param)]!r} received more gradients than the {self._fires_needed} "
                "backward(s) the sync was armed for (its bucket may already be in flight): arm with "
                "prepare_step(<number of backwards>) or prepare_last_microbatch() right before the last one, "
                "or use sync() after all backwards"
            )
        bucket.fires[slot] += 1
        if bucket.fires[slot] < self._fires_needed:
            return
        self._fill(bucket, slot)
        before = self._next_bucket
        self._launch_ready_in_order()
        self.buckets_launched_in_backward += self._next_bucket - before

    def _fill(self, bucket: _Bucket, slot: int) -> None:
        bucket.ready[slot] = True
        bucket.pending -= 1
        if self.world_size == 1:
            return
        if bucket.buffer is None:
            # Sharded buckets: zeros in the padding of each owner's segment.
            alloc = torch.zeros if self.shards_gradients else torch.empty
            bucket.buffer = alloc(bucket.numel, dtype=bucket.dtype, device=bucket.device)
        p = bucket.params[slot]
        view = bucket.buffer.narrow(0, bucket.offsets[slot], p.numel())
        if p.grad is None:
            view.zero_()  # [Note: missing gradients]
        else:
            view.copy_(p.grad.reshape(-1))

    def _launch_ready_in_order(self) -> None:
        # [Note: bucket launch order]
        while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].pending == 0:
            self._launch(self.buckets[self._next_bucket])
            self._next_bucket += 1

    def _launch(self, bucket: _Bucket) -> None:
        bucket.launched = True
        if self.world_size == 1:
            return
        assert bucket.buffer is not None
        op = (
            dist.ReduceOp.AVG
            if self.average and self._collective_averages(bucket.device)
            else dist.ReduceOp.SUM
        )
        if self.shards_gradients:  # [Note: ZeRO-1 reduce-scatter]
            bucket.shard = torch.empty(bucket.shard_numel, dtype=bucket.dtype, device=bucket.device)
            bucket.work = reduce_scatter_dim0(bucket.shard, bucket.buffer, self.group, op=op)
            return
        bucket.work = dist.all_reduce(bucket.buffer, op=op, group=self.group, async_op=True)

    def _collective_averages(self, device: torch.device) -> bool:
        """Whether the group's backend averages in the collective: NCCL on CUDA tensors (gloo has no AVG)."""
        if self._avg_in_collective is None:
            self._avg_in_collective = (
                device.type == "cuda" and "nccl" in str(dist.get_backend(self.group)).lower()
            )
        return self._avg_in_collective

    def finish(self) -> None:
        """Launch the buckets still waiting, wait for all, and write averaged grads back.

        Parameters whose hook did not fire in the armed backward contribute the
        gradient they hold (from earlier microbatches) or zeros.
        """
        if not self._armed:
            raise RuntimeError(
                "finish() without prepare_last_microbatch()/prepare_step(): nothing is being synchronised"
            )
        try:
            for bucket in self.buckets:
                for slot in range(len(bucket.params)):
                    if not bucket.ready[slot]:
                        self._fill(bucket, slot)
            self._launch_ready_in_order()
            assert self._next_bucket == len(self.buckets)
            for bucket in self.buckets:
                self._write_back(bucket)
        finally:
            self._armed = False

    def _write_back(self, bucket: _Bucket) -> None:
        if self.world_size == 1:
            for p in bucket.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            return
        assert bucket.work is not None and bucket.buffer is not None
        try:
            bucket.work.wait()
        except Exception as err:
            names = [self._names[id(p)] for p in bucket.params]
            raise RuntimeError(
                f"rank {dist.get_rank()}: DP gradient all-reduce of bucket {bucket.index} of {len(self.buckets)} "
                f"({len(names)} parameters: {names[:3]}{' ...' if len(names) > 3 else ''}) over "
                f"{self.world_size} ranks failed: {err}. A peer probably died or runs a different number of "
                "backwards/steps"
            ) from err
        bucket.work = None
        if self.shards_gradients:
            self._write_back_shard(bucket)
            return
        if self.average and not self._collective_averages(bucket.device):
            bucket.buffer.div_(self.world_size)
        # [Note: reduction precision and memory]: the buffer is this step's only; no copy when the dtype matches.
        for p, offset in zip(bucket.params, bucket.offsets, strict=True):
            view = bucket.buffer.narrow(0, offset, p.numel()).view_as(p)
            if view.dtype == p.dtype:
                p.grad = view
            elif p.grad is None:
                p.grad = view.to(p.dtype)
            else:
                p.grad.copy_(view)
        bucket.buffer = None

    def _write_back_shard(self, bucket: _Bucket) -> None:
        """Owned parameters get their averaged gradient from this rank's segment; the others none."""
        assert bucket.shard is not None
        if self.average and not self._collective_averages(bucket.device):
            bucket.shard.div_(self.world_size)
        start = self.dp_rank * bucket.shard_numel
        for p, offset, owner in zip(bucket.params, bucket.offsets, bucket.owners, strict=True):
            if owner != self.dp_rank:
                p.grad = None  # its local, unreduced gradient must not reach the norm or the optimizer
                continue
            view = bucket.shard.narrow(0, offset - start, p.numel()).view_as(p)
            p.grad = view if view.dtype == p.dtype else view.to(p.dtype)
        bucket.buffer = None
        bucket.shard = None

    def _abort(self) -> None:
        """After a failed backward: wait for launched work so no collective is left dangling."""
        for bucket in self.buckets:
            if bucket.work is not None:
                with contextlib.suppress(Exception):
                    bucket.work.wait()
                bucket.work = None
        self._armed = False


def allreduce_gradients_per_parameter(
    params: Iterable[nn.Parameter], group: ProcessGroup | None = None
) -> None:
    """The naive baseline: one blocking all-reduce per parameter, then divide (for benchmarks)."""
    world = dist.get_world_size(group)
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=group)
        p.grad.div_(world)


__all__ = ["DEFAULT_BUCKET_SIZE_BYTES", "DataParallelGradSync", "allreduce_gradients_per_parameter"]
