"""PEFT adapter folders in and out: ``adapter_config.json`` + ``adapter_model.safetensors``.

A LoRA run (:mod:`merak_core.lora`) exports its adapters as the folder ``peft.PeftModel.from_pretrained``
loads, and ``model.lora.from`` starts a run from such a folder. The format is written and read
here with ``json`` and ``safetensors`` alone (``peft`` is not needed): tensor keys are
``base_model.model.<module path>.lora_A.weight`` / ``.lora_B.weight`` (A ``r x in``, B ``out x r``,
the layout of :class:`merak_core.lora.layer.LoraLinear`), one file, no shards.

Not done here: the adapters' math and sharding (``merak_core.lora``), full-model folders
(``export.py`` and ``pretrained.py``).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from merak_core.hf.pretrained import read_local_shard
from merak_core.lora import LoraConfig
from merak_core.lora.apply import is_adapter_name
from merak_core.lora.init import initialise_adapters

if TYPE_CHECKING:
    from merak_core.parallel.compose import ParallelModel

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
KEY_PREFIX = "base_model.model."

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "export_adapters",
    "merge_adapters",
    "read_adapter_config",
    "start_adapters",
    "write_adapter_folder",
]


def read_adapter_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``adapter_config.json`` of a PEFT LoRA folder; ValueError naming what is missing or wrong."""
    folder = Path(path)
    config_file, weights = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
    if not config_file.is_file() or not weights.is_file():
        raise ValueError(
            f"model.lora.from={str(folder)!r} is not a PEFT adapter folder: it needs {ADAPTER_CONFIG} and "
            f"{ADAPTER_WEIGHTS} (as PeftModel.save_pretrained writes them)"
        )
    config = json.loads(config_file.read_text())
    if config.get("peft_type") != "LORA":
        raise ValueError(
            f"model.lora.from={str(folder)!r}: peft_type is {config.get('peft_type')!r}, expected 'LORA'"
        )
    return dict(config)


def check_adapter_folder(config: LoraConfig) -> None:
    """``lora.from_dir`` holds a LoRA adapter of the same rank and scale (ValueError otherwise)."""
    if config.from_dir is None:
        return
    saved = read_adapter_config(config.from_dir)
    theirs = (saved.get("r"), float(saved.get("lora_alpha", 8)), bool(saved.get("use_rslora", False)))
    if theirs[:2] != (config.r, config.alpha) or theirs[2]:
        raise ValueError(
            f"model.lora.from={config.from_dir!r} holds r={theirs[0]}, lora_alpha={theirs[1]:g}"
            f"{', use_rslora' if theirs[2] else ''}; model.lora has r={config.r}, alpha={config.alpha:g}: "
            "set model.lora's r and alpha to the folder's"
        )


@torch.no_grad()
def start_adapters(pm: ParallelModel, config: LoraConfig, *, seed: int) -> None:
    """Fill this rank's adapters: from ``config.from_dir`` (its TP slices), else drawn (``lora.init``)."""
    layout = pm.layout
    named = [(n, p) for n, p in pm.named_parameters() if is_adapter_name(n)]
    if config.from_dir is None:
        initialise_adapters(named, tp=layout.tp, tp_rank=layout.tp_rank, seed=seed)
        return
    check_adapter_folder(config)
    from safetensors import safe_open

    with safe_open(str(Path(config.from_dir) / ADAPTER_WEIGHTS), framework="pt") as reader:
        keys = set(reader.keys())
        for name, p in named:
            key = KEY_PREFIX + name
            if key not in keys:
                raise ValueError(
                    f"model.lora.from={config.from_dir!r} has no tensor {key!r}: the folder's adapters are on "
                    f"other modules (it holds e.g. {sorted(keys)[:3]}); set model.lora.target_modules to its"
                )
            part = read_local_shard(reader.get_slice(key), p, layout.tp, layout.tp_rank)
            if tuple(part.shape) != tuple(p.shape):
                raise ValueError(
                    f"model.lora.from={config.from_dir!r}: {key!r} gives this rank a block of shape "
                    f"{list(part.shape)}, the adapter's is {list(p.shape)}: the folder was trained on "
                    "another model"
                )
            p.copy_(part)


def _gathered_adapters(pm: ParallelModel) -> dict[str, torch.Tensor]:
    """Every adapter of the model, whole, on global rank 0 (empty elsewhere); collective over the world."""
    from merak_core.parallel.fsdp import full_local_tensor
    from merak_tp.shard_spec import get_shard_spec

    layout = pm.layout
    local: dict[str, torch.Tensor] = {}
    for name, p in pm.named_parameters():
        if not is_adapter_name(name) or name in local:
            continue
        whole = full_local_tensor(p.detach())  # ZeRO-2/3: the adapter gathered over DP (collective)
        tensor = get_shard_spec(p).gather(whole, layout.tp_group) if layout.tp > 1 else whole
        local[name] = tensor.cpu().contiguous()
    contribute = layout.dp_rank == 0 and layout.tp_rank == 0
    parts: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(local if contribute else {}, parts, dst=0)
    full: dict[str, torch.Tensor] = {}
    for part in parts or []:
        full.update(part)
    return dict(sorted(full.items()))


