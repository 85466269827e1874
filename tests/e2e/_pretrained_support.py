"""Shared pieces of the pretrained / export tests: tiny Hugging Face folders, a tokenizer, text, blocks.

Everything is made in the test (no download): a GPT-2 or Llama saved with ``save_pretrained`` in
float64, a BPE tokenizer trained with the ``tokenizers`` package on text written here,
and the token stream cut into fixed blocks of ``SEQ + 1`` tokens (next-token labels).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from tests.support.hf_models import tiny_decoder_fields, tiny_gpt2_config

VOCAB = 96
SEQ = 8
WORDS = (
    "merak",
    "pipeline",
    "tensor",
    "stage",
    "shard",
    "token",
    "model",
    "train",
    "slice",
    "export",
    "the",
    "a",
    "of",
    "and",
    "to",
    "in",
    "every",
    "rank",
    "reads",
    "its",
    "own",
)


def write_text(path: str | os.PathLike[str], *, lines: int = 120, seed: int = 0) -> Path:
    """Deterministic pseudo-sentences from a small word list, one per line."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(lines):
        idx = torch.randint(0, len(WORDS), (int(torch.randint(4, 10, (1,), generator=g)),), generator=g)
        rows.append(" ".join(WORDS[int(i)] for i in idx) + ".")
    out = Path(path)
    out.write_text("\n".join(rows) + "\n")
    return out


def build_tokenizer(text_path: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> Any:
    """A BPE tokenizer (whitespace pre-split) with at most ``VOCAB`` tokens, saved as ``out_dir/tokenizer.json``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train(
        [str(text_path)], trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>"], show_progress=False)
    )
    assert tok.get_vocab_size() <= VOCAB, tok.get_vocab_size()
    tok.save(str(Path(out_dir) / "tokenizer.json"))
    return tok


def token_stream(text_path: str | os.PathLike[str], tokenizer_json: str | os.PathLike[str]) -> torch.Tensor:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    return torch.tensor(tok.encode(Path(text_path).read_text()).ids, dtype=torch.long)


class Blocks(Dataset):
    """Consecutive blocks of ``SEQ + 1`` tokens of a stream: input ids, a full attention mask, next-token labels.

    The mask matters for a model built on the meta device at pp > 1: without one, transformers checks
    the position ids for packed sequences, which reads values the meta tensors of the trace do not have.
    """

    def __init__(self, ids: torch.Tensor, *, start: int = 0, count: int | None = None) -> None:
        n = (len(ids) - 1) // SEQ
        blocks = [ids[i * SEQ : i * SEQ + SEQ + 1] for i in range(n)]
        self.blocks = blocks[start : None if count is None else start + count]

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        block = self.blocks[i]
        return {
            "input_ids": block[:-1].clone(),
            "attention_mask": torch.ones(SEQ, dtype=torch.long),
            "labels": block[1:].clone(),
        }


def save_tiny_model(name: str, out_dir: str | os.PathLike[str], *, max_shard_size: str | None = None) -> Path:
    """A tiny float64 GPT-2 (tied embeddings, Conv1D, fused q/k/v) or Llama (GQA, untied) via save_pretrained."""
    import transformers as tf

    torch.manual_seed(0)
    if name == "gpt2":
        cfg = tiny_gpt2_config(VOCAB, use_cache=False, bos_token_id=0, eos_token_id=0)
        model = tf.GPT2LMHeadModel(cfg)
    elif name == "llama":
        tokens = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
        cfg = tf.LlamaConfig(**tiny_decoder_fields(VOCAB, use_cache=False, **tokens))
        model = tf.LlamaForCausalLM(cfg)
    else:
        raise ValueError(f"unknown model {name!r}")
    out = Path(out_dir)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.double().save_pretrained(str(out), **kwargs)
    return out


def make_folder(name: str, root: str | os.PathLike[str], **kwargs: Any) -> tuple[Path, Path]:
    """(model folder with tokenizer.json, text file) under ``root``."""
    root = Path(root)
    folder = save_tiny_model(name, root / name, **kwargs)
    text = write_text(root / "train.txt")
    build_tokenizer(text, folder)
    return folder, text


def read_folder(folder: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face folder (single file or index), by name."""
    from merak_core.hf import PretrainedFolder

    f = PretrainedFolder(folder)
    with f.reader() as reader:
        return {name: reader.get_slice(name)[:] for name in f.tensor_names}


def lm_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    logits = getattr(output, "logits", output)
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100
    )
