"""Hugging Face export: a Merak run or checkpoint as a folder ``from_pretrained`` loads.

::

    merak export out/checkpoints/latest --to-hf out/hf      # a checkpoint, in one process
    export_hf(trainer.checkpoint_parts, "out/hf")           # a live run (collective)

The folder holds the weights as safetensors shards (``model-0000k-of-0000n.safetensors`` with a
``model.safetensors.index.json``, or one ``model.safetensors`` when it fits one shard), the
``config.json`` of the pretrained folder the run started from (its ``dtype`` set to the
exported one) and that folder's tokenizer and generation files (:data:`COMPANION_FILES`),
copied as they are. Tensor names are the model's logical names (a tied parameter once, under
the name the original folder used; see [Note: pretrained tensor names]); ``Conv1D`` weights
are written in their own ``(in, out)`` layout.

[Note: export from a run] A live run is exported without gathering the model on one rank at
once: on every stage, DP rank 0's TP group gathers the stage's TP shards (one tensor at a time)
and its TP rank 0 keeps them (at ep > 1 the first EP group's ranks, each expert gathered over EP;
under ZeRO-2/3 every DP rank of the stage first takes part in each parameter's gather over its
mesh, written or not); a parameter held by several stages (tied embeddings) is kept by the
first. The files are cut by one rule for both exports (:func:`shard_groups`: natural name order,
consecutive runs under ``max_shard_size``), so a run's export and its checkpoint's are the same
files; global rank 0 writes them one after the other, each stage sending it that file's tensors
(rank 0 holds at most one file of other stages' tensors beside its own stage's). Rank 0 then
writes the index, ``config.json`` and the companion files last, so a folder with an index is
complete.

A live run is handed as its :class:`~merak_core.checkpoint.parts.CheckpointParts` (the model, the
layout, the device and the folder it started from), never as the Trainer.

Not done here: reading folders (``folder.py``), choosing when to export (the trainer).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from merak_core.checkpoint.parts import CheckpointParts
from merak_core.hf.folder import CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE, PretrainedFolder

logger = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_BYTES = 5 * 1000**3
_SHARD_RE = re.compile(r"^model(-\d+-of-\d+)?\.safetensors$")
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "kib": 1024, "mib": 1024**2, "gib": 1024**3}


def parse_size(value: int | str) -> int:
    """Bytes from ``5GB``, ``200MiB``, ``10KB`` or an int (the ``max_shard_size`` of save_pretrained)."""
    if isinstance(value, int):
        size = value
    else:
        match = _SIZE_RE.match(str(value))
        if match is None:
            raise ValueError(f"max_shard_size {value!r} is not a size such as '5GB', '500MB' or 1000000")
        size = int(float(match.group(1)) * _UNITS[(match.group(2) or "B").lower()])
    if size < 1:
        raise ValueError(f"max_shard_size must be positive, got {value!r}")
    return size


def _chunks(sizes: Sequence[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Consecutive names grouped so that each group stays under ``max_bytes`` (a bigger tensor alone)."""
    groups: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name, size in sizes:
        if current and used + size > max_bytes:
            groups.append(current)
            current, used = [], 0
        current.append(name)
        used += size
    if current:
        groups.append(current)
    return groups


