"""LoRA: low-rank adapters on a frozen base model, at any 3D layout.

Owns the LoRA configuration (:mod:`~merak_core.lora.config`), the adapter layer that wraps a
linear of any kind — ``nn.Linear``, transformers' ``Conv1D``, merak-tp's column- and row-parallel
linears — (:mod:`~merak_core.lora.layer`), finding the target modules and wrapping them
(:mod:`~merak_core.lora.apply`), and the adapters' initial values (:mod:`~merak_core.lora.init`).
The PEFT adapter folder (in and out) lives in :mod:`merak_core.hf.adapters`.

May import torch, merak_tp and merak_core.config; never the composition, the engine or the
Trainer (they import this package).
"""

from merak_core.lora.config import LoraConfig, check_lora_arguments

__all__ = ["LoraConfig", "check_lora_arguments"]
