"""The launch checks of a text ``data:`` section: cheap, in the launching process, before torchrun starts.

Each failure is a ``ValueError`` naming ``data.<key>``, the value and the fix:

- ``data.path`` exists (a file; a folder for ``hf_dataset``);
- the optional reader is installed (``pyarrow`` for parquet, ``datasets`` for ``hf_dataset``);
- ``data.tokenizer`` loads (and names its end-of-sequence token when ``data.eos_token`` is given);
- the first record has ``data.text_field`` (or the prompt/response fields) and holds text.

``seq_len`` and the other values are checked when the job file is read (:class:`TextDataSpec`).
"""

from __future__ import annotations

import importlib.util
import os

from merak_core.data.text.readers import first_record
from merak_core.data.text.spec import TextDataSpec
from merak_core.data.text.tokenizer import load_tokenizer

_EXTRAS = {"parquet": ("pyarrow", "parquet"), "hf_dataset": ("datasets", "datasets")}


def check_text_data(spec: TextDataSpec) -> str:
    """Check ``spec`` as described in the module docstring; returns what was checked, for the launch log."""
    if spec.format == "hf_dataset":
        if not os.path.isdir(spec.path):
            raise ValueError(
                f"data.path={spec.path!r} is not a folder: format hf_dataset reads a dataset saved "
                "with save_to_disk; point data.path at that folder"
            )
    elif not os.path.isfile(spec.path):
        raise ValueError(
            f"data.path={spec.path!r} does not exist (or is not a file); point data.path at the "
            f"{spec.format} file (relative paths are taken from the job file's folder)"
        )
    module, extra = _EXTRAS.get(spec.format, (None, None))
    if module is not None and importlib.util.find_spec(module) is None:
        raise ValueError(f"data.format={spec.format!r} needs {module}: pip install 'merak-core[{extra}]'")
    tokenizer = load_tokenizer(spec.tokenizer, eos_token=spec.eos_token)
    first_record(spec)
    return (
        f"text data {spec.format} {spec.path!r} (first record read), tokenizer {spec.tokenizer!r} "
        f"(vocabulary {tokenizer.vocab_size})"
    )


__all__ = ["check_text_data"]