def _natural_key(name: str) -> list[Any]:
    """``h.2`` before ``h.10``: names compared part by part, numbers as numbers."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name)]


def shard_groups(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """The tensor names of each file: in natural name order, consecutive runs under ``max_bytes``.

    One rule for both exports (a checkpoint in one process, a live run over its stages), so that the
    same model and ``max_shard_size`` give the same files whichever wrote them.
    """
    names = sorted(sizes, key=_natural_key)
    return _chunks([(n, sizes[n]) for n in names], max_bytes)


def _shard_name(index: int, total: int) -> str:
    return WEIGHTS_FILE if total == 1 else f"model-{index + 1:05d}-of-{total:05d}.safetensors"


def _save_shard(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)


def check_out_dir(out: str | os.PathLike[str], *, what: str) -> None:
    """An export writes a folder: refuse ``out`` when it, or a path it would be created under, is a file.

    ``what`` names the setting in the error (``--to-hf``, ``training.export_hf_dir``). Pure: called before
    anything is read or written (and by the launch checks for ``export_hf_dir``).
    """
    path = Path(out)
    probe = path
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        where = "is an existing file" if probe == path else f"cannot be created: {str(probe)!r} is a file"
        raise ValueError(
            f"{what} {str(out)!r} {where}, and an export writes a folder (safetensors weights, config.json, "
            "tokenizer files): give a new or existing folder"
        )


def prepare_out_dir(out: Path) -> None:
    """Create ``out``, removing the weights and index a previous export left there (nothing else)."""
    out.mkdir(parents=True, exist_ok=True)
    for entry in out.iterdir():
        if entry.is_file() and (
            _SHARD_RE.match(entry.name) or entry.name == INDEX_FILE or entry.name.endswith(".safetensors.tmp")
        ):
            entry.unlink()


def write_metadata(
    out: Path,
    weight_map: dict[str, str],
    total_bytes: int,
    *,
    source: PretrainedFolder | None,
    dtype: torch.dtype | None,
) -> None:
    """The index (for more than one shard), ``config.json`` (dtype updated) and the companion files."""
    if source is not None:
        for path in source.companion_files():
            shutil.copy2(path, out / path.name)
        config = dict(source.config)
        if dtype is not None:
            config["dtype"] = str(dtype).removeprefix("torch.")
            config.pop("torch_dtype", None)
        (out / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    files = set(weight_map.values())
    if len(files) > 1:
        index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        tmp = out / (INDEX_FILE + ".tmp")
        tmp.write_text(json.dumps(index, indent=2) + "\n")
        os.replace(tmp, out / INDEX_FILE)


def write_hf_folder(
    state: dict[str, torch.Tensor],
    out: str | os.PathLike[str],
    *,
    source: PretrainedFolder | None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write a full state dict (logical names) as a Hugging Face folder, in this process alone."""
    out_dir = Path(out)
    prepare_out_dir(out_dir)
    sizes = {name: t.numel() * t.element_size() for name, t in state.items()}
    groups = shard_groups(sizes, parse_size(max_shard_size))
    weight_map: dict[str, str] = {}
    for i, names in enumerate(groups):
        file_name = _shard_name(i, len(groups))
        _save_shard({n: state[n] for n in names}, out_dir / file_name)
        weight_map.update(dict.fromkeys(names, file_name))
    dtype = next(iter(state.values())).dtype if state else None
    write_metadata(out_dir, weight_map, sum(sizes.values()), source=source, dtype=dtype)
    return out_dir


def resolve_source(
    pretrained: str | os.PathLike[str] | PretrainedFolder | None, recorded: str | None = None
) -> PretrainedFolder | None:
    """The pretrained folder whose config and tokenizer an export copies: given, else the recorded one."""
    if isinstance(pretrained, PretrainedFolder):
        return pretrained
    if pretrained is not None:
        return PretrainedFolder(pretrained)
    if recorded is not None:
        if not Path(recorded).is_dir():
            raise ValueError(
                f"the run started from the pretrained folder {recorded!r}, which no longer exists: pass "
                "--pretrained PATH (merak export) with a folder holding its config.json and tokenizer files"
            )
        return PretrainedFolder(recorded)
    return None


def _config_tensors(source: PretrainedFolder) -> tuple[dict[str, tuple[int, ...]], list[list[str]], str]:
    """(name -> shape for every name of every parameter, the names of each parameter, the model's class name)
    of the model ``source``'s ``config.json`` builds on the meta device; for a config transformers cannot build
    (a model outside transformers), the tensors of the folder's own weights files."""
    from merak_core.hf.pretrained import pretrained_model

    try:
        model = pretrained_model(source.path)
    except (ImportError, ValueError, KeyError, TypeError, OSError):
        with source.reader() as reader:
            shapes = {n: tuple(reader.get_slice(n).get_shape()) for n in source.tensor_names}
        return shapes, [[n] for n in shapes], f"the tensors of its weights files, {len(shapes)}"
    aliases: dict[int, list[str]] = {}
    shapes = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
        shapes[name] = tuple(p.shape)
    return shapes, list(aliases.values()), type(model).__name__


