"""A Hugging Face model folder on disk: ``config.json`` plus safetensors weights, read lazily.

``PretrainedFolder(path)`` checks the folder (it raises ``ValueError`` naming the path and
the fix, with no process group needed, so launchers and preflight call it too) and maps
every tensor name to the safetensors file that holds it: ``model.safetensors``, or the
shards a ``model.safetensors.index.json`` lists. :meth:`PretrainedFolder.reader` opens
files only when one of their tensors is asked for and hands out safetensors slices
(``safe_open(...).get_slice``), so a caller reads only the rows or columns it slices.

Not done here: building the model (``pretrained.py``), placing slices into a sharded
model (``pretrained.py``), writing folders (``export.py``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
COMPANION_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
"""Files a model folder carries besides the weights: copied as they are into an export."""


class PretrainedFolder:
    """A checked Hugging Face model folder (see the module docstring)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path).expanduser()
        if not self.path.is_dir():
            raise ValueError(
                f"model.pretrained: {str(self.path)!r} is not a directory; point it at a folder written by "
                "save_pretrained (config.json plus model.safetensors or model.safetensors.index.json)"
            )
        config_path = self.path / CONFIG_FILE
        if not config_path.is_file():
            raise ValueError(
                f"model.pretrained: {str(self.path)!r} has no {CONFIG_FILE}; save the model with "
                "save_pretrained(...) (or copy its config.json there)"
            )
        try:
            self.config: dict[str, Any] = json.loads(config_path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"model.pretrained: {str(config_path)!r} is not valid JSON ({exc}); "
                "write it again with save_pretrained"
            ) from exc
        self.weight_map = _weight_map(self.path)

    @property
    def tensor_names(self) -> list[str]:
        return sorted(self.weight_map)

    @property
    def files(self) -> list[Path]:
        return sorted({self.path / name for name in self.weight_map.values()})

    def companion_files(self) -> list[Path]:
        """The tokenizer and generation files this folder has (see :data:`COMPANION_FILES`)."""
        return [self.path / name for name in COMPANION_FILES if (self.path / name).is_file()]

    @contextmanager
    def reader(self, *, keep_open: bool = True) -> Iterator[_SliceReader]:
        """A reader of safetensors slices by tensor name; every file it opened is closed on exit.

        [Note: mapped pages] safetensors memory-maps its file, and the pages a read touches stay
        resident (counted in the process's RSS) while the file is mapped. With ``keep_open=False``
        each :meth:`_SliceReader.get_slice` opens the file afresh, so the mapping lives only as long
        as the returned slice: at most one tensor's pages are mapped at a time (for loading;
        ``keep_open=True`` is for reading shapes, where only the headers are touched).
        """
        reader = _SliceReader(self, keep_open=keep_open)
        try:
            yield reader
        finally:
            reader.close()


class _SliceReader:
    """Name -> safetensors ``PySafeSlice`` (memory-mapped; nothing is read until it is indexed)."""

    def __init__(self, folder: PretrainedFolder, *, keep_open: bool) -> None:
        self._folder = folder
        self._keep_open = keep_open
        self._handles: dict[str, Any] = {}

    def get_slice(self, name: str) -> Any:
        file_name = self._folder.weight_map[name]
        handle = self._handles.get(file_name)
        if handle is None:
            from safetensors import safe_open

            handle = safe_open(str(self._folder.path / file_name), framework="pt")
            if self._keep_open:
                self._handles[file_name] = handle
        return handle.get_slice(name)

    def close(self) -> None:
        self._handles.clear()  # safe_open handles unmap their file when released


def _weight_map(folder: Path) -> dict[str, str]:
    """Tensor name -> file name (relative to ``folder``), from the index or the single weights file."""
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text())
            weight_map = dict(index["weight_map"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(
                f"model.pretrained: {str(index_path)!r} is not a safetensors index (a JSON object "
                f"with a 'weight_map'): {exc}; write the folder again with save_pretrained"
            ) from exc
        missing = sorted({f for f in weight_map.values() if not (folder / f).is_file()})
        if missing:
            raise ValueError(
                f"model.pretrained: {str(index_path)!r} lists shard files that are not in the folder: "
                f"{missing[:4]}; copy the complete folder"
            )
        return weight_map
    single = folder / WEIGHTS_FILE
    if single.is_file():
        try:
            from safetensors import safe_open
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "model.pretrained needs the safetensors package: pip install 'merak-core[transformers]'"
            ) from exc
        try:
            with safe_open(str(single), framework="pt") as handle:
                names = list(handle.keys())
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
            raise ValueError(
                f"model.pretrained: {str(single)!r} is not a readable safetensors file "
                f"({type(exc).__name__}: {exc}); write it again with save_pretrained"
            ) from exc
        return {name: WEIGHTS_FILE for name in names}
    found = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".safetensors"))
    hint = (
        f" (it holds {found[:4]}: convert .bin weights with save_pretrained(..., safe_serialization=True))"
        if found
        else ""
    )
    raise ValueError(f"model.pretrained: {str(folder)!r} has neither {WEIGHTS_FILE} nor {INDEX_FILE}{hint}")
