"""The same model family with a tiny config, for ``merak check`` when the job's model is too big to check whole.

``merak check`` compares every module a TP plan shards against the unsharded
module on ``tp`` CPU processes, each holding the model three times in float64
(the job's weights, the unsharded copy, the sharded copy). A model that does not
fit that way, or that is large, is checked on a tiny model of the same class: a
copy of its transformers config with 2 layers (more when the config lists more
kinds of layer), head size 8, ``2*tp`` query heads, ``tp`` key/value heads where
the real model has fewer key/value heads than query heads (grouped-query, so
fused unequal sections stay unequal), vocabulary 128 and every other width
scaled down to match; the flags that choose the architecture (bias, alibi,
parallel attention, tied embeddings, rope type...) are kept. The plan is the
job's, resolved on the tiny model (the module names and classes are the same).

What the tiny check does not see: a size that only the real config has (a head
count that does not divide by ``tp``, an intermediate size that does not split).
``merak check`` first shards the real model on the meta device as one rank of a
fake group (the launch check of ``merak train``), which catches those.

Only transformers models (``model.config`` a ``PretrainedConfig``) can be made
tiny; another model is checked whole or refused with the fix.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["check_memory_bytes", "choose_check_model", "describe_config", "tiny_config", "tiny_inputs"]

TINY_HEAD_DIM = 8
TINY_VOCAB = 128
TINY_SEQ = 16
DEFAULT_MAX_PARAMS = 200_000_000
"""Above this many parameters ``merak check`` uses the tiny config unless ``--full`` (a CPU forward in float64)."""

_ALIASES = {
    "n_embd": "hidden_size",
    "d_model": "hidden_size",
    "n_layer": "num_hidden_layers",
    "n_head": "num_attention_heads",
}


def _canonical(d: dict[str, Any], key: str) -> Any:
    for alias, canon in _ALIASES.items():
        if canon == key and alias in d:
            return d[alias]
    return d.get(key)


def _heads(d: dict[str, Any], tp: int) -> tuple[int, int | None]:
    """Tiny (query heads, key/value heads); None when the config has no key/value head count."""
    heads = int(_canonical(d, "num_attention_heads") or 1)
    kv_key = (
        "num_key_value_heads"
        if "num_key_value_heads" in d
        else "num_kv_heads"
        if "num_kv_heads" in d
        else None
    )
    kv = d.get(kv_key) if kv_key else None
    kv = int(kv) if kv else heads
    tiny_heads = 2 * tp
    if kv == heads:
        tiny_kv = tiny_heads
    elif kv == 1:
        tiny_kv = 1  # multi-query stays multi-query (the plan refuses it as it would the real one)
    else:
        tiny_kv = tp
    return tiny_heads, (tiny_kv if kv_key else None)


def _layers(d: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """Tiny layer count and the per-layer lists cut to it (one layer of each kind the config lists)."""
    out: dict[str, Any] = {}
    types = d.get("layer_types")
    n = 2
    if isinstance(types, list) and types:
        kinds = list(dict.fromkeys(types))
        n = max(2, len(kinds))
        out["layer_types"] = (kinds * n)[:n]
    if isinstance(d.get("mlp_only_layers"), list):
        out["mlp_only_layers"] = [i for i in d["mlp_only_layers"] if i < n]
    if isinstance(d.get("max_window_layers"), int):
        out["max_window_layers"] = min(d["max_window_layers"], n)
    return n, out


def _rope(d: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """Rope parameters with per-frequency lists (long rope) cut to the tiny head size."""
    out: dict[str, Any] = {}
    for key in ("rope_parameters", "rope_scaling"):
        rope = d.get(key)
        if isinstance(rope, dict) and any(isinstance(v, list) for v in rope.values()):
            out[key] = {k: (v[: head_dim // 2] if isinstance(v, list) else v) for k, v in rope.items()}
    return out


def tiny_config(config: Any, *, tp: int) -> Any:
    """A tiny config of ``config``'s class and family (see the module docstring)."""
    d = config.to_dict()
    heads, kv = _heads(d, tp)
    hidden = heads * TINY_HEAD_DIM
    layers, per_layer = _layers(d)
    widths = {
        "hidden_size": hidden,
        "n_embd": hidden,
        "d_model": hidden,
        "word_embed_proj_dim": hidden,
        "num_attention_heads": heads,
        "n_head": heads,
        "num_key_value_heads": kv,
        "num_kv_heads": kv,
        "head_dim": TINY_HEAD_DIM,
        "query_pre_attn_scalar": TINY_HEAD_DIM,
        "num_hidden_layers": layers,
        "n_layer": layers,
        "intermediate_size": 2 * hidden,
        "ffn_dim": 2 * hidden,
        "ffn_hidden_size": 2 * hidden,
        "moe_intermediate_size": hidden // 2,
        "shared_expert_intermediate_size": hidden // 2,
        "num_local_experts": min(int(d.get("num_local_experts") or 0), 4),
        "num_experts": min(int(d.get("num_experts") or 0), 4),
        "num_experts_per_tok": min(int(d.get("num_experts_per_tok") or 0), 2),
        "vocab_size": TINY_VOCAB,
        "max_position_embeddings": 64,
        "n_positions": 64,
        "original_max_position_embeddings": 64,
        "sliding_window": 4,
    }
    changes = {k: v for k, v in widths.items() if k in d and d[k] is not None}
    if d.get("n_inner") is not None:
        changes["n_inner"] = 4 * hidden
    changes.update(per_layer)
    changes.update(_rope(d, TINY_HEAD_DIM))
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = d.get(key)
        if isinstance(value, int) and value >= TINY_VOCAB:
            changes[key] = TINY_VOCAB - 1
    changes["use_cache"] = False
    extra = {}
    if d.get("num_local_experts") or d.get("num_experts"):
        extra["experts_implementation"] = (
            "eager"  # the check runs in float64; grouped kernels take float32 only
        )
    return type(config).from_dict({**d, **changes}, **extra)


