"""Records out of text, JSON Lines, Parquet and saved Hugging Face datasets.

A record is a string (plain text) or, for supervised fine-tuning, a ``(prompt, response)``
pair. :func:`iter_records` yields them in file order; :func:`first_record` reads only as far
as the first one (the launch checks); :func:`content_hash` is the SHA-256 of the bytes the
records come from (every file of an ``hf_dataset`` folder, by relative path).

Parquet needs ``pyarrow`` (``pip install 'merak-core[parquet]'``), ``hf_dataset`` needs
``datasets`` (``pip install 'merak-core[datasets]'``); without them the error says so.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from merak_core.config.values import not_utf8_message
from merak_core.data.text.spec import TextDataSpec

Record = str | tuple[str, str]

_CHUNK = 1 << 20


def content_hash(path: str) -> str:
    """SHA-256 of a file's bytes, or of every file under a folder (relative paths and bytes, sorted)."""
    digest = hashlib.sha256()
    root = Path(path)
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    for file in files:
        if root.is_dir():
            digest.update(str(file.relative_to(root)).encode() + b"\0")
        with open(file, "rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def iter_records(spec: TextDataSpec) -> Iterator[Record]:
    """Every record of the data, in order."""
    if spec.format == "text":
        yield from _text_records(spec.path, spec.sample_by)
    elif spec.format == "jsonl":
        for where, row in _jsonl_rows(spec.path):
            yield _record(spec, row, where)
    elif spec.format == "parquet":
        for where, row in _parquet_rows(spec.path, spec.fields):
            yield _record(spec, row, where)
    else:
        for where, row in _hf_rows(spec):
            yield _record(spec, row, where)


def first_record(spec: TextDataSpec) -> Record:
    """The first record (raises ``ValueError`` naming the key and the fix when there is none or a field is missing)."""
    for record in iter_records(spec):
        return record
    raise ValueError(
        f"data.path={spec.path!r} holds no records ({spec.format}); point data.path at a non-empty file"
    )


def _not_utf8(path: str) -> ValueError:
    """The first line of ``path`` that is not UTF-8, named with its column and the fix."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                return ValueError(not_utf8_message("data.path", path, raw, exc, line=number))
    return ValueError(f"data.path={path!r} is not UTF-8 text; save the file as UTF-8")


def _text_records(path: str, sample_by: str) -> Iterator[str]:
    try:
        yield from _text_records_utf8(path, sample_by)
    except UnicodeDecodeError:
        raise _not_utf8(path) from None


def _text_records_utf8(path: str, sample_by: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        if sample_by == "document":
            text = f.read()
            if text:
                yield text
            return
        if sample_by == "line":
            for line in f:
                line = line.rstrip("\r\n")
                if line.strip():
                    yield line
            return
        lines: list[str] = []
        for line in f:
            if line.strip():
                lines.append(line.rstrip("\r\n"))
            elif lines:
                yield "\n".join(lines)
                lines = []
        if lines:
            yield "\n".join(lines)


def _jsonl_rows(path: str) -> Iterator[tuple[str, Any]]:
    try:
        yield from _jsonl_rows_utf8(path)
    except UnicodeDecodeError:
        raise _not_utf8(path) from None


def _jsonl_rows_utf8(path: str) -> Iterator[tuple[str, Any]]:
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"data.path={path!r} line {number} is not JSON ({exc.msg}): each line of a jsonl "
                    "file must hold one JSON object"
                ) from None
            yield f"line {number}", row


def _parquet_rows(path: str, fields: tuple[str, ...]) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(
            "data.format='parquet' needs pyarrow: pip install 'merak-core[parquet]' (or pyarrow)"
        ) from None
    parquet = pq.ParquetFile(path)
    names = parquet.schema_arrow.names
    missing = [f for f in fields if f not in names]
    if missing:
        raise ValueError(_missing_field(path, "column", missing[0], names))
    number = 0
    for batch in parquet.iter_batches(columns=list(fields), batch_size=4096):
        for row in batch.to_pylist():
            number += 1
            yield f"row {number}", row


def _hf_rows(spec: TextDataSpec) -> Iterator[tuple[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise ValueError(
            "data.format='hf_dataset' needs the datasets package: pip install 'merak-core[datasets]'"
        ) from None
    loaded = datasets.load_from_disk(spec.path)
    if isinstance(loaded, datasets.DatasetDict):
        if spec.split not in loaded:
            raise ValueError(
                f"data.split={spec.split!r}: the dataset at {spec.path!r} has splits "
                f"{sorted(loaded)}; set data.split to one of them"
            )
        loaded = loaded[spec.split]
    missing = [f for f in spec.fields if f not in loaded.column_names]
    if missing:
        raise ValueError(_missing_field(spec.path, "column", missing[0], loaded.column_names))
    for number, row in enumerate(loaded, 1):
        yield f"row {number}", row


def _record(spec: TextDataSpec, row: Any, where: str) -> Record:
    if not isinstance(row, Mapping):
        raise ValueError(
            f"data.path={spec.path!r} {where} is a {type(row).__name__}, not an object with field "
            f"{spec.fields[0]!r}"
        )
    values = []
    for name in spec.fields:
        if name not in row:
            key = (
                "prompt_field"
                if spec.sft and name == spec.prompt_field
                else ("response_field" if spec.sft else "text_field")
            )
            raise ValueError(
                f"data.{key}={name!r}: {where} of {spec.path!r} has no field {name!r} (it has "
                f"{sorted(row)}); set data.{key} to the field that holds the text"
            )
        value = row[name]
        if not isinstance(value, str):
            raise ValueError(
                f"data.path={spec.path!r} {where}: field {name!r} is a {type(value).__name__}, not text"
            )
        values.append(value)
    return (values[0], values[1]) if spec.sft else values[0]


def _missing_field(path: str, what: str, name: str, names: list[str]) -> str:
    return (
        f"data.text_field (or prompt/response_field)={name!r}: {path!r} has no {what} {name!r} (it has "
        f"{sorted(names)}); set the field to the {what} that holds the text"
    )


def describe_source(spec: TextDataSpec) -> str:
    size = os.path.getsize(spec.path) if os.path.isfile(spec.path) else None
    return f"{spec.format} {spec.path!r}" + (f" ({size:,} bytes)" if size is not None else "")


__all__ = ["Record", "content_hash", "describe_source", "first_record", "iter_records"]
