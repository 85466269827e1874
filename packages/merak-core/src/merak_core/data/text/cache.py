"""The token cache: every record tokenized once, into memory-mapped files shared by the ranks.

[Note: token cache] The cache of a data source is the folder ``<cache_dir>/<key>``, where
``key`` hashes the data's bytes (:func:`merak_core.data.text.readers.content_hash`), the
tokenizer's files and end-of-sequence choice, and the record settings (format, fields,
``sample_by``, ``add_eos``, ``split``). Any change to the file or the tokenizer gives a new key
and so a new cache; ``seq_len``, ``packing`` and ``eval_fraction`` are applied when reading, so
changing them reuses the cache. The folder holds

- ``tokens.bin``: every record's ids, concatenated (``uint16`` when the vocabulary fits, else ``uint32``);
- ``offsets.npy``: ``int64[records + 1]``, where each record starts in ``tokens.bin``;
- ``loss_mask.bin`` (prompt/response data only): ``uint8``, 1 on the tokens the loss counts;
- ``meta.json``, written last: the counts, ids and the key.

It is built in ``<key>.tmp-<pid>`` and renamed into place, so a folder named ``<key>`` is
always complete. One process per node builds it: local rank 0 (``LOCAL_RANK``, 0 outside
torchrun), holding ``<key>.lock`` (``fcntl.flock``), so that nodes sharing a file system
build it once; the other local ranks wait for the folder, up to ``data.cache_timeout_s``.
Nothing here needs the process group, so it runs before ``init_process_group`` (and in
``merak train``'s launch checks, which then leave the ranks nothing to do). A build that
fails leaves ``<key>.failed`` naming this torchrun run, so the waiting ranks stop at once
with the builder's error instead of waiting for the timeout.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from merak_core.data.text.readers import content_hash, iter_records
from merak_core.data.text.spec import TextDataSpec
from merak_core.data.text.tokenizer import LoadedTokenizer

logger = logging.getLogger(__name__)

CACHE_FORMAT = 1
_ENCODE_CHUNK = 1024
_POLL_S = 0.2


class TokenCacheError(RuntimeError):
    """The token cache could not be built or did not appear in time (the message says which and why)."""


@dataclass
class TokenCache:
    """A complete cache folder, memory-mapped."""

    path: Path
    built: bool
    """True when this process tokenized the data (False: an existing cache was reused)."""

    def __post_init__(self) -> None:
        self._open()

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (a spawned data-loader worker) as the folder, not the mapped arrays."""
        return {"path": self.path, "built": self.built}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path, self.built = state["path"], state["built"]
        self._open()

    def _open(self) -> None:
        self.meta: dict[str, Any] = json.loads((self.path / "meta.json").read_text())
        dtype = np.dtype(self.meta["dtype"])
        n = int(self.meta["num_tokens"])
        self.tokens = (
            np.memmap(self.path / "tokens.bin", dtype=dtype, mode="r", shape=(n,))
            if n
            else np.zeros(0, dtype=dtype)
        )
        self.offsets = np.load(self.path / "offsets.npy", mmap_mode="r")
        self.loss_mask = (
            np.memmap(self.path / "loss_mask.bin", dtype=np.uint8, mode="r", shape=(n,))
            if self.meta["sft"] and n
            else None
        )

    @property
    def key(self) -> str:
        return str(self.meta["key"])

    @property
    def num_records(self) -> int:
        return int(self.meta["num_records"])


def cache_key(spec: TextDataSpec, tokenizer: LoadedTokenizer) -> str:
    """The cache folder name of ``spec`` tokenized by ``tokenizer`` (see [Note: token cache])."""
    parts = {
        "cache_format": CACHE_FORMAT,
        "data": content_hash(spec.path),
        "tokenizer": tokenizer.fingerprint,
        "format": spec.format,
        "fields": list(spec.fields),
        "sample_by": spec.sample_by,
        "add_eos": spec.add_eos,
        "split": spec.split if spec.format == "hf_dataset" else None,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0") or 0)


def _run_tag() -> str:
    return f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}:{os.environ.get('TORCHELASTIC_RESTART_COUNT', '')}"


def ensure_cache(
    spec: TextDataSpec, tokenizer: LoadedTokenizer, *, local_rank: int | None = None
) -> TokenCache:
    """The cache of ``spec``: reused when complete, else built (local rank 0) or waited for (the others)."""
    root = Path(spec.resolved_cache_dir())
    key = cache_key(spec, tokenizer)
    final = root / key
    if (final / "meta.json").is_file():
        return TokenCache(final, built=False)
    rank = _local_rank() if local_rank is None else local_rank
    if rank != 0:
        return _wait_for(final, spec, rank)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TokenCacheError(
            f"data.cache_dir={str(root)!r} cannot be created ({exc.strerror}); set data.cache_dir "
            "to a writable folder"
        ) from None
    with _flock(root / f"{key}.lock", spec.cache_timeout_s, final):
        if (final / "meta.json").is_file():  # another node sharing the folder built it meanwhile
            return TokenCache(final, built=False)
        failed = root / f"{key}.failed"
        failed.unlink(missing_ok=True)
        try:
            _build(final, key, spec, tokenizer)
        except BaseException as exc:
            failed.write_text(json.dumps({"run": _run_tag(), "error": f"{type(exc).__name__}: {exc}"}))
            raise
    return TokenCache(final, built=True)


