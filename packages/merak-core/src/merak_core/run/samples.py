"""Samples during training: the model continues ``training.sample_prompts`` every ``sample_steps`` steps.

[Note: samples during training] At a sample step every rank calls ``Trainer.generate`` on the run's
own composed model and layout (collective: every stage and TP rank takes part, data-parallel replicas
decode the same prompts), greedy unless ``sample_temperature > 0`` (then seeded from ``seed`` and the
step, so a resumed run writes the same samples). Global rank 0 decodes the new tokens up to the
tokenizer's end-of-sequence token and appends one ``{"step", "prompt", "text"}`` line per prompt to
``output_dir/samples.jsonl``, and writes each to the reporters that show text (TensorBoard's text
tab, tag ``samples/<prompt index>``). Everything that could refuse (no tokenizer, a layout or option
generation does not support) is checked when the Trainer is built, before any collective; a job
file is checked before torchrun (:mod:`merak_core.checks.generation`).

Not done here: decoding (:mod:`merak_core.generation`), when the loop asks (the Trainer).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from merak_core.generation.prompts import decode_continuations, encode_prompts, folder_tokenizer
from merak_core.generation.run_api import check_run_options

FILE = "samples.jsonl"


def check_sample_model(model: Any, pp: int) -> None:
    """A model that cannot generate under ``pp`` is refused now, not at the first sample step."""
    from merak_core.generation.decoders import FAMILIES

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if pp > 1 and model_type not in FAMILIES:
        raise ValueError(
            f"training.sample_prompts at pp={pp} with a {model_type or type(model).__name__!r} model: generation "
            f"under pipeline parallelism supports {sorted(FAMILIES)}; sample at pp=1 or remove sample_prompts"
        )


@dataclass
class TrainingSamples:
    """The prompts, encoded once, and when to continue them (``TrainingArguments.sample_*``)."""

    prompts: list[str]
    tokenizer: Any
    steps: int | None
    max_new_tokens: int
    temperature: float
    seed: int

    @classmethod
    def prepare(cls, args: Any, model: Any, pp: int, pretrained: str | None) -> TrainingSamples | None:
        """None without ``sample_prompts``; else the samples, after every refusal (no collective)."""
        if not args.sample_prompts:
            return None
        path = args.sample_tokenizer or folder_tokenizer(pretrained)
        if path is None:
            raise ValueError(
                "training.sample_prompts needs a tokenizer: set training.sample_tokenizer=PATH (a "
                "tokenizer.json or a tokenizer folder), start from a model.pretrained folder that has one, "
                "or remove sample_prompts"
            )
        check_run_options(args, pp)
        for key, bad in (
            ("virtual_stages", args.virtual_stages > 1),
            ("sequence_parallel", args.sequence_parallel),
        ):
            if bad and (key != "sequence_parallel" or args.tp > 1):
                raise ValueError(
                    f"training.sample_prompts with training.{key}={getattr(args, key)!r}: generation does not "
                    f"support it (docs/generation.md); remove sample_prompts or the {key} setting"
                )
        check_sample_model(model, pp)
        from merak_core.data.text import load_tokenizer

        tok = load_tokenizer(path)
        encode_prompts(tok, list(args.sample_prompts))  # an empty encoding is refused here
        return cls(
            prompts=list(args.sample_prompts),
            tokenizer=tok,
            steps=args.sample_steps,
            max_new_tokens=args.sample_max_new_tokens,
            temperature=args.sample_temperature,
            seed=args.seed,
        )

    def due(self, step: int, total: int) -> bool:
        """Sample after ``step``: every ``sample_steps``, or after the last step when it is None."""
        return step % self.steps == 0 if self.steps else step == total

    def generate(self, trainer: Any, step: int) -> list[dict[str, Any]]:
        """Every rank (collective): the continuations of the prompts at ``step``."""
        tok = self.tokenizer
        ids, mask = encode_prompts(tok, self.prompts)
        config = getattr(trainer.model.source, "config", None)
        eos = tok.eos_id if tok.eos_id is not None else getattr(config, "eos_token_id", None)
        sampling: dict[str, Any] = {}
        if self.temperature > 0:
            sampling = {
                "do_sample": True,
                "temperature": self.temperature,
                "seed": self.seed * 1_000_003 + step,
            }
        sequences = trainer.generate(
            ids,
            mask,
            max_new_tokens=self.max_new_tokens,
            eos_token_id=eos,
            pad_token_id=tok.pad_id,
            **sampling,
        )
        texts = decode_continuations(tok, sequences.cpu(), ids.shape[1], eos)
        return [
            {"step": step, "prompt": p, "text": t["text"]} for p, t in zip(self.prompts, texts, strict=True)
        ]

    def write(self, records: list[dict[str, Any]], output_dir: str, metrics: Any) -> None:
        """Rank 0: append ``records`` to ``samples.jsonl`` and show them in TensorBoard's text tab."""
        os.makedirs(output_dir, exist_ok=True)
        with open(os.path.join(output_dir, FILE), "a", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        for index, record in enumerate(records):
            metrics.log_text(f"samples/{index}", f"**{record['prompt']}**{record['text']}", record["step"])


@torch.no_grad()
def sample_in_training(samples: TrainingSamples, trainer: Any, step: int, rank: int) -> None:
    """The samples of ``step`` (every rank), written by global rank 0."""
    records = samples.generate(trainer, step)
    if rank == 0:
        samples.write(records, trainer.args.output_dir, trainer.metrics)


__all__ = ["FILE", "TrainingSamples", "check_sample_model", "sample_in_training"]
