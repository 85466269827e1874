"""The eager forward that decoding runs on this rank: the whole TP-sharded model (``pp == 1``) or
this pipeline stage's layers rebuilt as a transformers model of their own (``pp > 1``).

[Note: eager stages for decoding] Training runs traced graphs (``merak_graph``), and a graph traced
with ``use_cache=False`` has no cache path: it cannot run one token against stored keys and
values. Decoding therefore runs eager transformers code on the same parameter objects:

- ``pp == 1``: the composed module *is* the eager model after ``merak_tp.parallelize`` (head counts
  already fixed per TP rank), so it is called with a transformers ``DynamicCache``; each rank's
  cache holds the keys and values of its own heads (grouped-query kv heads too), i.e. it is sharded
  like the attention.
- ``pp > 1``: the stage holds decoder layers ``a..b-1`` (and the embedding on the first stage, the
  final norm and LM head on the last). A model of the same class is built on the meta device from
  the config with ``num_hidden_layers = b - a`` (``layer_types`` sliced alike), sharded by the same
  TP plan, and every parameter is bound to the stage's own ``nn.Parameter`` (by logical name, local
  layer ``i`` being layer ``a + i``), so it computes with the trained weights and allocates none.
  Its layers are numbered from 0, so its ``DynamicCache`` and the causal mask (which reads the
  cache's first layer) are those of a ``b - a`` layer model, which is exact. Stages after the first
  are fed the previous stage's hidden states as ``inputs_embeds`` (GPT-2's position table, added to
  them in ``forward``, gives zeros there); stages before the last replace the final norm by an
  identity and return the base model's hidden states. Buffers computed by constructors (rotary
  tables) are the constructor's, or the stage's where it holds them. Only families whose forward has
  been checked to be exactly this composition are accepted (:data:`FAMILIES`); a stage cut inside a
  decoder layer is refused.

Not done here: the decoding loop and the pipeline messages (:mod:`merak_core.generation.decode`).
"""

from __future__ import annotations

import copy
import inspect
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from merak_core.parallel.compose import ParallelModel
from merak_core.parallel.tensor_parallel import apply_tensor_parallel


@dataclass(frozen=True)
class Family:
    """Where a transformers decoder family keeps its parts (attribute paths)."""

    base: str
    layers: str
    norm: str
    position_table: str | None = None


_DECODER = Family(base="model", layers="layers", norm="norm")
FAMILIES: dict[str, Family] = {
    "gpt2": Family(base="transformer", layers="h", norm="ln_f", position_table="wpe"),
    **{t: _DECODER for t in ("llama", "mistral", "qwen2", "qwen3", "gemma", "mixtral")},
}
"""Families whose stage decoding under pipeline parallelism is exact (tested against transformers): their
base model's forward is embed (skipped with ``inputs_embeds``), masks and rotary tables from the config and
``position_ids``, the layers in order, the final norm; an embedding scale lives in the embedding module
(Gemma); every layer of a stage is built alike whatever its index (Qwen2/Qwen3 sliding layers follow
``layer_types``, sliced per stage); Mixtral's layers are all alike too (every one a mixture of experts, its
fused experts module TP-sharded like training's). Other mixture-of-experts families are left out: their
stage rebuilding is untested (Qwen3-MoE's dense or sparse layers follow the global index), so they
generate at pp=1, TP included."""


def cache_keyword(module: nn.Module) -> str:
    """The name ``module.forward`` takes its KV cache by, or a refusal naming what it must accept."""
    params = inspect.signature(module.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise ValueError(
        f"{type(module).__name__}.forward takes no KV cache (no 'cache' or 'past_key_values' parameter): "
        "generation needs a model whose forward accepts attention_mask, position_ids, a transformers Cache "
        "and use_cache=True (docs/generation.md)"
    )


def new_cache(config: Any) -> Any:
    from transformers import DynamicCache

    return DynamicCache(config=config) if config is not None else DynamicCache()


def _logits(output: Any) -> torch.Tensor:
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, tuple):
        return output[0]
    return output


