"""A full-size transformers model of any family with a built-in TP plan, for ``merak check``.

``build_model(family)`` builds transformers' default config of the family (Llama 7B,
Mixtral 8x7B, Gemma 3 4B...: the model a user would train). ``merak check`` builds it on the
meta device only, finds it too large to check whole on this machine, and checks the
same family at a tiny config instead. ``build_data`` gives token sequences.
"""

from __future__ import annotations

import torch

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM"),
    "falcon": ("FalconConfig", "FalconForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM"),
    "bert": ("BertConfig", "BertForMaskedLM"),
    "opt": ("OPTConfig", "OPTForCausalLM"),
}


def build_model(family: str = "llama", **config: object) -> torch.nn.Module:
    """transformers' default config of ``family`` (``config`` overrides its fields)."""
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"family={family!r}: expected one of {sorted(FAMILIES)}")
    config_name, model_name = FAMILIES[family]
    cfg = getattr(transformers, config_name)(**config)
    cfg.use_cache = False
    return getattr(transformers, model_name)(cfg)


class Tokens(torch.utils.data.Dataset):
    """Random token ids (from 3: no special tokens) with next-token labels."""

    def __init__(self, size: int = 8, seq: int = 32, vocab: int = 30_000) -> None:
        self.ids = torch.randint(3, vocab, (size, seq + 1), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i, :-1].clone(), "labels": self.ids[i, 1:].clone()}


def build_data(size: int = 8, seq: int = 32) -> Tokens:
    return Tokens(size, seq)
