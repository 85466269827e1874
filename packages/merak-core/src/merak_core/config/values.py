"""The configuration's vocabulary: allowed values, and reading values from text (YAML, sizes, recompute).

See :mod:`merak_core.config` for the fields; this module holds what reading them needs and
nothing that knows :class:`~merak_core.config.TrainingArguments`.
"""

from __future__ import annotations

import math
import os
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

LR_SCHEDULER_TYPES = ("constant", "linear", "cosine")
NONFINITE_POLICIES = ("stop", "skip")
LABEL_CONVENTIONS = ("shifted", "unshifted")
"""``training.labels`` (the job file's ``data.labels``): how a batch's labels line up with its inputs."""
DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
MAX_SEED = 2**32 - 1
"""The largest ``seed``: seeds are offset per epoch and per TP rank and must stay valid for every generator."""
LAYOUTS = ("manual", "auto")
"""``training.layout``: the job's degrees, or the planner's choice at start-up."""
KEY_ALIASES = {
    "num_microbatches": "gradient_accumulation_steps",
    "micro_batch_size": "per_device_train_batch_size",
}
"""Merak names accepted in YAML and overrides for the Hugging Face field they map to."""

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_recompute(spec: str) -> tuple[str, float | None]:
    """``"none" | "full" | "uniform:<f>" | "stage_aware"`` -> ``(kind, fraction)``.

    ``fraction`` is the share of layers recomputed per stage for ``uniform`` (0 < f <= 1),
    1.0 for ``full``, 0.0 for ``none`` and None for ``stage_aware`` (chosen per stage).
    """
    if not isinstance(spec, str):
        raise ValueError(
            f"recompute must be a string, got {spec!r}: use 'none', 'full', 'uniform:0.5' or 'stage_aware'"
        )
    text = spec.strip().lower()
    if text == "none":
        return "none", 0.0
    if text == "full":
        return "full", 1.0
    if text == "stage_aware":
        return "stage_aware", None
    if text.startswith("uniform:"):
        try:
            fraction = float(text.split(":", 1)[1])
        except ValueError:
            fraction = math.nan
        if not 0.0 < fraction <= 1.0:
            raise ValueError(
                f"recompute={spec!r}: the uniform fraction must be a number in (0, 1], e.g. 'uniform:0.5'"
            )
        return "uniform", fraction
    raise ValueError(f"recompute={spec!r} is not one of 'none', 'full', 'uniform:<fraction>', 'stage_aware'")


def schedule_choices() -> tuple[str, ...]:
    """``training.schedule`` values: ``auto`` and the key of every schedule merak-pipe has registered."""
    from merak_pipe import schedule_infos

    return ("auto", *(info.key for info in schedule_infos()))


def schedule_key(value: Any) -> Any:
    """The stored spelling of a schedule (its registry key, see [Note: schedule spellings] in
    ``merak_pipe.schedules.registry``); anything the registry does not know comes back as given."""
    if not isinstance(value, str):
        return value
    text = value.strip().lower()
    if text == "auto":
        return text
    from merak_pipe import schedule_info

    try:
        return schedule_info(text).key
    except ValueError:
        return text


def split_override(item: str, form: str) -> tuple[str, str]:
    """``"key=value"`` (or ``"--key=value"``) -> ``("key", "value")``; ValueError saying the ``form`` otherwise."""
    text = item[2:] if item.startswith("--") else item
    if "=" not in text:
        raise ValueError(f"override {item!r} is not {form}")
    key, _, raw = text.partition("=")
    return key.strip(), raw


