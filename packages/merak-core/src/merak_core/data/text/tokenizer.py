"""Loading a tokenizer from a ``tokenizer.json`` or a Hugging Face tokenizer folder.

The fast path reads ``tokenizer.json`` with the ``tokenizers`` package (what ``transformers``'
fast tokenizers wrap). A folder without one (a slow tokenizer: ``vocab.json`` + ``merges.txt``,
a SentencePiece model) is loaded with ``transformers.AutoTokenizer`` when it is installed.

The end-of-sequence token is, in order: ``data.eos_token``; the folder's
``tokenizer_config.json`` / ``special_tokens_map.json`` ``eos_token``; none. The padding id
(used only without packing, always with label -100) is the ``pad_token`` when named, else
the end-of-sequence id, else 0.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")


@dataclass
class LoadedTokenizer:
    """A tokenizer with the ids packing needs."""

    backend: Any
    """A ``tokenizers.Tokenizer`` (``fast``) or a ``transformers`` tokenizer."""
    fast: bool
    eos_id: int | None
    pad_id: int
    vocab_size: int
    fingerprint: str
    """SHA-256 over the tokenizer's files and the end-of-sequence choice (part of the cache key)."""

    def encode(self, texts: list[str], *, special: bool) -> list[list[int]]:
        """Token ids of each text (``special``: with the tokenizer's own added tokens, e.g. BOS)."""
        if self.fast:  # encode_batch_fast: no character offsets (tokenizers >= 0.21)
            encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
            return [e.ids for e in encode(texts, add_special_tokens=special)]
        out = self.backend(texts, add_special_tokens=special)["input_ids"]
        return [list(ids) for ids in out]


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(
        p
        for p in path.iterdir()
        if p.is_file()
        and (p.name.startswith("tokenizer") or p.suffix in (".json", ".txt", ".model"))
        and p.name not in ("config.json", "generation_config.json")
    )


def _named_token(folder: Path, name: str) -> str | None:
    for filename in _CONFIG_FILES:
        file = folder / filename
        if not file.is_file():
            continue
        try:
            value = json.loads(file.read_text()).get(name)
        except (json.JSONDecodeError, AttributeError):
            continue
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str) and value:
            return value
    return None


def load_tokenizer(path: str, *, eos_token: str | None = None) -> LoadedTokenizer:
    """The tokenizer at ``path`` (raises ``ValueError`` naming ``data.tokenizer`` and the fix)."""
    p = Path(path)
    if not p.exists():
        raise ValueError(
            f"data.tokenizer={path!r} does not exist; point it at a tokenizer.json file or a "
            "tokenizer folder (save_pretrained)"
        )
    folder = p.parent if p.is_file() else p
    json_file = p if p.is_file() else p / "tokenizer.json"
    fast = json_file.is_file()
    backend: Any
    try:
        if fast:
            from tokenizers import Tokenizer

            backend = Tokenizer.from_file(str(json_file))
        else:
            try:
                from transformers import AutoTokenizer
            except ImportError:
                raise ValueError(
                    f"data.tokenizer={path!r} holds no tokenizer.json, and loading another tokenizer "
                    "needs transformers: pip install 'merak-core[transformers]', or save the "
                    "tokenizer with a tokenizer.json"
                ) from None
            backend = AutoTokenizer.from_pretrained(str(p))
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - any loader failure is a bad tokenizer path for the user
        raise ValueError(
            f"data.tokenizer={path!r} does not load ({type(exc).__name__}: {exc}); point it at a "
            "valid tokenizer.json or tokenizer folder"
        ) from None
    eos = eos_token if eos_token is not None else _named_token(folder, "eos_token")
    pad = _named_token(folder, "pad_token")
    eos_id = _token_id(backend, fast, eos, "eos_token") if eos is not None else None
    pad_id = _token_id(backend, fast, pad, "pad_token") if pad is not None else None
    vocab = backend.get_vocab_size(with_added_tokens=True) if fast else len(backend)
    digest = hashlib.sha256()
    for file in _files(p):
        digest.update(file.name.encode() + b"\0" + file.read_bytes())
    digest.update(f"eos={eos_id}".encode())
    return LoadedTokenizer(
        backend=backend,
        fast=fast,
        eos_id=eos_id,
        pad_id=pad_id if pad_id is not None else (eos_id if eos_id is not None else 0),
        vocab_size=int(vocab),
        fingerprint=digest.hexdigest(),
    )


def _token_id(backend: Any, fast: bool, token: str, key: str) -> int:
    tid = backend.token_to_id(token) if fast else backend.convert_tokens_to_ids(token)
    if tid is None or (
        not fast and tid == getattr(backend, "unk_token_id", None) and token != backend.unk_token
    ):
        raise ValueError(
            f"the {key} {token!r} is not in the vocabulary of the tokenizer; set data.eos_token to a "
            "token the tokenizer has"
        )
    return int(tid)


__all__ = ["LoadedTokenizer", "load_tokenizer"]
