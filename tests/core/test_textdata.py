"""Text data: readers of every format, the token cache (reuse, invalidation, one builder), packing
boundaries, prompt/response masking, the eval split and DP sharding of the samples."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from merak_core.data.text import (
    IGNORE_INDEX,
    TextDataSpec,
    TokenCacheError,
    TokenSamples,
    build_text_datasets,
    ensure_cache,
    iter_records,
    load_tokenizer,
)
from tests.support.text import EOS, make_tokenizer, sentences, write_jsonl


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer")


def _spec(tmp_path: Path, tok: Path, path: Path, **kw: object) -> TextDataSpec:
    values: dict[str, object] = {
        "format": "text",
        "path": str(path),
        "tokenizer": str(tok),
        "seq_len": 8,
        "cache_dir": str(tmp_path / "cache"),
    }
    values.update(kw)
    return TextDataSpec(**values)  # type: ignore[arg-type]


def _stream(tokenizer_dir: Path, texts: list[str]) -> list[int]:
    """The reference token stream: each record encoded by the tokenizer alone, then the end-of-sequence id."""
    loaded = load_tokenizer(str(tokenizer_dir))
    out: list[int] = []
    for ids in loaded.encode(texts, special=True):
        out += ids + [loaded.eos_id]  # type: ignore[list-item]
    return out


# ---------------------------------------------------------------------------- readers


def test_readers_of_every_format_give_the_same_records(tmp_path: Path, tok: Path) -> None:
    texts = sentences(12, seed=1)
    (tmp_path / "a.txt").write_text("\n".join(texts[:6]) + "\n\n" + "\n".join(texts[6:]) + "\n")
    write_jsonl(tmp_path / "a.jsonl", [{"body": t, "id": i} for i, t in enumerate(texts)])
    assert list(iter_records(_spec(tmp_path, tok, tmp_path / "a.txt"))) == texts  # blank lines skipped
    paragraphs = list(iter_records(_spec(tmp_path, tok, tmp_path / "a.txt", sample_by="paragraph")))
    assert paragraphs == ["\n".join(texts[:6]), "\n".join(texts[6:])]
    whole = list(iter_records(_spec(tmp_path, tok, tmp_path / "a.txt", sample_by="document")))
    assert whole == [(tmp_path / "a.txt").read_text()]
    assert (
        list(iter_records(_spec(tmp_path, tok, tmp_path / "a.jsonl", format="jsonl", text_field="body")))
        == texts
    )
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": texts, "id": list(range(12))}), tmp_path / "a.parquet", row_group_size=5)
    spec = _spec(tmp_path, tok, tmp_path / "a.parquet", format="parquet", text_field="body")
    assert list(iter_records(spec)) == texts
    train, _ = build_text_datasets(spec)
    reference, _ = build_text_datasets(
        _spec(tmp_path, tok, tmp_path / "a.jsonl", format="jsonl", text_field="body")
    )
    assert [train[i]["input_ids"].tolist() for i in range(len(train))] == [
        reference[i]["input_ids"].tolist() for i in range(len(reference))
    ]


def test_hf_dataset_folder(tmp_path: Path, tok: Path) -> None:
    datasets = pytest.importorskip("datasets")
    texts = sentences(10, seed=2)
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts})}).save_to_disk(
        str(tmp_path / "ds")
    )
    spec = _spec(tmp_path, tok, tmp_path / "ds", format="hf_dataset")
    assert list(iter_records(spec)) == texts
    with pytest.raises(ValueError, match="data.split='test'.*splits \\['train'\\]"):
        list(iter_records(_spec(tmp_path, tok, tmp_path / "ds", format="hf_dataset", split="test")))


def test_bad_records_name_the_key_and_the_fix(tmp_path: Path, tok: Path) -> None:
    write_jsonl(tmp_path / "a.jsonl", [{"content": "hello"}])
    with pytest.raises(
        ValueError, match=r"data.text_field='text'.*has no field 'text' \(it has \['content'\]\)"
    ):
        list(iter_records(_spec(tmp_path, tok, tmp_path / "a.jsonl", format="jsonl")))
    (tmp_path / "b.jsonl").write_text('{"text": "a"}\nnot json\n')
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        list(iter_records(_spec(tmp_path, tok, tmp_path / "b.jsonl", format="jsonl")))
    with pytest.raises(ValueError, match="data.seq_len=0: expected a positive integer"):
        _spec(tmp_path, tok, tmp_path / "a.jsonl", seq_len=0)
    with pytest.raises(ValueError, match="unknown key data.seqlen \\(did you mean 'seq_len'\\?\\)"):
        TextDataSpec.from_mapping({"format": "text", "path": "a", "tokenizer": "t", "seqlen": 8})
    with pytest.raises(ValueError, match="data.tokenizer=.*does not exist"):
        load_tokenizer(str(tmp_path / "missing"))
    (tmp_path / "broken.json").write_text("{}")
    with pytest.raises(ValueError, match="data.tokenizer=.*does not load"):
        load_tokenizer(str(tmp_path / "broken.json"))


# ---------------------------------------------------------------------------- cache


def test_the_cache_is_reused_and_rebuilt_when_the_file_or_tokenizer_changes(
    tmp_path: Path, tok: Path
) -> None:
    data = tmp_path / "a.txt"
    data.write_text("\n".join(sentences(30, seed=3)))
    spec = _spec(tmp_path, tok, data)
    first, _ = build_text_datasets(spec)
    assert first.cache.built
    tokens_file = first.cache.path / "tokens.bin"
    mtime = tokens_file.stat().st_mtime_ns
    again, _ = build_text_datasets(_spec(tmp_path, tok, data, seq_len=5, eval_fraction=0.2))  # cutting only
    assert not again.cache.built and again.cache.path == first.cache.path
    assert tokens_file.stat().st_mtime_ns == mtime  # not re-tokenized
    data.write_text("\n".join(sentences(30, seed=4)))  # the file changes
    changed, _ = build_text_datasets(spec)
    assert changed.cache.built and changed.cache.path != first.cache.path
    other_tok = make_tokenizer(tmp_path / "tok2", vocab_size=280)  # the tokenizer changes
    retok, _ = build_text_datasets(_spec(tmp_path, other_tok, data))
    assert retok.cache.built and retok.cache.path not in (first.cache.path, changed.cache.path)
    assert _stream(other_tok, sentences(30, seed=4))[:9] == retok[0]["input_ids"].tolist() + [
        retok[0]["labels"][-1]
    ]


def test_one_local_rank_tokenizes_the_others_wait(tmp_path: Path, tok: Path) -> None:
    data = tmp_path / "a.txt"
    data.write_text("\n".join(sentences(40, seed=5)))
    spec = _spec(tmp_path, tok, data, cache_timeout_s=30)
    loaded = load_tokenizer(str(tok))
    results: dict[int, object] = {}

    def rank(r: int) -> None:
        results[r] = ensure_cache(spec, loaded, local_rank=r)

    waiters = [threading.Thread(target=rank, args=(r,)) for r in (1, 2, 3)]
    for t in waiters:
        t.start()
    time.sleep(0.3)  # the waiters found no cache and wait for local rank 0
    assert not any(results.values())
    rank(0)
    for t in waiters:
        t.join(10)
    built = {r: c.built for r, c in results.items()}  # type: ignore[attr-defined]
    assert built == {0: True, 1: False, 2: False, 3: False}
    assert len({c.path for c in results.values()}) == 1  # type: ignore[attr-defined]


def test_a_waiting_rank_times_out_or_stops_on_the_builders_failure(
    tmp_path: Path, tok: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "a.jsonl"
    write_jsonl(data, [{"text": "fine"}, {"oops": "no text"}])
    spec = _spec(tmp_path, tok, data, format="jsonl", cache_timeout_s=0.5)
    loaded = load_tokenizer(str(tok))
    with pytest.raises(
        TokenCacheError, match="local rank 2 waited data.cache_timeout_s=0.5 s .* local rank 0"
    ):
        ensure_cache(spec, loaded, local_rank=2)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    with pytest.raises(ValueError, match="has no field 'text'"):
        ensure_cache(spec, loaded, local_rank=0)
    start = time.monotonic()
    with pytest.raises(TokenCacheError, match="local rank 0 failed to build .*has no field 'text'"):
        ensure_cache(_spec(tmp_path, tok, data, format="jsonl", cache_timeout_s=30), loaded, local_rank=1)
    assert time.monotonic() - start < 5  # at once, not after the timeout
    assert not [p for p in (tmp_path / "cache").iterdir() if ".tmp-" in p.name]  # no half-built folder left


# ---------------------------------------------------------------------------- samples


def test_packed_samples_are_the_stream_cut_with_one_shared_boundary_token(tmp_path: Path, tok: Path) -> None:
    texts = sentences(25, seed=6)
    (tmp_path / "a.txt").write_text("\n".join(texts))
    stream = _stream(tok, texts)
    seq = 7
    train, evaluation = build_text_datasets(
        _spec(tmp_path, tok, tmp_path / "a.txt", seq_len=seq, eval_fraction=0.25)
    )
    total = (len(stream) - 1) // seq
    assert (
        evaluation is not None and len(train) + len(evaluation) == total and len(evaluation) == -(-total // 4)
    )
    everything = [train[i] for i in range(len(train))] + [evaluation[i] for i in range(len(evaluation))]
    for i, item in enumerate(everything):
        assert item["input_ids"].dtype == torch.int64 and item["input_ids"].shape == (seq,)
        assert item["input_ids"].tolist() == stream[i * seq : (i + 1) * seq]
        assert item["labels"].tolist() == stream[i * seq + 1 : (i + 1) * seq + 1]
    assert evaluation.sample_id(0) == len(train)
    eos = load_tokenizer(str(tok)).eos_id
    assert stream.count(eos) == len(texts)  # one end-of-sequence token after every record


def test_unpacked_samples_are_records_truncated_and_padded(tmp_path: Path, tok: Path) -> None:
    texts = ["the quick brown fox jumps over the lazy dog again and again", "fox", "merak trains"]
    (tmp_path / "a.txt").write_text("\n".join(texts))
    train, _ = build_text_datasets(_spec(tmp_path, tok, tmp_path / "a.txt", seq_len=6, packing=False))
    loaded = load_tokenizer(str(tok))
    records = [ids + [loaded.eos_id] for ids in loaded.encode(texts, special=True)]
    assert len(train) == 3
    for i, ids in enumerate(records):
        item = train[i]
        real = min(len(ids), 7) - 1
        assert item["input_ids"][:real].tolist() == ids[:real]
        assert item["labels"][:real].tolist() == ids[1 : real + 1]
        assert item["labels"][real:].tolist() == [IGNORE_INDEX] * (6 - real)
        assert item["input_ids"][real:].tolist() == [loaded.pad_id] * (6 - real)


@pytest.mark.parametrize("packing", [True, False])
def test_sft_masks_the_prompt(tmp_path: Path, tok: Path, packing: bool) -> None:
    rows = [{"q": p, "a": r} for p, r in zip(sentences(6, seed=7), sentences(6, seed=8), strict=True)]
    write_jsonl(tmp_path / "sft.jsonl", rows)
    spec = _spec(
        tmp_path,
        tok,
        tmp_path / "sft.jsonl",
        format="jsonl",
        prompt_field="q",
        response_field="a",
        seq_len=40,
        packing=packing,
    )
    train, _ = build_text_datasets(spec)
    loaded = load_tokenizer(str(tok))
    stream: list[int] = []
    counted: list[bool] = []
    for row in rows:
        prompt = loaded.encode([row["q"]], special=True)[0]
        response = loaded.encode([row["a"]], special=False)[0] + [loaded.eos_id]
        stream += prompt + response  # type: ignore[operator]
        counted += [False] * len(prompt) + [True] * len(response)
    if packing:
        expected = [t if c else IGNORE_INDEX for t, c in zip(stream[1:41], counted[1:41], strict=True)]
        assert train[0]["labels"].tolist() == expected
    else:
        first = train[0]["labels"].tolist()
        n_prompt = len(loaded.encode([rows[0]["q"]], special=True)[0])
        n_resp = len(loaded.encode([rows[0]["a"]], special=False)[0]) + 1
        assert first[: n_prompt - 1] == [IGNORE_INDEX] * (n_prompt - 1)
        assert first[n_prompt - 1 : n_prompt - 1 + n_resp] == stream[n_prompt : n_prompt + n_resp]
        assert set(first[n_prompt - 1 + n_resp :]) <= {IGNORE_INDEX}
    with pytest.raises(
        ValueError, match="data.prompt_field='q': expected set together with data.response_field"
    ):
        _spec(tmp_path, tok, tmp_path / "sft.jsonl", format="jsonl", prompt_field="q")


class _Recorder(torch.utils.data.Dataset):
    """The samples of ``inner``, noting the id of each one read."""

    def __init__(self, inner: TokenSamples) -> None:
        self.inner = inner
        self.seen: list[int] = []

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        self.seen.append(self.inner.sample_id(index))
        return self.inner[index]


def test_dp_shards_are_disjoint_and_cover_each_epoch(tmp_path: Path, tok: Path) -> None:
    from merak_core.data.loader import StageAwareDataLoader

    (tmp_path / "a.txt").write_text("\n".join(sentences(60, seed=9)))
    train, _ = build_text_datasets(_spec(tmp_path, tok, tmp_path / "a.txt", seq_len=4))
    dp, batch = 3, 2
    for drop_last in (True, False):
        per_rank: list[list[int]] = []
        for rank in range(dp):
            data = _Recorder(train)
            loader = StageAwareDataLoader(
                data, batch_size=batch, dp_rank=rank, dp_size=dp, seed=11, drop_last=drop_last
            )
            real = [b.num_real if b.num_real is not None else batch for b in loader]
            assert len(data.seen) == batch * len(real)
            # the real rows of each batch: the wrap-around padding of the last batch is not a sample
            per_rank.append([s for k, n in enumerate(real) for s in data.seen[k * batch : k * batch + n]])
        flat = [s for ids in per_rank for s in ids]
        assert len(flat) == len(set(flat))  # disjoint
        whole = len(train) // (dp * batch) * dp * batch
        assert len(flat) == (whole if drop_last else len(train))  # covering (all of it without drop_last)
        again = _Recorder(train)
        list(
            StageAwareDataLoader(again, batch_size=batch, dp_rank=1, dp_size=dp, seed=11, drop_last=drop_last)
        )
        assert again.seen[: len(per_rank[1])] == per_rank[1]  # deterministic


def test_too_little_text_is_refused_with_the_numbers(tmp_path: Path, tok: Path) -> None:
    (tmp_path / "a.txt").write_text("fox")
    with pytest.raises(ValueError, match="no training sample is left: add text, lower data.seq_len"):
        build_text_datasets(_spec(tmp_path, tok, tmp_path / "a.txt", seq_len=64))


def test_cache_meta_describes_the_build(tmp_path: Path, tok: Path) -> None:
    (tmp_path / "a.txt").write_text("\n".join(sentences(5, seed=10)))
    train, _ = build_text_datasets(_spec(tmp_path, tok, tmp_path / "a.txt", seq_len=4))
    meta = json.loads((train.cache.path / "meta.json").read_text())
    assert (
        meta["num_records"] == 5
        and meta["dtype"] == "uint16"
        and meta["eos_id"] == load_tokenizer(str(tok)).backend.token_to_id(EOS)
    )
    assert os.path.getsize(train.cache.path / "tokens.bin") == 2 * meta["num_tokens"]


def test_samples_pickle_as_the_cache_folder_not_the_tokens(tmp_path: Path, tok: Path) -> None:
    import pickle

    (tmp_path / "a.txt").write_text("\n".join(sentences(400, seed=12)))
    train, _ = build_text_datasets(_spec(tmp_path, tok, tmp_path / "a.txt", seq_len=4))
    blob = pickle.dumps(train)
    assert (
        len(blob) < os.path.getsize(train.cache.path / "tokens.bin") / 4
    )  # a spawned worker maps the files again
    copy = pickle.loads(blob)
    assert all(torch.equal(copy[i]["labels"], train[i]["labels"]) for i in (0, len(train) - 1))


def test_the_saved_position_names_the_samples_and_other_data_is_refused(tmp_path: Path, tok: Path) -> None:
    from merak_core.data.loader import StageAwareDataLoader

    (tmp_path / "a.txt").write_text("\n".join(sentences(60, seed=13)))
    train, _ = build_text_datasets(_spec(tmp_path, tok, tmp_path / "a.txt", seq_len=4))
    loader = StageAwareDataLoader(train, batch_size=2, seed=1)
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    assert state["dataset"] == train.fingerprint and state["batches_consumed"] == 2
    same, _ = build_text_datasets(_spec(tmp_path, tok, tmp_path / "a.txt", seq_len=4))
    resumed = StageAwareDataLoader(same, batch_size=2, seed=1)
    resumed.load_state_dict(state)
    assert torch.equal(next(iter(resumed)).labels, next(it).labels)  # the third batch, as if never stopped
    other, _ = build_text_datasets(_spec(tmp_path, tok, tmp_path / "a.txt", seq_len=5))
    with pytest.raises(ValueError, match="saved over the samples .*seq_len=4.* reads .*seq_len=5.*changed"):
        StageAwareDataLoader(other, batch_size=2, seed=1).load_state_dict(state)
    older = {k: v for k, v in state.items() if k != "dataset"}  # a checkpoint written before the fingerprint
    StageAwareDataLoader(other, batch_size=2, seed=1).load_state_dict(older)
