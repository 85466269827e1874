"""The planner's input: :class:`ModelProfile`, per-layer costs of one sample and what constrains TP.

A profile holds per-layer costs for one sample (forward and backward seconds, activation bytes,
parameter bytes), a fixed per-microbatch overhead, the optimizer's cost per parameter byte, the
factors the TP probe measured, and what constrains tensor parallelism (heads, kv heads,
vocabulary); it is validated on construction and round-trips through JSON.

Not done here: measuring one (:func:`merak_core.planner.profile.profile_model`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["ModelProfile"]


@dataclass(kw_only=True)
class ModelProfile:
    """Per-layer costs of one sample, the sizes that constrain TP, and where they came from."""

    layer_forward_s: list[float]
    """Forward seconds of each layer for one sample."""
    layer_backward_s: list[float]
    """Backward seconds of each layer for one sample (without recomputation)."""
    layer_activation_bytes: list[float]
    """Bytes each layer keeps for backward, for one sample."""
    layer_param_bytes: list[float]
    """Parameter bytes of each layer (embeddings and head counted in the first / last layer)."""
    shared_param_bytes: float = 0.0
    """Bytes of parameters counted in both the first and the last layer (a tied embedding and head):
    a stage holding both layers holds them once."""
    layer_trainable_bytes: list[float] | None = None
    """Bytes of each layer's parameters that train (a LoRA run: its adapters), the rest frozen: weights
    only, no gradient, no optimizer state ([Note: frozen weights] in :mod:`.memory`). None: every
    parameter trains."""
    shared_trainable_bytes: float = 0.0
    """The trainable part of ``shared_param_bytes`` when ``layer_trainable_bytes`` is given."""
    microbatch_overhead_s: float = 0.0
    """Fixed seconds per microbatch and stage (forward + backward) that do not grow with the batch."""
    boundary_bytes: float = 0.0
    """Bytes of a layer's output for one sample (the pipeline message and the TP all-reduce size)."""
    optimizer_s_per_byte: float = 0.0
    """Seconds of one optimizer step (gradient clipping and AdamW) per parameter byte."""
    tp_scale: dict[int, float] = field(default_factory=dict)
    """Per TP degree (1 included: no TP): measured / modelled forward-and-backward time of the layers
    (compute and TP all-reduces), from short runs of the real model in the pure DP x TP layouts with
    every rank busy (``merak_core.autoplan.probe``); 1 where absent. Small layers split over ranks do not
    run tp times faster on a CPU: this says how much slower they run."""
    overhead_scale: float = 1.0
    """Measured / modelled time outside the pipeline (DP all-reduce, optimizer, clipping, the per-step
    all-reduces and the ranks' skew), from the same probe runs; 1: not measured."""
    num_heads: int | None = None
    """Attention heads (tp must divide it); None: no constraint."""
    num_kv_heads: int | None = None
    """Key/value heads (tp must divide it); None: same as ``num_heads``."""
    vocab_size: int | None = None
    """Vocabulary size (tp must divide it); None: no constraint."""
    layer_expert_bytes: list[float] | None = None
    """Bytes of each layer's mixture-of-experts experts (part of ``layer_param_bytes``; expert parallelism
    shards them over ep: [Note: expert parallelism priced] in :mod:`.pricing`). None: a dense model."""
    layer_moe_blocks: list[int] | None = None
    """MoE blocks in each layer (two all-to-alls each per microbatch in forward, two in backward, at ep > 1)."""
    num_experts: int | None = None
    """Experts per MoE block (the fewest when blocks differ): ep must divide it. None: a dense model."""
    top_k: int = 1
    """Experts each token visits (the all-to-alls carry ``top_k`` rows per token)."""
    fingerprint: str = ""
    """Model fingerprint (see :func:`model_fingerprint`)."""
    device: str = "cpu"
    """Device the costs were measured on, or ``estimate``."""

    def __post_init__(self) -> None:
        n = len(self.layer_forward_s)
        if n < 1:
            raise ValueError(
                "ModelProfile.layer_forward_s is empty: expected one value per layer (at least one)"
            )
        for name in ("layer_backward_s", "layer_activation_bytes", "layer_param_bytes"):
            values = getattr(self, name)
            if len(values) != n:
                raise ValueError(
                    f"ModelProfile.{name} has {len(values)} values but layer_forward_s has {n}: "
                    "give one value per layer"
                )
        for name in ("layer_forward_s", "layer_backward_s", "layer_activation_bytes", "layer_param_bytes"):
            for v in getattr(self, name):
                if not v >= 0 or math.isinf(v):
                    raise ValueError(f"ModelProfile.{name} holds {v!r}: expected finite values >= 0")
        self._check_trainable(n)
        self._check_experts(n)
        scales = {}
        for k, v in dict(self.tp_scale).items():  # JSON gives string keys
            if int(k) < 1 or not (float(v) > 0 and math.isfinite(float(v))):
                raise ValueError(
                    f"ModelProfile.tp_scale[{k!r}]={v!r}: expected a TP degree >= 1 and a finite factor > 0"
                )
            scales[int(k)] = float(v)
        self.tp_scale = scales
        if not (self.overhead_scale > 0 and math.isfinite(self.overhead_scale)):
            raise ValueError(
                f"ModelProfile.overhead_scale={self.overhead_scale!r}: expected a finite factor > 0"
            )
        if not self.optimizer_s_per_byte >= 0 or math.isinf(self.optimizer_s_per_byte):
            raise ValueError(
                f"ModelProfile.optimizer_s_per_byte={self.optimizer_s_per_byte}: expected finite seconds >= 0"
            )
        if not self.microbatch_overhead_s >= 0:
            raise ValueError(
                f"ModelProfile.microbatch_overhead_s={self.microbatch_overhead_s}: expected seconds >= 0"
            )
        if self.boundary_bytes < 0:
            raise ValueError(f"ModelProfile.boundary_bytes={self.boundary_bytes}: expected >= 0")
        for name in ("num_heads", "num_kv_heads", "vocab_size"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(
                    f"ModelProfile.{name}={v!r}: expected a positive int or None (no constraint)"
                )

    def _per_layer_part(self, name: str, n: int, what: str) -> None:
        """``self.<name>`` (when given) as floats: one per layer, each within its layer's parameter bytes."""
        values = getattr(self, name)
        if values is None:
            return
        values = [float(v) for v in values]
        setattr(self, name, values)
        if len(values) != n:
            raise ValueError(
                f"ModelProfile.{name} has {len(values)} values but layer_forward_s has {n}: give one value per "
                f"layer (or None: {what})"
            )
        for i, (v, p) in enumerate(zip(values, self.layer_param_bytes, strict=True)):
            if not 0 <= v <= p:
                raise ValueError(
                    f"ModelProfile.{name}[{i}]={v!r}: expected 0 <= value <= layer_param_bytes[{i}]={p!r}"
                )

    def _check_experts(self, n: int) -> None:
        self._per_layer_part("layer_expert_bytes", n, "a dense model")
        if self.layer_expert_bytes is None:
            return
        blocks = self.layer_moe_blocks
        if blocks is None or len(blocks) != n or any(not isinstance(b, int) or b < 0 for b in blocks):
            raise ValueError(
                f"ModelProfile.layer_moe_blocks={blocks!r}: expected {n} ints >= 0 (MoE blocks per layer) with "
                "layer_expert_bytes"
            )
        for name in ("num_experts", "top_k"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(
                    f"ModelProfile.{name}={v!r}: expected a positive int with layer_expert_bytes"
                )

    def _check_trainable(self, n: int) -> None:
        self._per_layer_part("layer_trainable_bytes", n, "every parameter trains")
        if self.layer_trainable_bytes is None:
            return
        if not 0 <= self.shared_trainable_bytes <= self.shared_param_bytes:
            raise ValueError(
                f"ModelProfile.shared_trainable_bytes={self.shared_trainable_bytes!r}: expected 0 <= value "
                f"<= shared_param_bytes={self.shared_param_bytes!r}"
            )

    @property
    def num_layers(self) -> int:
        return len(self.layer_forward_s)

    @property
    def trainable_bytes(self) -> list[float]:
        """Bytes of each layer's trainable parameters (every parameter's without ``layer_trainable_bytes``)."""
        if self.layer_trainable_bytes is None:
            return list(self.layer_param_bytes)
        return list(self.layer_trainable_bytes)

    @property
    def shared_trainable(self) -> float:
        """Trainable bytes of the shared (tied) parameters."""
        return self.shared_param_bytes if self.layer_trainable_bytes is None else self.shared_trainable_bytes

    def ep_allowed(self, ep: int) -> bool:
        """Whether ``ep`` divides the experts (ep=1 always; ep > 1 needs a mixture-of-experts profile)."""
        return ep == 1 or (self.num_experts is not None and self.num_experts % ep == 0)

    def tp_allowed(self, tp: int) -> bool:
        """Whether ``tp`` divides heads, kv heads and vocabulary."""
        kv = self.num_kv_heads if self.num_kv_heads is not None else self.num_heads
        return all(v is None or v % tp == 0 for v in (self.num_heads, kv, self.vocab_size))

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModelProfile:
        return cls(**json.loads(text))

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> ModelProfile:
        return cls.from_json(Path(path).read_text())