class _Decoder:
    """What both decoders share: the call every decoding step makes, the cache, the logits of the LM head."""

    first: bool
    last: bool

    def __init__(self, config: Any, vocab_size: int | None, cached: nn.Module, head: nn.Module) -> None:
        """``cached``: the module that takes the KV cache; ``head``: the one that returns the logits."""
        self.config = config
        self.vocab_size = vocab_size
        self.cache_key = cache_keyword(cached)
        self.keep_last = "logits_to_keep" in inspect.signature(head.forward).parameters

    def new_cache(self) -> Any:
        return new_cache(self.config)

    def __call__(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Any,
        *,
        all_positions: bool = False,
    ) -> Any:
        """Hidden states (a stage before the last), else the last position's logits ``(b, v)``
        (``all_positions``: every position's, ``(b, t, v)``)."""
        kwargs: dict[str, Any] = {
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            self.cache_key: cache,
            "use_cache": True,
        }
        return self._forward(x, kwargs, all_positions)

    def _forward(self, x: torch.Tensor, kwargs: dict[str, Any], all_positions: bool) -> Any:
        raise NotImplementedError

    def _head_logits(self, module: nn.Module, kwargs: dict[str, Any], all_positions: bool) -> torch.Tensor:
        """``module``'s logits, of the last position only unless ``all_positions``."""
        # As transformers' generate: the LM head on the last position.
        if self.keep_last and not all_positions:
            kwargs["logits_to_keep"] = 1
        logits = _logits(module(**kwargs))
        logits = logits if all_positions else logits[:, -1, :]
        check_vocab(logits, self.vocab_size)
        return logits


class WholeModelDecoder(_Decoder):
    """``pp == 1``: the composed (TP-sharded) model itself."""

    first = True
    last = True

    def __init__(self, module: nn.Module, config: Any, vocab_size: int | None) -> None:
        super().__init__(config, vocab_size, module, module)
        self.module = module

    def _forward(self, x: torch.Tensor, kwargs: dict[str, Any], all_positions: bool) -> torch.Tensor:
        return self._head_logits(self.module, {"input_ids": x, **kwargs}, all_positions)


def check_vocab(logits_bv: torch.Tensor, vocab_size: int | None) -> None:
    if vocab_size is not None and logits_bv.shape[-1] < vocab_size:
        raise ValueError(
            f"the model returns {logits_bv.shape[-1]} logits per token but the vocabulary has {vocab_size}: "
            "they are vocab-sharded (a TP plan with vocab_parallel_loss); generation needs the gathered "
            "logits: use a plan without vocab_parallel_loss"
        )


class StageDecoder(_Decoder):
    """``pp > 1``: this stage's layers as a transformers model of their own ([Note: eager stages for decoding])."""

    def __init__(self, model: nn.Module, config: Any, family: Family, *, first: bool, last: bool) -> None:
        self.model = model
        self.family = family
        self.first = first
        self.last = last
        self.base = model.get_submodule(family.base)
        super().__init__(config, getattr(config, "vocab_size", None), self.base, model)

    def _forward(self, x: torch.Tensor, kwargs: dict[str, Any], all_positions: bool) -> Any:
        kwargs["input_ids" if self.first else "inputs_embeds"] = x
        if not self.last:
            return self.base(**kwargs).last_hidden_state
        return self._head_logits(self.model, kwargs, all_positions)


class _ZeroPositions(nn.Module):
    """A position table that adds nothing (stages after the first receive embedded hidden states)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros((*position_ids.shape, self.width), dtype=torch.float32, device=position_ids.device)


def family_of(pm: ParallelModel) -> tuple[Family, Any]:
    """The stage-decoding family of ``pm``'s model and its config, or a refusal naming the model type."""
    source = pm.source
    config = None if source is None else source.config
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(
            f"generation under pipeline parallelism rebuilds a stage's eager layers, which is exact for the "
            f"transformers families {sorted(FAMILIES)}; this model's type is {model_type!r}: generate at pp=1 "
            "(tensor parallelism works for any model with a KV-cache forward), docs/generation.md"
        )
    return FAMILIES[model_type], config


def _stage_layers(logical: list[str], family: Family) -> list[int]:
    pattern = re.compile(rf"^{re.escape(family.base)}\.{re.escape(family.layers)}\.(\d+)\.")
    found = sorted({int(m.group(1)) for name in logical if (m := pattern.match(name))})
    if not found or found != list(range(found[0], found[-1] + 1)):
        raise ValueError(
            f"this pipeline stage holds decoder layers {found}: generation needs a contiguous, non-empty run"
        )
    return found


def _sub_config(config: Any, first_layer: int, count: int) -> Any:
    sub = copy.deepcopy(config)
    sub.num_hidden_layers = count
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, list):
        sub.layer_types = layer_types[first_layer : first_layer + count]
    sub.use_cache = True
    return sub


