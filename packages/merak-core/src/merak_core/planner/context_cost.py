"""Pricing context parallelism (the cp axis): a rank's share of a profile, and the cp group's communication.

At ``cp > 1`` every rank of a cp group holds ``seq_len / cp`` tokens of each sample
(:mod:`merak_core.parallel.context_parallel`). The planner prices that in two parts:

- :func:`cp_local_profile`: the profile of one rank's tokens. Forward and backward seconds, saved
  activation bytes and the boundary (a layer's output) of one sample are divided by cp (causal ring
  attention is load-balanced, and Ulysses splits the heads, so every rank does ``1 / cp`` of the
  attention work too), plus what the cp attention itself keeps per attention layer
  (:func:`cp_attention_extra_bytes`). Parameters, the per-microbatch overhead and the optimizer are
  unchanged: cp ranks hold the same parameters.
- :func:`cp_layer_comm_s`: the seconds the cp group's communication adds to one layer's forward and
  backward of one microbatch. ``ring``: the key/value block of the local tokens passes ``cp - 1``
  times round the group; in the forward each pass overlaps the blockwise attention of the block
  before it, so each of the ``cp - 1`` steps costs ``max(block compute, pass)`` where the block
  compute is ``1 / cp`` of the layer's forward ([Note: ring overlap priced]); the backward overlaps its
  passes likewise ([Note: ring overlap] in :mod:`merak_tp.ring`): ``cp`` steps, each ``max(block
  backward, pass)`` with the block backward ``1 / cp`` of the layer's backward, the gradients one step
  behind their block (step 0 the key/value block alone, steps ``1 .. cp - 2`` the block with the
  gradients gathered for the one before, twice the bytes, step ``cp - 1`` those gradients alone), then
  one pass more that takes the last block's gradients home, waited for at once (not overlapped).
  ``ulysses``: two all-to-alls in the forward (query, key and value to the head split; the output
  back) and two in the backward, not overlapped.

[Note: attention sizes from the profile] A profile measures a layer as a whole: its output
(``boundary_bytes``, the hidden size per token) but not its query or key/value widths. The query
and the attention output are priced at the boundary's width (hidden size = heads x head dim, as in
every Llama/GPT/Qwen-style model), the key/value pair at ``2 * num_kv_heads / num_heads`` of it
(grouped-query attention), and every layer of the profile is taken to hold one attention: the
profiled layers are the transformer blocks (the embedding and the head are counted in the first and
last block).

[Note: ring overlap priced] The profile does not separate attention from the rest of a layer, so a
ring step's block compute is priced as ``1 / cp`` of the whole layer's forward (in the backward: its
backward) on the local tokens:
an upper bound of the compute a pass can hide behind, so the ring's exposed communication is a
lower bound when the MLP dominates the layer.

[Note: cp attention memory] What the cp attention keeps beyond ``1 / cp`` of the one-process
activations, per attention layer, in units of the local tokens' boundary bytes (``boundary / cp``):
``ulysses`` one (the output's copy in the sequence split); ``ring`` none: its backward passes the
key/value blocks round the ring again ([Note: ring backward] in :mod:`merak_tp.ring`), so it keeps
only the local query, key, value, output and log-sum-exp, what a one-process attention keeps for the
same rows. A one-process attention that repeats the key/value heads for grouped-query attention
keeps ``2 - 2 * kv / heads`` boundaries more, which the ring saves and which is not subtracted (an
upper bound). Measured and compared with this model by ``tests/core/test_context_parallel_memory.py``.
All of it in the model's dtype; a bfloat16 or float16 model's ring keeps its log-sum-exp and passes
its blocks in float32, which the profile (it holds bytes, not the dtype) cannot tell: not priced yet.

Not done here: the sequence length (the job checks refuse one that does not divide into ``2 * cp``
chunks, or ``cp`` for Ulysses), and where the cp group sits on a cluster's links (the cluster
planner's concern).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from merak_core.planner.comm import CommModel
from merak_core.planner.model_profile import ModelProfile

__all__ = [
    "CP_MODES",
    "check_cp",
    "cp_allowed",
    "cp_attention_extra_bytes",
    "cp_layer_comm_s",
    "cp_local_profile",
    "kv_fraction",
    "runnable_cp",
]

CP_MODES = ("ring", "ulysses")


def check_cp(cp: int, cp_mode: str) -> None:
    """ValueError for a cp degree or mode the planner cannot price."""
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp={cp!r}; expected an int >= 1 (1: no context parallelism)")
    if cp_mode not in CP_MODES:
        raise ValueError(f"cp_mode={cp_mode!r}; expected one of {CP_MODES}")


def kv_fraction(profile: ModelProfile) -> float:
    """Bytes of one token's key and value together, per byte of its hidden state ([Note: attention sizes
    from the profile]): ``2 * num_kv_heads / num_heads`` (2 without head counts)."""
    heads = profile.num_heads
    kv = profile.num_kv_heads if profile.num_kv_heads is not None else heads
    if heads is None or kv is None:
        return 2.0
    return 2.0 * kv / heads


def cp_allowed(profile: ModelProfile, cp: int, cp_mode: str, tp: int) -> bool:
    """Whether ``cp`` can run with ``tp``: Ulysses needs cp to divide the query and key/value heads
    per TP rank (ring has no constraint)."""
    if cp == 1 or cp_mode == "ring" or profile.num_heads is None:
        return True
    kv = profile.num_kv_heads if profile.num_kv_heads is not None else profile.num_heads
    return all(h % tp == 0 and (h // tp) % cp == 0 for h in (profile.num_heads, kv))


def cp_attention_extra_bytes(profile: ModelProfile, cp: int, cp_mode: str) -> float:
    """Bytes the cp attention keeps per attention layer and sample beyond ``1 / cp`` of the
    one-process activations ([Note: cp attention memory]); 0 at cp=1."""
    check_cp(cp, cp_mode)
    if cp == 1:
        return 0.0
    if cp_mode == "ulysses":
        return profile.boundary_bytes / cp
    return 0.0


def cp_local_profile(profile: ModelProfile, cp: int, cp_mode: str) -> ModelProfile:
    """The profile of one cp rank's tokens: per-sample seconds, activations and boundary divided by cp,
    each layer's activations plus :func:`cp_attention_extra_bytes`; ``profile`` itself at cp=1."""
    check_cp(cp, cp_mode)
    if cp == 1:
        return profile
    extra = cp_attention_extra_bytes(profile, cp, cp_mode)
    return dataclasses.replace(
        profile,
        layer_forward_s=[t / cp for t in profile.layer_forward_s],
        layer_backward_s=[t / cp for t in profile.layer_backward_s],
        layer_activation_bytes=[a / cp + extra for a in profile.layer_activation_bytes],
        boundary_bytes=profile.boundary_bytes / cp,
    )


