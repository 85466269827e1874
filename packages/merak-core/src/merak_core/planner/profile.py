"""Measuring a model's costs: :func:`profile_model`.

:func:`profile_model` measures a per-sample :class:`ModelProfile` on the local device by running
the model (forward times and saved-activation bytes per layer through hooks, see [Note: device
clocks] in :mod:`.clock`); profiles are cached as JSON keyed by a model fingerprint and the
device. :func:`tp_constraints` reads what constrains tensor parallelism from the model (heads, kv
heads, the vocabulary unless the job's own TP plan shards no embedding).

Not done here: the profile's data and validation (:mod:`.model_profile`) and the contention
measurement (:mod:`.contention`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from merak_core.planner.clock import device_of, now, step_seconds, timed
from merak_core.planner.model_profile import ModelProfile

logger = logging.getLogger(__name__)

__all__ = ["ModelProfile", "model_fingerprint", "profile_model", "tp_constraints"]

_HEAD_NAMES = ("num_heads", "heads", "n_head", "num_attention_heads")
_KV_HEAD_NAMES = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")


def model_fingerprint(model: nn.Module, sample_shape: Sequence[Any]) -> str:
    """A hash of the module tree (class names, parameter names, shapes, dtypes, which are frozen) and the sample shape."""
    h = hashlib.sha256()
    for name, mod in model.named_modules():
        h.update(f"{name}:{type(mod).__name__};".encode())
    for name, p in model.named_parameters():
        frozen = "" if p.requires_grad else ":frozen"  # a frozen weight holds no gradient, no optimizer state
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}{frozen};".encode())
    h.update(repr(tuple(sample_shape)).encode())
    return h.hexdigest()[:16]


def _find_layers(model: nn.Module) -> nn.ModuleList:
    """The longest ``nn.ModuleList`` not inside another one (a block's list of experts is not the layers)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    inner = {id(m) for outer in lists for child in outer for m in child.modules()}
    lists = [m for m in lists if id(m) not in inner]
    if not lists:
        raise ValueError("profile_model: the model has no nn.ModuleList of layers; pass layers= explicitly")
    return max(lists, key=len)


def _find_attr(model: nn.Module, names: Sequence[str]) -> int | None:
    for obj in [model, getattr(model, "config", None), getattr(model, "cfg", None)]:
        for n in names:
            v = getattr(obj, n, None) if obj is not None else None
            if isinstance(v, int) and not isinstance(v, bool):
                return v
    for m in model.modules():
        for n in names:
            v = getattr(m, n, None)
            if isinstance(v, int) and not isinstance(v, bool):
                return v
    return None


def _shards_an_embedding(model: nn.Module, tp_plan: Any) -> bool:
    """Whether ``tp_plan`` (a job's ``tp_plan``: a registered plan's name, None, or the user's own
    patterns, flat or under ``layers``) may shard an ``nn.Embedding`` of ``model``; True unless a
    user plan without ``base`` names none of them."""
    if not isinstance(tp_plan, dict) or "base" in tp_plan:
        return True
    patterns = tp_plan["layers"] if isinstance(tp_plan.get("layers"), dict) else tp_plan
    embeddings = [name for name, m in model.named_modules() if isinstance(m, nn.Embedding)]
    return any(fnmatch.fnmatch(name, pattern) for name in embeddings for pattern in patterns)


def tp_constraints(model: nn.Module, tp_plan: Any = None) -> tuple[int | None, int | None, int | None]:
    """(heads, kv heads, vocabulary) that tp must divide, read from ``model`` (None: no constraint).

    The vocabulary is the first ``nn.Embedding``'s, and no constraint when the job's ``tp_plan``
    is the user's own and shards no embedding.
    """
    vocab = next((m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if vocab is not None and not _shards_an_embedding(model, tp_plan):
        vocab = None
    return _find_attr(model, _HEAD_NAMES), _find_attr(model, _KV_HEAD_NAMES), vocab


def profile_model(
    model: nn.Module,
    sample: torch.Tensor | Mapping[str, torch.Tensor],
    *,
    layers: nn.ModuleList | None = None,
    repeats: int = 3,
    cache_dir: str | Path | None = None,
) -> ModelProfile:
    """Measure a per-sample :class:`ModelProfile` by running ``model(sample)`` forward and backward.

    ``sample`` is a batch (its first dimension is the batch size), or a mapping passed by keyword; per-layer forward time comes
    from hooks on ``layers`` (default: the model's longest ``nn.ModuleList``), kept bytes from
    saved-tensor hooks (parameters excluded, each storage once; before the first layer: the first
    layer's, after the last one: the last layer's, plus one tensor the size of the output for the
    loss). Forward time outside the layers goes to the first layer, except what runs after the last
    one (final norm, head: the last layer's). A one-sample run splits the step time into a fixed
    per-microbatch overhead and a per-sample part (the layer times are scaled to the latter). Backward time
    is measured for the whole model and spread over layers in proportion to forward time.
    With ``cache_dir`` the profile is read from / written to ``<fingerprint>-<device>.json``.
    """
    first = sample if isinstance(sample, torch.Tensor) else next(iter(sample.values()))
    batch = int(first.shape[0])
    device = str(first.device)
    shapes = (
        tuple(sample.shape)
        if isinstance(sample, torch.Tensor)
        else tuple((k, tuple(v.shape)) for k, v in sorted(sample.items()))
    )
    key = model_fingerprint(model, shapes)
    path = Path(cache_dir) / f"{key}-{device.replace(':', '_')}.json" if cache_dir is not None else None
    if path is not None and path.is_file():
        logger.info("planner: profile cache hit %s", path)
        return ModelProfile.load(path)
    if repeats < 1:
        raise ValueError(f"profile_model: repeats={repeats}; expected >= 1")
    # The caller's random stream and gradients are left as they were: profiling must not make
    # the rank that profiles diverge from the others.
    with torch.random.fork_rng(devices=[first.device] if first.device.type == "cuda" else []):
        try:
            prof = _measure(
                model,
                sample,
                layers if layers is not None else _find_layers(model),
                repeats,
                batch,
                key,
                device,
            )
            prof = dataclasses.replace(prof, optimizer_s_per_byte=_optimizer_s_per_byte(model, repeats))
        finally:
            model.zero_grad(set_to_none=True)
    if path is not None:
        prof.save(path)
        logger.info("planner: profile written to %s", path)
    return prof


def _optimizer_s_per_byte(model: nn.Module, repeats: int) -> float:
    """Seconds per parameter byte of gradient clipping plus an AdamW step, timed on copies of the
    parameters and gradients."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return 0.0
    copies = []
    for p in params:
        c = p.detach().clone().requires_grad_()
        c.grad = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        copies.append(c)
    opt = torch.optim.AdamW(copies, lr=1e-3)

    def step() -> None:  # what a Trainer step does per parameter besides the pipeline
        torch.nn.utils.clip_grad_norm_(copies, 1.0)
        opt.step()

    seconds = timed(step, repeats, params[0].device)
    nbytes = sum(p.numel() * p.element_size() for p in params)
    return seconds / max(nbytes, 1)


class _Recorder:
    """Forward hooks on the layers and a saved-tensor hook for one profiled run: per-layer forward
    seconds and kept bytes, what is saved outside the layers, and which parameters outside the
    layers are used before the first layer or after the last one."""

    def __init__(self, model: nn.Module, layers: nn.ModuleList, device: torch.device) -> None:
        self.n = len(layers)
        self.device = device
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.in_layer_modules = {id(m) for layer in layers for m in layer.modules()}
        self.used_before: set[int] = set()
        self.used_after: set[int] = set()
        self.out_bytes = 0.0
        self.last_end = 0.0
        self.reset()

    def reset(self) -> None:
        self.fwd = [0.0] * self.n
        self.act = [0.0] * self.n
        self.outside_act = [0.0, 0.0]  # saved before the first layer / after the last one
        self.saved: set[int] = set()
        self.current = -1  # -1: outside the layers
        self.after = (
            False  # the last layer has run: what follows (final norm, head, loss) is the last layer's
        )
        self.start = 0.0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key in self.param_ptrs:  # a saved weight is a parameter, counted in layer_param_bytes
            if self.current < 0:
                (self.used_after if self.after else self.used_before).add(key)
            return t
        if key in self.saved:  # saved again (or a view of a saved tensor): held once
            return t
        self.saved.add(key)
        nbytes = float(t.untyped_storage().nbytes())
        if self.current >= 0:
            self.act[self.current] += nbytes
        else:
            self.outside_act[1 if self.after else 0] += nbytes
        return t

    def attach(self, model: nn.Module, layers: nn.ModuleList) -> list[Any]:
        handles = []
        for i, layer in enumerate(layers):
            handles.append(layer.register_forward_pre_hook(lambda _m, _a, i=i: self._enter(i)))
            handles.append(layer.register_forward_hook(lambda _m, _a, out, i=i: self._leave(i, out)))
        for m in model.modules():
            if id(m) not in self.in_layer_modules and any(True for _ in m.parameters(recurse=False)):
                handles.append(m.register_forward_pre_hook(self._outside_module))
        return handles

    def _enter(self, i: int) -> None:
        self.current = i
        self.start = now(self.device)

    def _leave(self, i: int, out: Any) -> None:
        t = now(self.device)
        self.fwd[i] += t - self.start
        self.current = -1
        self.after = i == self.n - 1
        self.last_end = t
        if isinstance(out, torch.Tensor):
            self.out_bytes = float(out.numel() * out.element_size())

    def _outside_module(
        self, m: nn.Module, _a: Any
    ) -> None:  # a module outside the layers: its weights' place
        if self.current < 0:
            (self.used_after if self.after else self.used_before).update(
                p.untyped_storage().data_ptr() for p in m.parameters(recurse=False)
            )


def _recorded_run(model: nn.Module, sample: Any, rec: _Recorder) -> tuple[float, float, float]:
    """One forward (under the recorder's saved-tensor hook) and backward; (forward, backward, forward
    after the last layer) seconds."""
    rec.reset()
    model.zero_grad(set_to_none=True)
    t0 = now(rec.device)
    with torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t):
        y = model(sample) if isinstance(sample, torch.Tensor) else model(**sample)
    t1 = now(rec.device)
    if not isinstance(y, torch.Tensor):  # a dict / ModelOutput: its first tensor (logits or loss)
        y = next(v for v in y.values() if isinstance(v, torch.Tensor))
    if y.is_floating_point():  # a training loss (cross-entropy) keeps one tensor the output's size
        rec.outside_act[1] += float(y.numel() * y.element_size())
    y.float().sum().backward()
    return t1 - t0, now(rec.device) - t1, max(t1 - rec.last_end, 0.0)


def _layer_params(
    model: nn.Module,
    layers: nn.ModuleList,
    used_before: set[int],
    used_after: set[int],
    *,
    trainable_only: bool = False,
) -> tuple[list[float], float]:
    """Parameter bytes per layer with the parameters outside the layers placed, and the shared bytes
    (``trainable_only``: of the parameters with ``requires_grad``).

    A parameter used only after the last layer (final norm, untied head) is the last layer's; one
    used before and after (a tied embedding) is held by both; the rest is the first layer's.
    """
    n = len(layers)
    counted = (lambda p: p.requires_grad) if trainable_only else (lambda p: True)
    params = [
        float(sum(p.numel() * p.element_size() for p in layer.parameters() if counted(p))) for layer in layers
    ]
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    shared = 0.0
    for p in model.parameters():
        if id(p) in in_layers or not counted(p):
            continue
        nbytes = float(p.numel() * p.element_size())
        late = p.untyped_storage().data_ptr() in used_after
        early = p.untyped_storage().data_ptr() in used_before or not late
        if late:
            params[-1] += nbytes
        if early and not (late and n == 1):
            params[0] += nbytes
        if late and early and n > 1:
            shared += nbytes
    return params, shared


def _measure(
    model: nn.Module,
    sample: torch.Tensor | Mapping[str, torch.Tensor],
    layers: nn.ModuleList,
    repeats: int,
    batch: int,
    key: str,
    device: str,
) -> ModelProfile:
    n = len(layers)
    rec = _Recorder(model, layers, device_of(sample))
    handles = rec.attach(model, layers)
    total_f = total_b = 0.0
    fwd_sum = [0.0] * n
    tail_f = 0.0  # forward seconds after the last layer (final norm, head)
    try:
        for rep in range(repeats + 1):  # the first run warms up
            t_f, t_b, t_tail = _recorded_run(model, sample, rec)
            if rep > 0:
                total_f += t_f / repeats
                total_b += t_b / repeats
                fwd_sum = [a + f / repeats for a, f in zip(fwd_sum, rec.fwd, strict=True)]
                tail_f += t_tail / repeats
    finally:
        for h in handles:
            h.remove()
    per_layer_f = list(fwd_sum)
    # Outside the layers: the head after the last layer is the last layer's, the rest (embedding) the first's.
    tail_f = min(tail_f, max(total_f - sum(per_layer_f), 0.0))
    per_layer_f[-1] += tail_f
    per_layer_f[0] += max(total_f - sum(per_layer_f), 0.0)
    per_layer_b = [total_b * f / max(sum(per_layer_f), 1e-12) for f in per_layer_f]
    act = list(rec.act)
    act[0] += rec.outside_act[0]
    act[-1] += rec.outside_act[1]
    params, shared = _layer_params(model, layers, rec.used_before, rec.used_after)
    trainable, shared_trainable = _layer_params(
        model, layers, rec.used_before, rec.used_after, trainable_only=True
    )
    frozen_some = trainable != params or shared_trainable != shared  # a LoRA run: [Note: frozen weights]
    heads, kv, vocab = tp_constraints(model)
    prof = ModelProfile(
        **_experts(model, layers),
        layer_forward_s=[f / batch for f in per_layer_f],
        layer_backward_s=[b / batch for b in per_layer_b],
        layer_activation_bytes=[a / batch for a in act],
        layer_param_bytes=params,
        shared_param_bytes=shared,
        layer_trainable_bytes=trainable if frozen_some else None,
        shared_trainable_bytes=shared_trainable if frozen_some else 0.0,
        boundary_bytes=rec.out_bytes / batch,
        num_heads=heads,
        num_kv_heads=kv,
        vocab_size=vocab,
        fingerprint=key,
        device=device,
    )
    return _with_microbatch_overhead(prof, model, sample, batch, repeats, total_f + total_b)


def _experts(model: nn.Module, layers: nn.ModuleList) -> dict[str, Any]:
    """The profile's mixture-of-experts fields: per layer the bytes of its experts (protocol blocks' ``experts``,
    transformers' fused experts modules) and its MoE blocks, the fewest experts of a block and the most
    experts a token visits; nothing for a dense model."""
    from merak_core.parallel.expert_parallel import moe_blocks
    from merak_core.parallel.fused_experts import fused_experts

    blocks = [(m, m.experts) for _, m in moe_blocks(model)] + [(m, m) for _, m in fused_experts(model)]
    if not blocks:
        return {}
    expert_bytes, counts = [0.0] * len(layers), [0] * len(layers)
    for i, layer in enumerate(layers):
        inside = {id(m) for m in layer.modules()}
        for block, experts in blocks:
            if id(block) in inside:
                counts[i] += 1
                expert_bytes[i] += float(sum(p.numel() * p.element_size() for p in experts.parameters()))
    top_k = max(int(getattr(b, "top_k", 0) or 0) for b, _ in blocks) or _find_attr(
        model, ("num_experts_per_tok", "top_k")
    )
    return {
        "layer_expert_bytes": expert_bytes,
        "layer_moe_blocks": counts,
        "num_experts": min(int(b.num_experts) for b, _ in blocks),
        "top_k": top_k or 1,
    }


def _with_microbatch_overhead(
    prof: ModelProfile, model: nn.Module, sample: Any, batch: int, repeats: int, step_s: float
) -> ModelProfile:
    """time(b) = overhead + b * per_sample: a one-sample run gives the overhead; the layer times are
    scaled to the per-sample part."""
    if batch < 2:
        return prof
    one = sample[:1] if isinstance(sample, torch.Tensor) else {k: v[:1] for k, v in sample.items()}
    t_one = step_seconds(model, one, repeats)
    per_sample = (step_s - t_one) / (batch - 1)
    if per_sample <= 0:
        return prof
    scale = per_sample / (step_s / batch)
    return dataclasses.replace(
        prof,
        microbatch_overhead_s=max(t_one - per_sample, 0.0),
        layer_forward_s=[f * scale for f in prof.layer_forward_s],
        layer_backward_s=[b * scale for b in prof.layer_backward_s],
    )
