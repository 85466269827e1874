"""``model: {pretrained: PATH}``: a Hugging Face folder's weights into any 3D layout, slice by slice.

::

    model = pretrained_model("gpt2-small/", dtype=torch.float32)   # meta device: nothing allocated
    weights = PretrainedWeights.match(model, "gpt2-small/")       # names and shapes, before any collective
    pm = build_parallel_model(model, layout, ...)                 # TP, then this rank's stage only
    weights.load_into(pm)                                         # this rank's slices of its stage

(:class:`merak_core.Trainer` does the last three with ``pretrained=PATH``.) Under ZeRO-2/3 the Trainer
calls ``load_into`` on the model after FSDP2 has cut its parameters over DP (the stage is allocated
before that, never written by :func:`skip_init`): each rank then reads only the rows its shard keeps, as a
checkpoint resume does, instead of its whole stage that FSDP2 would cut afterwards
(``tests/e2e/test_pretrained_load_memory.py``).

The model is built from ``config.json`` on the meta device (``merak_graph.empty_init``), so a
rank allocates only its own stage's TP shards when the stage is materialised. Each rank then
reads, for each of its parameters, only its TP slice of that tensor from the safetensors file
(``get_slice``: for a sharded dim-0 tensor only those rows are read; for each section of a
fused q/k/v, gate/up or grouped-query projection its own block). Nothing outside this rank's
stage is opened beyond the file headers. [Note: pretrained tensor names] Names are matched
through every alias of a tied parameter (``lm_head.weight`` and ``transformer.wte.weight`` are
one tensor; the folder holds one of them), and ``Conv1D`` weights (GPT-2, stored ``(in, out)``)
are sliced in the file's orientation and transposed into the TP layer's ``(out, in)``; both
come from the ``ShardSpec`` merak-tp puts on every parameter (``merak_tp.get_shard_spec``).
[Note: legacy layouts] transformers writes some families' tensors in an older layout and converts
them when it loads them: a tensor it only renames (GPT-NeoX's ``embed_out.weight`` is
``lm_head.weight``) is found under its old name; one it merges (Mixtral's and Qwen3-MoE's experts,
stored one by one, fused into one tensor) is refused, naming the save that avoids it.

Not done here: reading folders (``folder.py``), writing them (``export.py``). Persistent
buffers are not read from the folder: they keep the values the model's constructor computes
(transformers models keep none in their weights files).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from merak_core.checkpoint.regions import copy_regions_, local_regions
from merak_core.checkpoint.specs import TensorSpec
from merak_core.hf.folder import PretrainedFolder
from merak_core.lora.apply import is_adapter_name

if TYPE_CHECKING:
    from merak_core.parallel.compose import ParallelModel

logger = logging.getLogger(__name__)

ModelFactory = Callable[..., nn.Module]


def pretrained_model(
    path: str | os.PathLike[str],
    *,
    factory: ModelFactory | None = None,
    factory_kwargs: Mapping[str, Any] | None = None,
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """The model a Hugging Face folder describes, on the meta device (no weight is read or allocated).

    Without ``factory`` the class is transformers' ``config.architectures[0]`` (falling back to
    ``AutoModelForCausalLM``) built with ``_from_config``; with one (a model outside
    transformers), ``factory(config, **factory_kwargs)`` is called with the parsed
    ``config.json`` dict. ``dtype`` converts the (meta) parameters, e.g. to the run's dtype.
    """
    import merak_graph

    folder = PretrainedFolder(path)
    with merak_graph.empty_init():
        if factory is not None:
            model = factory(dict(folder.config), **dict(factory_kwargs or {}))
        else:
            model = _transformers_model(folder)
    if not isinstance(model, nn.Module):
        raise ValueError(f"model.factory returned a {type(model).__name__}, not an nn.Module")
    if dtype is not None:
        model.to(dtype=dtype)
    return model


def _transformers_model(folder: PretrainedFolder) -> nn.Module:
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"model.pretrained: {str(folder.path)!r} is a Hugging Face folder; building it needs transformers: "
            "pip install 'merak-core[transformers]' (or give model.factory for a model outside transformers)"
        ) from exc
    config = transformers.AutoConfig.from_pretrained(str(folder.path))
    architectures = list(getattr(config, "architectures", None) or [])
    cls = getattr(transformers, architectures[0], None) if architectures else None
    if cls is None or not hasattr(cls, "_from_config"):
        cls = transformers.AutoModelForCausalLM
        return cls.from_config(config)  # type: ignore[no-any-return]
    return cls._from_config(config)  # type: ignore[no-any-return]


def _renamed_tensors(model: nn.Module, names: set[str]) -> dict[str, str]:
    """{name transformers loads a folder tensor under: the folder's name} for the tensors its checkpoint
    conversion for ``model`` only renames (GPT-NeoX's ``embed_out`` is ``lm_head``): a renamed tensor is
    the same tensor, sliced as any other. Tensors it merges or splits are not listed ([Note: legacy
    layouts])."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, apply_renamings

        if not isinstance(model, PreTrainedModel):
            return {}
        renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
        renamed = {name: apply_renamings(name, renamings) for name in names} if renamings else {}
    except Exception:  # noqa: BLE001 - no transformers, a model outside it, another version's API: no renames
        return {}
    return {new: name for name, new in renamed.items() if new != name and new not in names}


def _converted_layout(model: nn.Module) -> str:
    """A note when transformers converts this model's tensors on load (renamed or merged: the legacy
    layout ``save_pretrained`` writes back, e.g. GPT-NeoX's ``embed_out``, per-expert MoE weights)."""
    config = getattr(model, "config", None)
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:
        return ""
    keys = (type(model).__name__, getattr(config, "model_type", None))
    if not any(k and get_checkpoint_conversion_mapping(k) for k in keys):
        return ""
    return (
        f". transformers converts the tensors of {keys[0]} (model_type {keys[1]!r}) when it loads them: "
        "model.pretrained follows its renames but does not merge tensors yet (e.g. per-expert weights "
        "fused into one): save the folder under the model's own names (transformers' "
        "save_pretrained(DIR, save_original_format=False), or merak export)"
    )


@dataclass(frozen=True)
class _Layout:
    """How a local (possibly TP-sharded) parameter is cut from the file's tensor."""

    dim: int | None
    """The sharded dim in the file's orientation, or None (the rank holds the whole tensor)."""
    section_sizes: tuple[int, ...]
    """Full sizes of the sections along ``dim`` (one entry when not fused)."""
    transposed: bool
    """The parameter is stored ``(out, in)`` while the file holds ``(in, out)`` (Conv1D)."""


def _layout_of(param: torch.Tensor, tp: int, full_shape: tuple[int, ...]) -> _Layout:
    """Read merak-tp's ``ShardSpec`` (see [Note: shard metadata] in ``merak_tp.shard_spec``)."""
    from merak_tp.shard_spec import get_shard_spec, section_sizes

    spec = get_shard_spec(param)
    transposed = spec.transposed and param.ndim == 2
    dim = spec.dim if tp > 1 else None
    if dim is not None and transposed:
        dim = 1 - dim
    if dim is None:
        return _Layout(None, (), transposed)
    return _Layout(dim, section_sizes(spec.sections, full_shape[dim]), transposed)


def read_local_shard(entry: Any, param: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    """This rank's part of a file tensor (a safetensors slice or a tensor), in ``param``'s orientation.

    Each section along the sharded dim is split into ``tp`` equal blocks and block ``tp_rank``
    of every section is read (for a safetensors slice, only those bytes are copied out).
    """
    from merak_core.parallel.fused_experts import expert_shard

    record = expert_shard(param)  # fused experts at ep > 1: this rank's experts (rows of dim 0) only
    if record is not None:
        return entry[record.first : record.first + record.num_local]
    full_shape = tuple(entry.get_shape()) if not isinstance(entry, torch.Tensor) else tuple(entry.shape)
    layout = _layout_of(param, tp, full_shape)
    if layout.dim is None:
        part = entry[...] if isinstance(entry, torch.Tensor) else entry[:]
    else:
        blocks, start = [], 0
        index: list[slice] = [slice(None)] * len(full_shape)
        for size in layout.section_sizes:
            width = size // tp
            index[layout.dim] = slice(start + tp_rank * width, start + (tp_rank + 1) * width)
            blocks.append(entry[tuple(index)])
            start += size
        part = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=layout.dim)
    return part.t() if layout.transposed else part


class PretrainedWeights:
    """The match between a model's parameters and a folder's tensors (see the module docstring)."""

    def __init__(self, folder: PretrainedFolder, file_names: dict[str, str], unused: list[str]) -> None:
        self.folder = folder
        self.file_names = file_names
        """Logical parameter name -> the tensor name in the folder (an alias for tied weights)."""
        self.unused = unused
        """Tensors of the folder no parameter takes (logged, not an error: transformers does the same)."""

    @classmethod
    def match(cls, model: nn.Module, path: str | os.PathLike[str] | PretrainedFolder) -> PretrainedWeights:
        """Match ``model``'s (unsharded, usually meta) parameters to the folder by name and shape.

        Pure and identical on every rank: call it before any collective so that a folder that
        does not fit the model fails everywhere at once. Raises ``ValueError`` naming the
        missing tensors or the first shape mismatch.
        """
        folder = path if isinstance(path, PretrainedFolder) else PretrainedFolder(path)
        available = set(folder.weight_map)
        renamed = _renamed_tensors(model, available)
        aliases: dict[int, list[str]] = {}
        params: dict[int, nn.Parameter] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
            params[id(p)] = p
        file_names: dict[str, str] = {}
        missing: list[str] = []
        for names in aliases.values():
            found = next((n for n in names if n in available), None) or next(
                (renamed[n] for n in names if n in renamed), None
            )
            if found is None:
                missing.append(names[0])
            else:
                file_names[names[0]] = found
        if missing:
            raise ValueError(
                f"model.pretrained: {str(folder.path)!r} lacks {len(missing)} of the model's parameters, e.g. "
                f"{sorted(missing)[:6]}; the folder must hold the weights of this architecture (its tensors "
                f"are named like {folder.tensor_names[:3]}){_converted_layout(model)}"
            )
        cls._check_shapes(folder, {names[0]: params[key] for key, names in aliases.items()}, file_names)
        used = set(file_names.values())
        unused = sorted(available - used)
        if unused:
            logger.warning(
                "%s: %d tensors are not parameters of the model and are ignored, e.g. %s",
                folder.path,
                len(unused),
                unused[:4],
            )
        return cls(folder, file_names, unused)

    @staticmethod
    def _check_shapes(
        folder: PretrainedFolder, params: dict[str, nn.Parameter], file_names: dict[str, str]
    ) -> None:
        with folder.reader() as reader:
            for name, file_name in file_names.items():
                shape = tuple(reader.get_slice(file_name).get_shape())
                if shape != tuple(params[name].shape):
                    raise ValueError(
                        f"model.pretrained: tensor {file_name!r} of {str(folder.path)!r} has shape {list(shape)}, "
                        f"the model built from its config.json has {list(params[name].shape)} for {name!r}: "
                        "the folder's weights and config.json disagree (save them together with save_pretrained)"
                    )

    def load_into(self, pm: ParallelModel) -> int:
        """Copy this rank's slices into its parameters (no collective); returns the bytes read.

        A ZeRO-2/3 parameter (a DTensor FSDP2 made) receives only the rows its shard keeps (see
        [Note: bounded checkpoint loads] in ``merak_core.checkpoint.regions``): call it after sharding.
        """
        layout = pm.layout
        read = 0
        seen: set[int] = set()
        with torch.no_grad(), self.folder.reader(keep_open=False) as reader:  # [Note: mapped pages]
            for name, p in pm.named_parameters():
                if id(p) in seen:
                    continue
                seen.add(id(p))
                file_name = self.file_names.get(name)
                if file_name is None and pm.lora is not None and is_adapter_name(name):
                    continue  # a LoRA adapter: not in the base folder (merak_core.hf.adapters fills it)
                if file_name is None:
                    raise ValueError(
                        f"parameter {name!r} of this rank's stage is not a parameter of the model "
                        "PretrainedWeights.match was given: match the model the stage was built from"
                    )
                # Each block of the file's tensor this rank holds (one per section of a fused q/k/v or
                # gate/up) is read and copied into its place: nothing larger than a block is staged.
                regions = local_regions(p, TensorSpec(p, layout.tp, layout.tp_rank))
                read += copy_regions_(regions, reader.get_slice(file_name).__getitem__)
        logger.info(
            "rank read %.1f MB of pretrained weights for its %d parameters from %s",
            read / 1e6,
            len(seen),
            self.folder.path,
        )
        return read


def skip_init(module: nn.Module) -> None:
    """An ``init_fn`` that leaves materialised tensors as allocated: every one is then loaded."""
    del module