def check_state_fits(state: dict[str, torch.Tensor], source: PretrainedFolder, *, checkpoint: str) -> None:
    """Every tensor of ``state`` is a parameter of the model ``source``'s ``config.json`` describes, with its shape,
    and every parameter of that model is in ``state`` (one name of a tied one); else one ``ValueError``."""
    shapes, groups, model = _config_tensors(source)
    unknown = sorted(n for n in state if n not in shapes)
    missing = sorted(names[0] for names in groups if not any(n in state for n in names))
    differ = [
        (n, list(t.shape), list(shapes[n]))
        for n, t in state.items()
        if n in shapes and tuple(t.shape) != shapes[n]
    ]
    problems = []
    if unknown:
        problems.append(
            f"{len(unknown)} of its {len(state)} tensors are not in that model, e.g. {unknown[:3]}"
        )
    if missing:
        problems.append(
            f"{len(missing)} of the model's parameters are not in the checkpoint, e.g. {missing[:3]}"
        )
    if differ:
        name, got, want = differ[0]
        problems.append(
            f"{len(differ)} shapes differ, e.g. {name!r} is {got} in the checkpoint, {want} in the model"
        )
    if problems:
        raise ValueError(
            f"checkpoint {checkpoint!r} does not hold the model {str(source.path / CONFIG_FILE)!r} describes "
            f"({model}): {'; '.join(problems)}; nothing was written. Pass --pretrained the folder the checkpoint's "
            "run started from (the config.json of this model)"
        )


def export_checkpoint(
    checkpoint: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    pretrained: str | os.PathLike[str] | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_BYTES,
    merge: bool = False,
) -> Path:
    """A checkpoint directory or ``latest`` pointer as a Hugging Face folder (one process, verified).

    A LoRA run's checkpoint is written as a PEFT adapter folder, or with ``merge`` as the whole model
    with the adapters merged into their weights (``W + alpha / r * B A``, :mod:`merak_core.hf.adapters`).
    """
    from merak_core.checkpoint.files import latest_candidates, pointer_root, read_checkpoint_meta
    from merak_core.checkpoint.weights import read_checkpoint_model
    from merak_core.hf.adapters import base_state, checkpoint_lora, merge_adapters, write_adapter_folder

    check_out_dir(out, what="--to-hf")
    state = read_checkpoint_model(checkpoint)
    root = pointer_root(checkpoint)
    directory = Path(checkpoint) if root is None else latest_candidates(root)[0]
    meta = read_checkpoint_meta(directory)
    recorded = meta.get("pretrained")
    lora = checkpoint_lora(meta, merge=merge, checkpoint=str(checkpoint))
    if lora is not None and not merge:
        return write_adapter_folder(state, lora, out, base=recorded)
    source = resolve_source(pretrained, recorded)
    if source is None:
        raise ValueError(
            f"checkpoint {str(checkpoint)!r} has no pretrained folder on record (the run did not start from "
            "model.pretrained): pass --pretrained PATH, a folder with the config.json (and tokenizer) of "
            "this model, so that from_pretrained can build it"
        )
    if lora is not None:
        from merak_core.hf.pretrained import pretrained_model

        model = pretrained_model(source.path)
        if meta.get("adapter_only"):  # [Note: adapter-only checkpoints]: the base from the folder, checked
            state = {**base_state(model, source.path, meta.get("base") or {}, directory), **state}
        state = merge_adapters(state, lora, model)
    check_state_fits(state, source, checkpoint=str(checkpoint))
    return write_hf_folder(state, out, source=source, max_shard_size=max_shard_size)


def _stage_tensors(parts: CheckpointParts, *, keep: bool = True) -> Iterable[tuple[str, torch.Tensor]]:
    """(logical name, full tensor in the file layout) for this stage's parameters (see [Note: export from a run]).

    Collective over the ZeRO-2/3 parameters' meshes (every DP rank of the stage calls it), then, where
    ``keep``, over the EP group (fused experts) and the TP group (one gather per sharded parameter, in
    the same order on every rank); yields where ``keep`` (on every TP rank, the tensors complete
    everywhere). ``keep`` False: the ZeRO gathers alone, nothing yielded (a DP rank whose copy is not
    written still takes part in them).
    """
    pm = parts.model
    layout = pm.layout
    from merak_core.parallel.expert_hf import full_expert_tensor
    from merak_core.parallel.zero_tensors import full_local_tensor
    from merak_tp.shard_spec import get_shard_spec

    seen: set[int] = set()
    for name, p in pm.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if pm.shared_owner.get(p, layout.pp_rank) != layout.pp_rank:
            continue  # a tied copy: the first stage that holds it writes it
        tensor = full_local_tensor(p.detach())  # ZeRO-2/3: gathered over its DP or expert-replica mesh
        if not keep:
            continue
        tensor = full_expert_tensor(p, tensor)  # fused experts: gathered over EP (expert_hf)
        spec = get_shard_spec(p)
        if layout.tp > 1 and spec.sharded:
            tensor = spec.gather(tensor, layout.tp_group)
        if spec.transposed:
            tensor = tensor.t()
        yield name, tensor.cpu().contiguous()


