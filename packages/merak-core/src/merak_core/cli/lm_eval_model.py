"""An lm-evaluation-harness model, ``merak``: a job's checkpoint scored on its dp/tp/pp layout.

::

    merak eval job.yaml --checkpoint latest --tasks hellaswag,arc_easy     # torchrun, the job's layout

    import merak_core.cli.lm_eval_model  # registers "merak" in lm_eval's model registry
    lm_eval.simple_evaluate(model="merak", model_args="job=job.yaml,checkpoint=latest", tasks=[...])

lm-evaluation-harness 0.4 has no plugin discovery for models (no entry point group is read), so the
class is registered by importing this module (``merak eval --tasks`` does), under the name
``merak`` with ``lm_eval.api.registry.register_model``. Every rank of the job's world builds the
job's model as ``merak eval`` does, loads the checkpoint (any layout: checkpoints reshard) and
runs the same requests in the same order, collectively ([Note: scoring on the layout] in
:mod:`merak_core.generation.scoring`); the harness sees one process (``rank`` 0, ``world_size``
1) on every rank, so global rank 0 alone should print or write its results.

- ``loglikelihood``: the harness' own context/continuation tokenization (``TemplateLM``), then
  :func:`merak_core.generation.scoring.score_continuations`;
- ``loglikelihood_rolling``: the harness' rolling windows of ``max_length`` tokens (as its ``hf``
  model), each scored the same way and summed;
- ``generate_until``: ``Trainer.generate`` (greedy unless the task samples) of the left-padded
  contexts, decoded and cut at the first stop string.

Model arguments: ``job`` (the job file), ``checkpoint`` (``latest`` or a directory), ``overrides``
(space-separated ``section.key=value``), ``tokenizer`` (default: the job's), ``batch_size``
(default 8), ``max_length`` (default: the model's position table, else 2048), ``max_gen_toks``
(default 256). From Python, ``MerakLM(trainer=..., tokenizer=...)`` wraps a live Trainer.

Not done here: scoring and decoding (:mod:`merak_core.generation`).
"""

from __future__ import annotations

import shlex
from typing import Any

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from merak_core.generation.prompts import decode_continuations, encode_prompts
from merak_core.generation.scoring import score_continuations

DEFAULT_MAX_LENGTH = 2048


def trainer_for_job(job_file: str, checkpoint: str, overrides: list[str]) -> tuple[Any, Any]:
    """Every rank: ``(Trainer, JobConfig)``, the job's model at its layout with ``checkpoint``'s weights; collective."""
    import dataclasses

    from merak_core.autoplan.prepare import prepare_job
    from merak_core.generation.run_api import check_run_options
    from merak_core.job import JobConfig
    from merak_core.trainer import Trainer

    job = JobConfig.from_yaml(job_file, overrides)
    targs = dataclasses.replace(job.training, plan_check_steps=0, sample_prompts=None)
    check_run_options(targs, targs.pp)
    train, evaluation = job.build_datasets()
    data = evaluation if evaluation is not None else train
    # the checkpoint's weights replace the model's (as merak generate and merak eval build their run)
    trainer = Trainer.from_prepared(prepare_job(job, (None, data), args=targs, load_pretrained=False))
    trainer.resume(checkpoint)
    return trainer, job