def adapter_config(config: LoraConfig, modules: list[str], *, base: str | None) -> dict[str, Any]:
    """The ``adapter_config.json`` PEFT writes for these adapters (``target_modules``: the wrapped modules)."""
    alpha: float | int = int(config.alpha) if float(config.alpha).is_integer() else config.alpha
    return {
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": base,
        "r": config.r,
        "lora_alpha": alpha,
        "lora_dropout": config.dropout,
        "target_modules": config.target_modules if not config.all_linear else modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def write_adapter_folder(
    tensors: dict[str, torch.Tensor], config: LoraConfig, out: str | os.PathLike[str], *, base: str | None
) -> Path:
    """Write ``tensors`` (every adapter, whole, by logical name) as a PEFT folder, in this process."""
    from safetensors.torch import save_file

    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    adapters = {name: t for name, t in tensors.items() if is_adapter_name(name)}
    modules = sorted({name.rsplit(".", 2)[0] for name in adapters})
    keyed = {KEY_PREFIX + name: t.contiguous() for name, t in sorted(adapters.items())}
    tmp = out_dir / (ADAPTER_WEIGHTS + ".tmp")
    save_file(keyed, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out_dir / ADAPTER_WEIGHTS)
    text = json.dumps(adapter_config(config, modules, base=base), indent=2, sort_keys=True)
    (out_dir / ADAPTER_CONFIG).write_text(text + "\n")
    logger.info("wrote %d adapter tensors to %s (a PEFT LoRA folder)", len(keyed), out_dir)
    return out_dir


def export_adapters(pm: ParallelModel, out: str | os.PathLike[str], *, base: str | None = None) -> Path:
    """Write the run's adapters as a PEFT folder (collective over the world; rank 0 writes)."""
    if pm.lora is None:
        raise ValueError("export_adapters needs a model composed with LoRA (Trainer(..., lora=...))")
    tensors = _gathered_adapters(pm)
    if dist.get_rank() == 0:
        write_adapter_folder(tensors, pm.lora, out, base=base)
    dist.barrier()
    return Path(out)


def merge_adapters(
    state: dict[str, torch.Tensor], config: LoraConfig, model: nn.Module
) -> dict[str, torch.Tensor]:
    """``state`` (a LoRA run's logical tensors) with each adapted weight replaced by ``W + scaling * B A``
    and the adapters dropped. ``model`` (meta is fine) says which weights are ``Conv1D``s, stored (in, out)."""
    merged = {name: t for name, t in state.items() if not is_adapter_name(name)}
    for name in state:
        if not name.endswith(".lora_A.weight"):
            continue
        path = name.removesuffix(".lora_A.weight")
        a, b = state[name], state[path + ".lora_B.weight"]
        weight = merged[path + ".weight"]
        delta = (b.double() @ a.double()) * config.scaling  # (out, in)
        if type(model.get_submodule(path)).__name__ == "Conv1D":
            delta = delta.t()
        merged[path + ".weight"] = (weight.double() + delta).to(weight.dtype)
    return merged


def base_state(
    model: nn.Module, folder: str | os.PathLike[str], base: dict[str, Any], checkpoint: Path
) -> dict[str, torch.Tensor]:
    """The frozen weights of an adapter-only checkpoint's run, read whole from the pretrained ``folder`` (the
    model built from it, meta, names them), checked against the checkpoint's fingerprint of its base
    ([Note: adapter-only checkpoints] in ``merak_core.checkpoint.frozen``; CheckpointError if it differs)."""
    from merak_core.checkpoint.frozen import check_base, tensor_fingerprint
    from merak_core.hf.pretrained import PretrainedWeights

    weights = PretrainedWeights.match(model, folder)
    state: dict[str, torch.Tensor] = {}
    with weights.folder.reader(keep_open=False) as reader:
        for name, file_name in weights.file_names.items():
            state[name] = reader.get_slice(file_name)[:]
    first: dict[int, str] = {}
    alias: dict[str, str] = {}  # every name of a (tied) parameter -> the name it is read under
    for name, p in model.named_parameters(remove_duplicate=False):
        alias[name] = first.setdefault(id(p), name)
    wanted = base.get("fingerprint", {})
    mine = {
        name: [float(v) for v in tensor_fingerprint(state[alias[name]])]
        for name in wanted
        if alias.get(name) in state
    }
    check_base(checkpoint, base, mine, str(folder))
    return state


def checkpoint_lora(meta: dict[str, Any], *, merge: bool, checkpoint: str) -> LoraConfig | None:
    """The LoRA config a checkpoint's metadata records (None for a full fine-tune; ValueError for ``merge``
    without LoRA)."""
    raw = meta.get("lora")
    if raw is None:
        if merge:
            raise ValueError(
                f"--merge: checkpoint {checkpoint!r} is not a LoRA run's (it holds every weight, nothing to "
                "merge): drop --merge"
            )
        return None
    return LoraConfig(**raw)