def describe_config(config: Any) -> str:
    """One line of the sizes that matter for TP: hidden, layers, heads, kv heads, vocabulary, experts."""
    d = config.to_dict()
    parts = [f"{k}={_canonical(d, k)}" for k in ("hidden_size", "num_hidden_layers", "num_attention_heads")]
    for key in (
        "num_key_value_heads",
        "num_kv_heads",
        "head_dim",
        "intermediate_size",
        "num_local_experts",
        "num_experts",
        "vocab_size",
    ):
        if d.get(key) is not None:
            parts.append(f"{key}={d[key]}")
    return ", ".join(parts)


def tiny_inputs(
    inputs: tuple[tuple[Any, ...], dict[str, Any]], config: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """One batch for the tiny model: 2 samples, at most ``TINY_SEQ`` positions, token ids in its vocabulary."""
    vocab = int(config.vocab_size)
    type_vocab = getattr(config, "type_vocab_size", None)

    def shrink(name: str, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        t = value[:2]
        if t.ndim >= 2:
            t = t[:, :TINY_SEQ]
        if t.is_floating_point() or t.dtype == torch.bool:
            return t
        if "token_type" in name and isinstance(type_vocab, int):
            return t.clamp(0, type_vocab - 1)
        if "position" in name:
            return t.clamp(0, TINY_SEQ - 1)
        if "mask" in name:
            return t
        return torch.where(t >= 0, t % vocab, t)  # ids (negative: ignored labels) into the tiny vocabulary

    args, kwargs = inputs
    return (tuple(shrink("input_ids", a) for a in args), {k: shrink(k, v) for k, v in kwargs.items()})


def check_memory_bytes(num_params: int, tp: int) -> int:
    """Host memory a whole-model check takes: per rank the job's model (float32) and two float64 copies."""
    return num_params * (4 + 8 + 8) * tp


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def choose_check_model(
    meta_model: nn.Module,
    *,
    tp: int,
    tiny: bool | None,
    max_params: int = DEFAULT_MAX_PARAMS,
    available: int | None = None,
) -> tuple[bool, str]:
    """Whether to check the tiny config (``tiny=None``: when the model does not fit or is large), and why.

    ``meta_model`` is the job's model built on the meta device (nothing allocated).
    """
    num_params = sum(p.numel() for p in meta_model.parameters())
    need = check_memory_bytes(num_params, tp)
    available = _available_memory() if available is None else available
    has_config = hasattr(getattr(meta_model, "config", None), "to_dict")
    size = f"{type(meta_model).__name__} has {num_params:,} parameters"
    if tiny is False:
        return False, f"{size}: checked whole (--full)"
    if tiny:
        reason = f"{size}; --tiny"
    elif available is not None and need > available // 2:
        reason = (
            f"{size}: a whole check at tp={tp} needs ~{need / 2**30:.1f} GiB, more than half of the "
            f"{available / 2**30:.1f} GiB available"
        )
    elif num_params > max_params:
        reason = f"{size}, more than --max-params={max_params:,}"
    else:
        return False, f"{size}: checked whole"
    if not has_config:
        raise ValueError(
            f"{reason}, but only a transformers model (with model.config) can be checked on a tiny "
            f"config of its family; run `merak check` on a smaller model of the same code, or pass "
            f"--full on a machine with ~{need / 2**30:.1f} GiB free"
        )
    return True, f"{reason}: checking a tiny config of the same family"


def tiny_builder(model_class: type, config: Any) -> Callable[[], nn.Module]:
    """``build()`` for ``check_plan_numerics``: the tiny model with random weights (seeded by the caller)."""

    def build() -> nn.Module:
        return model_class(config)

    return build
