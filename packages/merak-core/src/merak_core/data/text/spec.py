"""``TextDataSpec``: the ``data:`` section of a job file that points at text (see the package docstring)."""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMATS = ("text", "jsonl", "parquet", "hf_dataset")
SAMPLE_BY = ("line", "paragraph", "document")
DEFAULT_CACHE_TIMEOUT_S = 1800.0


def default_cache_dir() -> str:
    """``$MERAK_CACHE_DIR``, else ``$XDG_CACHE_HOME/merak/textdata``, else ``~/.cache/merak/textdata``."""
    explicit = os.environ.get("MERAK_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "merak", "textdata")


@dataclass(frozen=True, kw_only=True)
class TextDataSpec:
    """Where the text is, how to tokenize it and how to cut it into samples.

    Paths are resolved against the job file's directory by :meth:`from_mapping`.
    """

    format: str
    """``text`` (plain text), ``jsonl`` (one JSON object a line), ``parquet`` (pyarrow) or
    ``hf_dataset`` (a folder written by ``datasets.Dataset.save_to_disk``; the ``datasets`` extra)."""
    path: str
    """The data file (or, for ``hf_dataset``, the saved dataset folder)."""
    tokenizer: str
    """A ``tokenizer.json`` file, or a folder holding one (a Hugging Face tokenizer folder)."""
    seq_len: int
    """Tokens per sample fed to the model (each sample holds ``seq_len + 1`` tokens: inputs and shifted labels)."""
    text_field: str = "text"
    """The field (column) that holds the text, for ``jsonl``, ``parquet`` and ``hf_dataset``."""
    prompt_field: str | None = None
    """With ``response_field``: supervised fine-tuning records; the prompt's tokens get label -100."""
    response_field: str | None = None
    """The field of the response (the only tokens the loss counts, with the end-of-sequence token)."""
    packing: bool = True
    """Concatenate the records into one token stream and cut it into blocks (else one record a sample,
    truncated to ``seq_len + 1`` tokens and padded, the padding labelled -100)."""
    eval_fraction: float = 0.0
    """Share of the samples held out for evaluation: the last ``ceil(eval_fraction * samples)``."""
    sample_by: str = "line"
    """For ``text``: a record is a ``line``, a ``paragraph`` (blank-line separated) or the whole ``document``."""
    add_eos: bool = True
    """Append the tokenizer's end-of-sequence token to every record (when it has one)."""
    eos_token: str | None = None
    """The end-of-sequence token, when the tokenizer folder does not name one (a bare ``tokenizer.json``)."""
    split: str = "train"
    """For ``hf_dataset`` folders holding a ``DatasetDict``: the split to read."""
    cache_dir: str | None = None
    """Where the token cache lives (default: :func:`default_cache_dir`)."""
    cache_timeout_s: float = DEFAULT_CACHE_TIMEOUT_S
    """How long a rank waits for the token cache another process is building."""

    def __post_init__(self) -> None:
        _check(self.format in FORMATS, "format", self.format, f"one of {FORMATS}")
        _check(isinstance(self.path, str) and self.path != "", "path", self.path, "the path of the data file")
        _check(
            isinstance(self.tokenizer, str) and self.tokenizer != "",
            "tokenizer",
            self.tokenizer,
            "a tokenizer.json file or a folder holding one",
        )
        _check(
            isinstance(self.seq_len, int) and not isinstance(self.seq_len, bool) and self.seq_len > 0,
            "seq_len",
            self.seq_len,
            "a positive integer (tokens per sample)",
        )
        _check(
            isinstance(self.eval_fraction, (int, float))
            and not isinstance(self.eval_fraction, bool)
            and 0.0 <= self.eval_fraction < 1.0,
            "eval_fraction",
            self.eval_fraction,
            "a number in [0, 1)",
        )
        _check(self.sample_by in SAMPLE_BY, "sample_by", self.sample_by, f"one of {SAMPLE_BY}")
        for name in ("packing", "add_eos"):
            _check(isinstance(getattr(self, name), bool), name, getattr(self, name), "true or false")
        _check(
            (self.prompt_field is None) == (self.response_field is None),
            "prompt_field",
            self.prompt_field,
            "set together with data.response_field (both or neither)",
        )
        if self.sft:
            _check(
                self.format != "text",
                "format",
                self.format,
                "jsonl, parquet or hf_dataset: prompt/response records need fields",
            )
        _check(
            isinstance(self.cache_timeout_s, (int, float)) and self.cache_timeout_s > 0,
            "cache_timeout_s",
            self.cache_timeout_s,
            "a positive number of seconds",
        )

    @property
    def sft(self) -> bool:
        """Prompt/response records: the loss counts only the response tokens."""
        return self.prompt_field is not None

    @property
    def fields(self) -> tuple[str, ...]:
        """The record fields read (none for plain text)."""
        if self.format == "text":
            return ()
        if self.sft:
            return (str(self.prompt_field), str(self.response_field))
        return (self.text_field,)

    def resolved_cache_dir(self) -> str:
        return self.cache_dir if self.cache_dir is not None else default_cache_dir()

    @classmethod
    def from_mapping(
        cls, section: Mapping[str, Any], *, base_dir: str | Path = ".", source: str = "job"
    ) -> TextDataSpec:
        """The spec of a job file's ``data:`` mapping; relative paths are taken from ``base_dir``.

        Raises ``ValueError`` naming ``data.<key>``, the value and the fix.
        """
        names = [f.name for f in dataclasses.fields(cls)]
        for key in section:
            if key not in names:
                close = difflib.get_close_matches(str(key), names, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(f"{source}: unknown key data.{key}{hint}; text data takes {names}")
        for key in ("format", "path", "tokenizer", "seq_len"):
            if section.get(key) is None:
                raise ValueError(
                    f"{source}: data.{key} is missing; text data needs format, path, tokenizer and "
                    "seq_len (e.g. 'data: {format: jsonl, path: train.jsonl, tokenizer: tok/, "
                    "seq_len: 512}')"
                )
        values = dict(section)
        for key in ("path", "tokenizer", "cache_dir"):
            if isinstance(values.get(key), str):
                values[key] = _resolve(values[key], base_dir)
        try:
            return cls(**values)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None
        except TypeError as exc:
            raise ValueError(f"{source}: data: {exc}") from None


def _resolve(path: str, base_dir: str | Path) -> str:
    expanded = os.path.expanduser(path)
    return expanded if os.path.isabs(expanded) else str(Path(base_dir) / expanded)


def _check(ok: bool, key: str, value: Any, expected: str) -> None:
    if not ok:
        raise ValueError(f"data.{key}={value!r}: expected {expected}")


__all__ = ["FORMATS", "SAMPLE_BY", "TextDataSpec", "default_cache_dir"]