def parse_bytes(value: int | str) -> int:
    """``12884901888``, ``"12GiB"``, ``"500 MB"`` -> bytes (binary units KiB..TiB, decimal KB..TB)."""
    if isinstance(value, bool):
        raise ValueError(f"memory size must be bytes or a string like '12GiB', got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"memory size must be positive, got {value}")
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read memory size {value!r}: write bytes or e.g. '12GiB', '500MB'")
    size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if size <= 0:
        raise ValueError(f"memory size must be positive, got {value!r}")
    return size


def _yaml() -> Any:
    try:
        import yaml
    except ImportError as err:  # pragma: no cover - pyyaml is a dependency of merak-core
        raise ImportError("reading/writing YAML configs needs PyYAML: pip install pyyaml") from err
    return yaml


def read_utf8(path: str | os.PathLike[str], what: str) -> str:
    """The text of a UTF-8 file; other bytes are a ``ValueError`` naming ``what``, the file, the line and the column."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(not_utf8_message(what, path, data, exc)) from None


def not_utf8_message(
    what: str, path: str | os.PathLike[str], data: bytes, exc: UnicodeDecodeError, line: int = 1
) -> str:
    """What :func:`read_utf8` says of bytes ``data`` (line ``line`` onwards of ``path``) that are not UTF-8."""
    line += data.count(b"\n", 0, exc.start)
    column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
    return (
        f"{what} {str(path)!r} line {line}, column {column}: byte 0x{data[exc.start]:02x} is not UTF-8 "
        f"({exc.reason}); save the file as UTF-8"
    )


def load_yaml(text: str, source: str) -> Any:
    """Parse a YAML job or config file; a duplicate key or a syntax error is a ``ValueError`` naming the line.

    YAML itself keeps the last of two equal keys of a mapping without a word, so a
    ``learning_rate`` given twice would silently lose one value; here it is an error.
    """
    yaml = _yaml()

    class StrictLoader(yaml.SafeLoader):  # type: ignore[misc, name-defined]
        pass

    def construct_mapping(loader: Any, node: Any, deep: bool = False) -> Any:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = loader.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: the normal constructor reports it
                continue
            seen.setdefault(key, line)
            if first is not None:
                raise ValueError(
                    f"{source}: line {line}: key {key!r} appears twice in one mapping (first at line "
                    f"{first}); YAML would keep only the last value, so remove one of them"
                )
        return loader.construct_mapping(node, deep=deep)

    StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    try:
        return yaml.load(text, Loader=StrictLoader)
    except yaml.YAMLError as exc:
        text = " ".join(str(exc).replace('in "<unicode string>", ', "").split())
        raise ValueError(f"{source}: not valid YAML: {text}") from None


def _members(annotation: Any) -> tuple[Any, ...]:
    origin = typing.get_origin(annotation)
    return typing.get_args(annotation) if origin in (typing.Union, types.UnionType) else (annotation,)


def _coerce(name: str, value: Any, annotation: Any, *, source: str) -> Any:
    """Check ``value`` against the field type; convert where the text form is unambiguous."""
    members = _members(annotation)
    optional = type(None) in members
    if value is None and optional:
        return None
    if (
        optional
        and str not in members
        and isinstance(value, str)
        and value.strip().lower() in ("none", "null")
    ):
        return None
    for member in members:
        converted = _convert(value, member)
        if converted is not _NO:
            return converted
    expected = " or ".join(_type_name(m) for m in members)
    got = "null" if value is None else type(value).__name__
    raise ValueError(f"{source}: {name}={value!r} has the wrong type: expected {expected}, got {got}")


_NO = object()


def _convert(value: Any, member: Any) -> Any:
    if member is type(None):
        return _NO
    if member is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        return _NO
    if member is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and re.fullmatch(r"[+-]?\d+", value.strip()):
            return int(value)
        return _NO
    if member is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                return _NO
        return _NO
    if member is str:
        return value if isinstance(value, str) else _NO
    if typing.get_origin(member) is dict:
        return dict(value) if isinstance(value, Mapping) else _NO
    if typing.get_origin(member) is list:
        return list(value) if isinstance(value, (list, tuple)) else _NO
    return value if isinstance(value, member) else _NO


def _type_name(member: Any) -> str:
    if member is type(None):
        return "null"
    if typing.get_origin(member) is dict:
        return "a mapping"
    if typing.get_origin(member) is list:
        return "a list"
    return getattr(member, "__name__", str(member))