def _p2p_s(comm: CommModel, nbytes: float) -> float:
    return comm.p2p_latency_s + nbytes / comm.p2p_bandwidth


def _all_to_all_s(comm: CommModel, nbytes: float, group_size: int) -> float:
    """One all-to-all of ``nbytes`` per rank: ``group_size - 1`` messages of ``1 / group_size`` of them."""
    n = group_size
    return (n - 1) * comm.p2p_latency_s + (n - 1) / n * nbytes / comm.p2p_bandwidth


def cp_layer_comm_s(
    local: ModelProfile,
    comm: CommModel,
    *,
    cp: int,
    cp_mode: str,
    micro_batch_size: int,
    layer_forward_s: float,
    layer_backward_s: float,
    tp: int = 1,
) -> tuple[float, float]:
    """(forward, backward) seconds the cp group adds to one attention layer of one microbatch.

    ``local`` is the rank's profile (:func:`cp_local_profile`); ``layer_forward_s`` and
    ``layer_backward_s`` the layer's forward and backward compute of the microbatch on the local tokens
    (what the ring's passes overlap, [Note: ring overlap priced]); key/value and query bytes are divided
    by ``tp`` (TP splits the heads).
    """
    check_cp(cp, cp_mode)
    if cp == 1:
        return 0.0, 0.0
    hidden = micro_batch_size * local.boundary_bytes / tp  # the local tokens' query (or output) bytes
    kv = hidden * kv_fraction(local)
    wait = comm.sync_wait_s
    if cp_mode == "ring":
        step = _p2p_s(comm, kv) + wait
        block = layer_forward_s / cp
        forward = (cp - 1) * max(0.0, step - block)  # each step's pass hides behind the block before it
        # cp steps, each hiding behind its block's backward: the block alone, the block with the gradients of
        # the one before (cp - 2 times), those gradients alone; then the last gradients home, not hidden.
        block_back = layer_backward_s / cp
        passes = [step] + [_p2p_s(comm, 2 * kv) + wait] * (cp - 2) + [step]
        backward = sum(max(0.0, p - block_back) for p in passes) + step
        return forward, backward
    # Ulysses: query, key and value in one exchange each way per all-to-all pair; the output back.
    into_heads = _all_to_all_s(comm, hidden + kv, cp) + wait
    back = _all_to_all_s(comm, hidden, cp) + wait
    return into_heads + back, into_heads + back


def runnable_cp(cands: Sequence[Any], model: Any) -> list[Any]:
    """``cands`` less those the run refuses for ``model`` at their cp, cp mode, tp and pp: the run's own checks,
    :func:`merak_core.parallel.context_parallel.check_cp_model` (the model's cp hook, Ulysses' heads per TP
    rank; at any pp: a handwritten model's cp hook is traced as leaf calls, so cp runs at pp > 1 too) and
    :func:`merak_core.parallel.router_aux.check_router_aux` (a router auxiliary loss needs pp = 1 and cp = 1,
    a protocol block's also no recomputation). A model given as a builder is not checked here (the run checks it once built).
    ValueError when none is left."""
    from types import SimpleNamespace

    from torch import nn

    from merak_core.parallel.context_parallel import check_cp_model
    from merak_core.parallel.router_aux import check_router_aux

    if not isinstance(model, nn.Module):
        return list(cands)
    kept, refused = [], ""
    for c in cands:
        probe = SimpleNamespace(cp=c.cp, tp=c.tp, pp=c.pp, cp_mode=getattr(c, "cp_mode", "ring"))
        try:
            check_cp_model(model, probe)
            check_router_aux(model, c.pp, c.cp, getattr(c, "recompute", "none"))
        except ValueError as exc:
            refused = str(exc)
            continue
        kept.append(c)
    if not kept:
        raise ValueError(f"plan: the run refuses every fitting configuration: {refused}")
    return kept
