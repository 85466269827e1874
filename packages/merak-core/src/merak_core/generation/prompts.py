"""Text in and out of decoding: which tokenizer a job's prompts use, left-padded prompt batches, and
the decoded continuations.

Shared by ``merak generate``, the samples a run writes during training (``training.sample_prompts``)
and the lm-evaluation-harness model, so that all three tokenize and detokenize alike.

Not done here: loading a tokenizer (:mod:`merak_core.data.text.tokenizer`), decoding (``decode``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def folder_tokenizer(folder: str | None) -> str | None:
    """``folder`` when it holds tokenizer files (a ``model.pretrained`` folder, an export), else None."""
    if folder is None:
        return None
    return str(folder) if any((Path(folder) / f).is_file() for f in TOKENIZER_FILES) else None


def job_tokenizer(job: Any) -> str | None:
    """The tokenizer of a job's text: its text data's ``data.tokenizer``, else the ``model.pretrained``
    folder's; None when it has neither."""
    from merak_core.data.text.job import job_text_spec

    spec = job_text_spec(job)
    if spec is not None:
        return str(spec.tokenizer)
    return folder_tokenizer(job.model.pretrained)


def encode_prompts(tok: Any, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of ``prompts``, left-padded with ``tok.pad_id`` (a ``LoadedTokenizer``)."""
    ids = tok.encode(prompts, special=True)
    empty = [p for p, row in zip(prompts, ids, strict=True) if not row]
    if empty:
        raise ValueError(f"the prompt {empty[0]!r} has no tokens: every prompt needs at least one")
    width = max(len(row) for row in ids)
    input_ids = torch.full((len(ids), width), tok.pad_id, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for row, tokens in enumerate(ids):
        input_ids[row, width - len(tokens) :] = torch.tensor(tokens)
        mask[row, width - len(tokens) :] = 1
    return input_ids, mask


def decode_continuations(
    tok: Any, sequences: torch.Tensor, width: int, eos: int | None
) -> list[dict[str, Any]]:
    """``{"text", "tokens"}`` of each row's new tokens (after the ``width`` prompt columns, up to its EOS)."""
    out = []
    for row in sequences[:, width:].tolist():
        if eos is not None and eos in row:
            row = row[: row.index(eos)]
        out.append({"text": tok.backend.decode(row, skip_special_tokens=True), "tokens": row})
    return out


__all__ = ["decode_continuations", "encode_prompts", "folder_tokenizer", "job_tokenizer"]
