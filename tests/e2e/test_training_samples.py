"""Samples during training (``training.sample_prompts``): what a run writes equals transformers' greedy
``generate`` with the run's weights at that step.

A tiny float64 Llama folder (GQA, with a tokenizer) trains 2 steps at dp1·tp2·pp2 (in-pool ranks) with
``sample_prompts`` of different lengths and ``sample_steps: 1``. The rank body records the full
weights each time the run samples (collective, just before the run's own generation), so the test can
load them into ``LlamaForCausalLM`` and run ``generate(do_sample=False)`` on each prompt alone. The
``samples.jsonl`` lines (step, prompt, text) and TensorBoard's text events must hold exactly those
continuations. The refusals (no tokenizer, cp) are checked before any process group.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.e2e._pretrained_support import Blocks, lm_loss, make_folder, token_stream
from tests.e2e._trainer_support import make_args
from tests.support.dist import run_on_ranks

pytestmark = pytest.mark.transformers

PROMPTS = ["the pipeline of", "every rank reads its own tensor shard and"]
NEW = 5


def train_with_samples(folder: str, text: str, out: str) -> Any:
    """Rank body: 2 steps with samples after each; the full weights at each sample step (rank 0)."""
    from merak_core import Trainer

    args = make_args(
        dp=1,
        tp=2,
        pp=2,
        max_steps=2,
        learning_rate=5e-2,
        output_dir=out,
        report_to="tensorboard",
        sample_prompts=PROMPTS,
        sample_steps=1,
        sample_max_new_tokens=NEW,
    )
    data = Blocks(token_stream(Path(text), Path(folder) / "tokenizer.json"), count=16)
    trainer = Trainer(None, args, data, loss_fn=lm_loss, pretrained=folder)
    assert trainer.samples is not None
    weights: dict[int, Any] = {}
    generate = trainer.samples.generate

    def recording(tr: Any, step: int) -> Any:
        weights[step] = tr.full_state_dict()  # collective, every rank
        return generate(tr, step)

    trainer.samples.generate = recording  # type: ignore[method-assign]
    trainer.train()
    return weights


def _reference_texts(folder: Path, state: dict[str, torch.Tensor]) -> list[str]:
    import transformers as tf
    from tokenizers import Tokenizer

    model = tf.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float64).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    eos = model.config.eos_token_id
    texts = []
    for prompt in PROMPTS:
        ids = torch.tensor([tok.encode(prompt).ids])
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos,
            )
        new = out[0, ids.shape[1] :].tolist()
        new = new[: new.index(eos)] if eos in new else new
        texts.append(tok.decode(new, skip_special_tokens=True))
    return texts


def test_samples_equal_transformers_greedy_at_each_step() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder, text = make_folder("llama", tmp)
        out = Path(tmp) / "run"
        weights = run_on_ranks(4, train_with_samples, str(folder), str(text), str(out))[0]
        assert sorted(weights) == [1, 2]
        lines = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
        expected = [
            {"step": step, "prompt": prompt, "text": ref}
            for step in (1, 2)
            for prompt, ref in zip(PROMPTS, _reference_texts(folder, weights[step]), strict=True)
        ]
        assert lines == expected
        assert any(r["text"] for r in lines), lines  # something was generated
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(out / "tensorboard"), size_guidance={"tensors": 0}).Reload()
        shown = {
            (tag, e.step): e.tensor_proto.string_val[0].decode()
            for tag in events.Tags()["tensors"]
            if tag.startswith("samples/")
            for e in events.Tensors(tag)
        }
        assert shown == {
            (f"samples/{PROMPTS.index(r['prompt'])}/text_summary", r["step"]): f"**{r['prompt']}**{r['text']}"
            for r in lines
        }


def test_sample_refusals_before_any_process_group(tmp_path: Path) -> None:
    import torch.distributed as dist

    from merak_core import Trainer

    folder, text = make_folder("llama", tmp_path)
    (folder / "tokenizer.json").rename(tmp_path / "tokenizer.json")
    data = Blocks(token_stream(text, tmp_path / "tokenizer.json"), count=4)
    args = make_args(dp=1, tp=1, pp=1, sample_prompts=["the"], output_dir=str(tmp_path / "o"))
    with pytest.raises(
        ValueError, match=r"training.sample_prompts needs a tokenizer: set training.sample_tokenizer"
    ):
        Trainer(None, args, data, loss_fn=lm_loss, pretrained=str(folder))
    args = make_args(
        dp=1,
        cp=2,
        sample_prompts=["the"],
        sample_tokenizer=str(tmp_path / "tokenizer.json"),
        output_dir=str(tmp_path / "o"),
    )
    with pytest.raises(ValueError, match=r"cp=2: generation is not supported .* generate with cp: 1"):
        Trainer(None, args, data, pretrained=str(folder))
    assert not dist.is_initialized()


SAMPLE_JOB_REFUSALS = [
    (
        {"sample_prompts": ["the"]},
        "exit 2: merak train: error: training.sample_prompts is set but the job names no tokenizer",
    ),
    (
        {
            "sample_prompts": ["the"],
            "sample_tokenizer": "TOK",
            "virtual_stages": 2,
            "pp": 2,
            "gradient_accumulation_steps": 2,
            "schedule": "interleaved_1f1b",
        },
        "training.sample_prompts: training.virtual_stages=2 is not supported for generation",
    ),
    (
        {"sample_prompts": ["the"], "sample_tokenizer": "TOK", "zero_stage": 2},
        "training.sample_prompts: training.zero_stage=2: generation is not supported",
    ),
]


@pytest.mark.parametrize(
    ("training", "message"), SAMPLE_JOB_REFUSALS, ids=["no-tokenizer", "virtual", "zero2"]
)
def test_sample_job_refused_before_torchrun(training: dict[str, Any], message: str, tmp_path: Path) -> None:
    """``merak train --dry-run`` (in this process, no collective) refuses in one line, exit 2."""
    from tests.e2e._bad_input_launch_cases import train_dry_run, write_job
    from tests.e2e._bad_input_support import CaseContext, CliExit
    from tests.e2e._pretrained_support import build_tokenizer, write_text

    build_tokenizer(write_text(tmp_path / "t.txt"), tmp_path)
    training = {k: str(tmp_path / "tokenizer.json") if v == "TOK" else v for k, v in training.items()}
    ctx = CaseContext(tmp_path)
    job = write_job(ctx, model={"factory": "tests.e2e._bad_input_launch_cases:hf_llama"}, training=training)
    with pytest.raises(CliExit) as info:
        train_dry_run(ctx, job)
    assert message in str(info.value), str(info.value)
