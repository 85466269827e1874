"""Text data for language models, from a job file: read, tokenized once, cut into samples.

::

    data:
      format: jsonl                 # text | jsonl | parquet | hf_dataset
      path: data/train.jsonl        # relative to the job file
      text_field: text              # jsonl / parquet / hf_dataset: the field holding the text
      tokenizer: tokenizer/         # a tokenizer.json, or a folder holding one (save_pretrained)
      seq_len: 512                  # tokens per sample
      packing: true                 # one token stream cut into blocks (false: one record a sample, padded)
      eval_fraction: 0.01           # the last 1% of the samples are the eval set

The keys (:class:`TextDataSpec`; every one but the first four is optional):

=================  ==============================================================================
``format``         ``text`` (one record a line; ``sample_by: paragraph | document``), ``jsonl``,
                   ``parquet`` (needs ``pyarrow``: the ``parquet`` extra) or ``hf_dataset`` (a
                   folder written by ``datasets``' ``save_to_disk``: the ``datasets`` extra)
``path``           the data file or folder
``tokenizer``      ``tokenizer.json`` or a Hugging Face tokenizer folder
``seq_len``        tokens the model sees per sample (a sample holds ``seq_len + 1``: inputs and
                   labels shifted by one, see [Note: samples] in :mod:`.samples`)
``text_field``     default ``text``
``prompt_field``,  supervised fine-tuning: each record is a prompt and a response; the labels of
``response_field`` the prompt's tokens are -100, so the loss counts the response alone
``packing``        default true
``eval_fraction``  default 0 (no eval set); in [0, 1)
``sample_by``      ``text`` format only: ``line`` (default), ``paragraph`` or ``document``
``add_eos``        default true: every record ends in the tokenizer's end-of-sequence token
``eos_token``      the end-of-sequence token when the tokenizer folder names none
``split``          ``hf_dataset`` only: the split of a saved ``DatasetDict`` (default ``train``)
``cache_dir``      default ``$MERAK_CACHE_DIR`` or ``~/.cache/merak/textdata``
``cache_timeout_s`` how long the other local ranks wait for local rank 0's tokenization (1800)
=================  ==============================================================================

Tokenization happens once per data file and tokenizer, by one process per node, into a
memory-mapped cache (see [Note: token cache] in :mod:`.cache`): a second run, or a run with
another ``seq_len``, reads the cache; a changed file or tokenizer builds a new one. Items are
``{"input_ids", "labels"}`` int64 tensors of ``seq_len`` that the default collate stacks and the
trainer splits (labels to the last stage). Data-parallel sharding, the epoch order and the
resume position are those of :class:`merak_core.data.loader.StageAwareDataLoader` over these
map-style datasets.

From Python::

    spec = TextDataSpec(format="text", path="corpus.txt", tokenizer="tok.json", seq_len=128, eval_fraction=0.1)
    train, evaluation = build_text_datasets(spec)
"""

from __future__ import annotations

import logging
import os

from merak_core.data.text.cache import TokenCache, TokenCacheError, cache_key, ensure_cache
from merak_core.data.text.readers import first_record, iter_records
from merak_core.data.text.samples import IGNORE_INDEX, TokenSamples, num_samples, split_samples
from merak_core.data.text.spec import FORMATS, TextDataSpec, default_cache_dir
from merak_core.data.text.tokenizer import LoadedTokenizer, load_tokenizer

logger = logging.getLogger(__name__)


def build_text_datasets(
    spec: TextDataSpec, *, local_rank: int | None = None, source: str = "data"
) -> tuple[TokenSamples, TokenSamples | None]:
    """``(train, eval)`` of ``spec`` (eval is None without ``eval_fraction``); see the module docstring.

    ``local_rank`` (default: ``LOCAL_RANK``, 0 outside torchrun) decides who tokenizes a missing cache.
    """
    tokenizer = load_tokenizer(spec.tokenizer, eos_token=spec.eos_token)
    cache = ensure_cache(spec, tokenizer, local_rank=local_rank)
    train, evaluation = split_samples(
        cache, seq_len=spec.seq_len, packing=spec.packing, eval_fraction=spec.eval_fraction, source=source
    )
    if int(os.environ.get("RANK", "0") or 0) == 0:
        logger.info(
            "data: %s%s from %d records, %d tokens (%s cache %s)",
            train.describe(),
            f", {evaluation.describe()}" if evaluation is not None else "",
            cache.num_records,
            int(cache.meta["num_tokens"]),
            "built" if cache.built else "reused",
            cache.path,
        )
    return train, evaluation


__all__ = [
    "FORMATS",
    "IGNORE_INDEX",
    "LoadedTokenizer",
    "TextDataSpec",
    "TokenCache",
    "TokenCacheError",
    "TokenSamples",
    "build_text_datasets",
    "cache_key",
    "default_cache_dir",
    "ensure_cache",
    "first_record",
    "iter_records",
    "load_tokenizer",
    "num_samples",
    "split_samples",
]