class _flock:
    """An exclusive ``fcntl.flock`` on ``path``, waited for up to ``timeout_s``."""

    def __init__(self, path: Path, timeout_s: float, final: Path) -> None:
        self.path, self.timeout_s, self.final = path, timeout_s, final
        self.fd = -1

    def __enter__(self) -> _flock:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if (self.final / "meta.json").is_file() or time.monotonic() > deadline:
                    if (self.final / "meta.json").is_file():
                        return self
                    os.close(self.fd)
                    raise TokenCacheError(
                        f"another process has held the token cache lock {str(self.path)!r} for more than "
                        f"data.cache_timeout_s={self.timeout_s:g} s without finishing {str(self.final)!r}: it "
                        "may still be tokenizing (raise data.cache_timeout_s) or hang (stop it)"
                    ) from None
                time.sleep(_POLL_S)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _wait_for(final: Path, spec: TextDataSpec, rank: int) -> TokenCache:
    """A local rank other than 0: wait for local rank 0's cache (see [Note: token cache])."""
    failed = final.parent / f"{final.name}.failed"
    tag = _run_tag()
    start = time.monotonic()
    while time.monotonic() - start < spec.cache_timeout_s:
        if (final / "meta.json").is_file():
            return TokenCache(final, built=False)
        if failed.is_file():
            try:
                info = json.loads(failed.read_text())
            except (OSError, json.JSONDecodeError):
                info = {}
            if info.get("run") == tag:
                raise TokenCacheError(
                    f"local rank {rank}: local rank 0 failed to build the token cache "
                    f"{str(final)!r}: {info.get('error')}"
                )
        time.sleep(_POLL_S)
    raise TokenCacheError(
        f"local rank {rank} waited data.cache_timeout_s={spec.cache_timeout_s:g} s for the token cache "
        f"{str(final)!r}, which local rank 0 of this node builds, and it did not appear: see local rank 0's log for "
        "its error, or raise data.cache_timeout_s when tokenizing takes longer"
    )


def _encoded(spec: TextDataSpec, tokenizer: LoadedTokenizer) -> Iterator[tuple[list[int], int]]:
    """``(ids, prompt_length)`` of every record; the prompt length is 0 for plain text."""
    eos = [tokenizer.eos_id] if spec.add_eos and tokenizer.eos_id is not None else []
    chunk: list[Any] = []

    def flush() -> Iterator[tuple[list[int], int]]:
        if spec.sft:
            prompts = tokenizer.encode([r[0] for r in chunk], special=True)
            responses = tokenizer.encode([r[1] for r in chunk], special=False)
            for p, r in zip(prompts, responses, strict=True):
                yield p + r + eos, len(p)
        else:
            for ids in tokenizer.encode(chunk, special=True):
                yield (ids + eos if not eos or not ids or ids[-1] != eos[0] else ids), 0

    for record in iter_records(spec):
        chunk.append(record)
        if len(chunk) == _ENCODE_CHUNK:
            yield from flush()
            chunk = []
    if chunk:
        yield from flush()


def _build(final: Path, key: str, spec: TextDataSpec, tokenizer: LoadedTokenizer) -> None:
    start = time.perf_counter()
    if spec.add_eos and tokenizer.eos_id is None:
        logger.warning(
            "data: the tokenizer %r names no end-of-sequence token, so records are joined without a "
            "separator; set data.eos_token (or data.add_eos: false to silence this)",
            spec.tokenizer,
        )
    dtype = np.uint16 if tokenizer.vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32
    tmp = final.parent / f"{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        meta = _write(tmp, key, spec, tokenizer, dtype, start)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    os.replace(tmp, final)
    logger.info(
        "data: tokenized %d records of %r into %d tokens in %.1f s (cache %s)",
        meta["num_records"],
        spec.path,
        meta["num_tokens"],
        meta["build_s"],
        final,
    )


def _write(
    tmp: Path, key: str, spec: TextDataSpec, tokenizer: LoadedTokenizer, dtype: Any, start: float
) -> dict[str, Any]:
    offsets = array("q", [0])
    with open(tmp / "tokens.bin", "wb") as tokens, open(tmp / "loss_mask.bin", "wb") as mask:
        for ids, prompt_len in _encoded(spec, tokenizer):
            tokens.write(np.asarray(ids, dtype=dtype).tobytes())
            if spec.sft:
                counted = np.ones(len(ids), dtype=np.uint8)
                counted[:prompt_len] = 0
                mask.write(counted.tobytes())
            offsets.append(offsets[-1] + len(ids))
    if not spec.sft:
        (tmp / "loss_mask.bin").unlink()
    np.save(tmp / "offsets.npy", np.frombuffer(offsets, dtype=np.int64))
    meta = {
        "cache_format": CACHE_FORMAT,
        "key": key,
        "dtype": np.dtype(dtype).name,
        "num_tokens": offsets[-1],
        "num_records": len(offsets) - 1,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "pad_id": tokenizer.pad_id,
        "sft": spec.sft,
        "source": spec.path,
        "tokenizer": spec.tokenizer,
        "build_s": round(time.perf_counter() - start, 3),
    }
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


__all__ = ["CACHE_FORMAT", "TokenCache", "TokenCacheError", "cache_key", "ensure_cache"]