def _gather_and_write(
    names: list[str],
    owners: dict[str, tuple[int, tuple[int, ...], torch.dtype]],
    tensors: dict[str, torch.Tensor],
    path: Path,
    *,
    device: torch.device,
) -> None:
    """Rank 0 writes one file of ``names``; each other stage's writer sends it its tensors, in file order."""
    import torch.distributed as dist

    rank = dist.get_rank()
    if rank != 0:
        for name in names:
            if owners[name][0] == rank:
                dist.send(tensors[name].to(device), dst=0)  # device tensors: NCCL moves no CPU tensor
        return
    shard = {}
    for name in names:
        owner, shape, dtype = owners[name]
        if owner == 0:
            shard[name] = tensors[name]
        else:
            buffer = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(buffer, src=owner)
            shard[name] = buffer.cpu()
    _save_shard(shard, path)


def export_hf(
    parts: CheckpointParts,
    out: str | os.PathLike[str],
    *,
    pretrained: str | os.PathLike[str] | PretrainedFolder | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Export a live run as a Hugging Face folder (collective over the world; see [Note: export from a run]).

    ``parts``: the run's :class:`CheckpointParts` (``trainer.checkpoint_parts``). ``pretrained``: the
    folder whose config and tokenizer files to copy (default: the one the run started from). Returns ``out`` on every rank once the folder is complete.
    """
    import torch.distributed as dist

    source = resolve_source(pretrained, parts.pretrained)
    if source is None:
        raise ValueError(
            "export_hf needs the config.json of the model: the run did not start from "
            "model.pretrained, so pass pretrained=PATH (a folder with config.json)"
        )
    max_bytes = parse_size(max_shard_size)
    check_out_dir(out, what="the export folder")
    layout = parts.layout
    out_dir = Path(out)
    if dist.get_rank() == 0:
        prepare_out_dir(out_dir)
    dist.barrier()
    # Experts are sharded over the first EP group's DP ranks (merak_core.parallel.expert_parallel); dense tensors: DP rank 0's.
    # Under ZeRO-2/3 every DP rank takes part in the gathers of the stage's sharded parameters.
    tensors = dict(_stage_tensors(parts, keep=layout.dp_rank < layout.ep))
    if layout.tp_rank != 0:
        tensors = {}  # the stage's tensors are sent from its DP rank 0, TP rank 0 alone
    mine = {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()}
    plan: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(plan, (dist.get_rank(), mine) if tensors else None)
    owners: dict[str, tuple[int, tuple[int, ...], torch.dtype]] = {}
    for entry in plan:
        if entry is not None:
            for name, (shape, dtype) in entry[1].items():
                owners.setdefault(name, (entry[0], shape, dtype))
    sizes = {n: math.prod(shape) * dtype.itemsize for n, (_, shape, dtype) in owners.items()}
    groups = shard_groups(sizes, max_bytes)
    weight_map: dict[str, str] = {}
    for index, names in enumerate(groups):
        file_name = _shard_name(index, len(groups))
        weight_map.update(dict.fromkeys(names, file_name))
        _gather_and_write(names, owners, tensors, out_dir / file_name, device=parts.device)
    del tensors
    dist.barrier()
    if dist.get_rank() == 0:
        dtypes = [dtype for _, _, dtype in owners.values()]
        write_metadata(
            out_dir, weight_map, sum(sizes.values()), source=source, dtype=dtypes[0] if dtypes else None
        )
        logger.info("exported %d tensors in %d files to %s", len(weight_map), len(groups), out_dir)
    dist.barrier()
    return out_dir