def _global_name(name: str, family: Family, first_layer: int) -> str:
    prefix = f"{family.base}.{family.layers}."
    if not name.startswith(prefix):
        return name
    index, _, rest = name[len(prefix) :].partition(".")
    return f"{prefix}{int(index) + first_layer}.{rest}"


def _set_tensor(root: nn.Module, name: str, value: torch.Tensor, *, buffer: bool) -> None:
    owner_name, _, leaf = name.rpartition(".")
    owner = root.get_submodule(owner_name) if owner_name else root
    if buffer:
        owner._buffers[leaf] = value
    else:
        owner._parameters[leaf] = value  # type: ignore[assignment]


def _bind_parameters(
    sub: nn.Module, stage: dict[str, nn.Parameter], family: Family, first_layer: int
) -> None:
    """Every parameter of ``sub`` that the stage holds becomes the stage's own object (ties kept)."""
    groups: dict[int, list[str]] = {}
    for name, p in sub.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    for names in groups.values():
        held = [stage[g] for g in (_global_name(n, family, first_layer) for n in names) if g in stage]
        if not held:
            continue
        old = sub.get_parameter(names[0])
        if tuple(old.shape) != tuple(held[0].shape):
            raise ValueError(
                f"the rebuilt stage's {names[0]} has shape {tuple(old.shape)} but the trained stage holds "
                f"{tuple(held[0].shape)}: the TP plan did not shard the rebuilt layers like the trained ones"
            )
        for n in names:
            _set_tensor(sub, n, held[0], buffer=False)


def _bind_buffers(
    sub: nn.Module, stage_buffers: dict[str, torch.Tensor], family: Family, first_layer: int
) -> None:
    for name, _ in list(sub.named_buffers()):
        value = stage_buffers.get(_global_name(name, family, first_layer))
        if value is not None:
            _set_tensor(sub, name, value, buffer=True)


def _check_complete(sub: nn.Module, family: Family, *, first: bool, last: bool) -> None:
    unused = []
    if not first:
        unused.append(f"{family.base}.")  # embeddings are never called there (inputs_embeds)
    if not last:
        unused.append("lm_head.")
    missing = [
        n
        for n, p in sub.named_parameters(remove_duplicate=False)
        if p.is_meta and not (any(n.startswith(u) for u in unused) and _outside_layers(n, family))
    ]
    if missing:
        raise ValueError(
            f"this pipeline stage does not hold {missing[:4]}{' ...' if len(missing) > 4 else ''}: the stage "
            "cut falls inside a decoder layer; generation under pp needs cuts between layers (set "
            "training.split_points to decoder layers, e.g. model.layers.2)"
        )


def _outside_layers(name: str, family: Family) -> bool:
    return not name.startswith(f"{family.base}.{family.layers}.") and not name.startswith(
        f"{family.base}.{family.norm}."
    )


def build_stage_decoder(pm: ParallelModel, device: torch.device) -> StageDecoder:
    """This rank's stage as an eager transformers model on the stage's parameters ([Note: eager stages for decoding])."""
    import merak_graph

    family, config = family_of(pm)
    assert pm.source is not None and pm.partition is not None
    stage_index = pm.layout.pp_rank
    stage_params = {
        pm.logical_names[local]: p for local, p in pm.module.named_parameters() if local in pm.logical_names
    }
    layers = _stage_layers(list(stage_params), family)
    first, last = stage_index == 0, stage_index == pm.num_stages - 1
    sub_cfg = _sub_config(config, layers[0], len(layers))
    with merak_graph.empty_init(include_buffers=False):
        sub = pm.source.model_class(sub_cfg)
    sub = apply_tensor_parallel(sub, pm.layout, plan=pm.source.tp_plan)
    _bind_parameters(sub, stage_params, family, layers[0])
    buffer_names = pm.partition.stage_buffer_names(stage_index)
    local_buffers = dict(pm.module.named_buffers())
    _bind_buffers(
        sub,
        {orig: local_buffers[loc] for loc, orig in buffer_names.items() if loc in local_buffers},
        family,
        layers[0],
    )
    base = sub.get_submodule(family.base)
    if not first and family.position_table is not None:
        setattr(base, family.position_table, _ZeroPositions(int(config.hidden_size)))
    if not last:
        setattr(base, family.norm, nn.Identity())
    _check_complete(sub, family, first=first, last=last)
    for name, buf in list(sub.named_buffers()):
        if buf.device != device:
            _set_tensor(sub, name, buf.to(device), buffer=True)
    sub.eval()
    return StageDecoder(sub, sub_cfg, family, first=first, last=last)
