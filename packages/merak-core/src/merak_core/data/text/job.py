"""Text data in a job file: a ``data:`` section with ``format:`` instead of ``factory:``.

The section becomes the built-in data factory :func:`text_datasets` with the section's keys
(paths resolved against the job file's folder) as its keyword arguments, so every place that
builds a job's datasets (``merak train``'s launch checks, the ranks, ``merak plan``, ``merak
eval``) reads text data the same way. Overrides reach it as ``data.<key>=value``
(``data.seq_len=256``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from merak_core.data.text.spec import TextDataSpec

FACTORY = "merak_core.data.text.job:text_datasets"
"""The import spec of the built-in text data factory."""


def is_text_section(section: Any) -> bool:
    """Whether a job file's ``data:`` section describes text (it has ``format:``) rather than a factory."""
    return isinstance(section, Mapping) and "format" in section


def text_factory_kwargs(section: Mapping[str, Any], *, base_dir: str | Path, source: str) -> dict[str, Any]:
    """The keyword arguments of :func:`text_datasets` for ``section`` (validated; ``ValueError`` names the key)."""
    if "factory" in section:
        raise ValueError(f"{source}: data has both 'format' (text data) and 'factory': keep one of them")
    return dataclasses.asdict(TextDataSpec.from_mapping(section, base_dir=base_dir, source=source))


def text_datasets(**fields: Any) -> tuple[Any, Any]:
    """The job's ``(train, eval)`` text datasets (eval is None without ``eval_fraction``).

    Checks the data first (:func:`merak_core.data.text.checks.check_text_data`), then reads
    the token cache, tokenizing when it is missing (see [Note: token cache]).
    """
    from merak_core.data.text import build_text_datasets
    from merak_core.data.text.checks import check_text_data

    spec = TextDataSpec(**fields)
    check_text_data(spec)
    return build_text_datasets(spec)


def job_text_spec(job: Any) -> TextDataSpec | None:
    """The :class:`TextDataSpec` of a ``JobConfig`` whose data is text (None for a data factory)."""
    data = getattr(job, "data", None)
    if data is None or getattr(data, "spec", None) != FACTORY:
        return None
    return TextDataSpec(**data.kwargs)


__all__ = ["FACTORY", "is_text_section", "job_text_spec", "text_datasets", "text_factory_kwargs"]
