"""Hugging Face folders in and out: ``model: {pretrained: PATH}`` loading and ``merak export --to-hf``.

- :func:`pretrained_model` builds a folder's model on the meta device from its ``config.json``;
  :class:`PretrainedWeights` matches it to the folder's tensors and loads each rank's TP slices
  of its own stage (``pretrained.py``).
- :func:`export_hf` (a live run, collective) and :func:`export_checkpoint` (a checkpoint, one
  process) write sharded safetensors with an index, ``config.json`` and the tokenizer and
  generation files of the pretrained folder (``export.py``).

May import ``merak_core.checkpoint`` (a live run is handed over as its ``CheckpointParts``, a
checkpoint is read by its reader), ``lora``, ``parallel``, ``config`` and ``data``; never ``run``, the
planners or the Trainer.
"""

from merak_core.hf.export import export_checkpoint, export_hf, write_hf_folder
from merak_core.hf.folder import PretrainedFolder
from merak_core.hf.pretrained import PretrainedWeights, pretrained_model, read_local_shard, skip_init

__all__ = [
    "PretrainedFolder",
    "PretrainedWeights",
    "export_checkpoint",
    "export_hf",
    "pretrained_model",
    "read_local_shard",
    "skip_init",
    "write_hf_folder",
]