@register_model("merak")
class MerakLM(TemplateLM):
    """The ``merak`` model of lm-evaluation-harness (see the module docstring)."""

    def __init__(
        self,
        job: str | None = None,
        checkpoint: str = "latest",
        overrides: str = "",
        tokenizer: str | None = None,
        batch_size: int | str = 8,
        max_length: int | str | None = None,
        max_gen_toks: int | str = 256,
        trainer: Any = None,
        **_ignored: Any,
    ) -> None:
        super().__init__()
        from merak_core.data.text import load_tokenizer
        from merak_core.generation.prompts import folder_tokenizer, job_tokenizer

        job_config = None
        if trainer is None:
            if job is None:
                raise ValueError("the merak lm-eval model needs model_args job=JOB.yaml (or a trainer)")
            trainer, job_config = trainer_for_job(job, checkpoint, shlex.split(overrides))
        self.trainer = trainer
        path = tokenizer or (
            job_tokenizer(job_config) if job_config is not None else folder_tokenizer(trainer.pretrained_path)
        )
        if path is None:
            raise ValueError(
                "the merak lm-eval model found no tokenizer (no data.tokenizer, no tokenizer files in the "
                "pretrained folder): pass model_args tokenizer=PATH"
            )
        self.tok = load_tokenizer(path)
        self.batch_size = max(1, int(batch_size)) if str(batch_size) != "auto" else 8
        config = getattr(trainer.model.source, "config", None)
        table = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
        self.max_length = int(max_length) if max_length else int(table or DEFAULT_MAX_LENGTH)
        self.max_gen_toks = int(max_gen_toks)
        eos = self.tok.eos_id if self.tok.eos_id is not None else getattr(config, "eos_token_id", None)
        self.eos_id = eos if isinstance(eos, int) else None

    # ------------------------------------------------------------------ tokens

    @property
    def eot_token_id(self) -> int:
        return self.eos_id if self.eos_id is not None else self.tok.pad_id

    @property
    def device(self) -> Any:
        return self.trainer.model.layout.device

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        # None: the tokenizer's own special tokens, as the hf model's default
        return self.tok.encode([string], special=add_special_tokens is not False)[0]

    def tok_decode(self, tokens: list[int]) -> str:
        return str(self.tok.backend.decode(tokens, skip_special_tokens=True))

    # ------------------------------------------------------------------ requests

    def _loglikelihood_tokens(
        self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        out: list[tuple[float, bool]] = []
        pairs = [(context, continuation) for _, context, continuation in requests]
        for start in range(0, len(pairs), self.batch_size):
            batch = pairs[start : start + self.batch_size]
            scored = score_continuations(self.trainer.model, batch, max_length=self.max_length)
            for (key, _, _), result in zip(requests[start : start + self.batch_size], scored, strict=True):
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, result)
                out.append(result)
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        from lm_eval import utils

        windows: list[tuple[int, tuple[None, list[int], list[int]]]] = []
        for index, (string,) in enumerate(req.args for req in requests):
            for context, continuation in map(
                utils.make_disjoint_window,
                utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append((index, (None, context, continuation)))
        scores = self._loglikelihood_tokens([w for _, w in windows])
        totals = [0.0] * len(requests)
        for (index, _), (logprob, _) in zip(windows, scores, strict=True):
            totals[index] += logprob
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        return [self._generate_one(*req.args) for req in requests]

    def _generate_one(self, context: str, gen_kwargs: dict[str, Any]) -> str:
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs

        kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
        eos_text = None if self.eos_id is None else self.tok.backend.decode([self.eos_id])
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text or None)
        new = int(kwargs.pop("max_gen_toks"))
        ids, mask = encode_prompts(self.tok, [context])
        keep = max(self.max_length - new, 1)
        ids, mask = ids[:, -keep:], mask[:, -keep:]
        sampling: dict[str, Any] = {}
        if kwargs.get("do_sample") and float(kwargs.get("temperature", 0.0)) > 0:
            sampling = {"do_sample": True, "temperature": float(kwargs["temperature"]), "seed": 1234}
        sequences = self.trainer.generate(
            ids, mask, max_new_tokens=new, eos_token_id=self.eos_id, pad_token_id=self.tok.pad_id, **sampling
        )
        text = str(decode_continuations(self.tok, sequences.cpu(), ids.shape[1], self.eos_id)[0]["text"])
        for stop in until:
            if stop and stop in text:
                text = text[: text.index(stop)]
        self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return text


__all__ = ["MerakLM", "trainer_for_job"]
