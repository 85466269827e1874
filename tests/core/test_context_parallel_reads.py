"""Text data read per cp rank ([Note: cp reads] in merak_core.data.text.samples): a view's items are the cp
split of the whole items, without a process group; packed blocks, padded records and masked prompts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from merak_core.data.text import TextDataSpec, build_text_datasets
from merak_tp.context import shard_positions
from tests.support.text import make_tokenizer, sentences, write_jsonl


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer")


def _sets(tmp_path: Path, tok: Path, **kw: Any) -> Any:
    texts = sentences(24, seed=5, words=12)
    rows = [{"text": t, "q": t[: len(t) // 2], "a": t[len(t) // 2 :]} for t in texts]
    path = write_jsonl(tmp_path / "a.jsonl", rows)
    values: dict[str, Any] = dict(
        format="jsonl",
        path=str(path),
        tokenizer=str(tok),
        seq_len=16,
        eval_fraction=0.25,
        cache_dir=str(tmp_path / "cache"),
    )
    values.update(kw)
    return build_text_datasets(TextDataSpec(**values))


@pytest.mark.parametrize(
    "options",
    [{}, {"packing": False}, {"packing": False, "prompt_field": "q", "response_field": "a"}],
    ids=["packed", "records-padded", "prompt-masked"],
)
@pytest.mark.parametrize(("cp", "mode"), [(2, "ring"), (2, "ulysses"), (4, "ring")])
def test_a_view_reads_the_split_of_each_sample(
    tmp_path: Path, tok: Path, options: dict[str, Any], cp: int, mode: str
) -> None:
    for whole in _sets(tmp_path, tok, **options):
        assert whole.cp_positions is None
        labels = torch.stack([whole[i]["labels"] for i in range(len(whole))])
        if options.get("packing") is False:
            assert bool((labels == -100).any())  # padding or prompts: masked labels are read too
        for rank in range(cp):
            view = whole.reading_positions(
                lambda n, r=rank: shard_positions(n, cp, r, balanced=mode == "ring")
            )
            pos = shard_positions(whole.seq_len, cp, rank, balanced=mode == "ring")
            assert len(view) == len(whole) and view.fingerprint == whole.fingerprint
            for i in range(len(whole)):
                item, full = view[i], whole[i]
                assert sorted(item) == sorted(full)
                for key in full:
                    assert torch.equal(item[key], full[key][pos]), (rank, i, key)


def test_positions_outside_a_sample_are_refused(tmp_path: Path, tok: Path) -> None:
    train, _ = _sets(tmp_path, tok)
    with pytest.raises(ValueError, match=r"are not positions of a sample of 16 tokens"):
        train.reading_positions(lambda n: torch.arange(n + 1))
