"""What generation cannot run, found before torchrun: for ``merak generate`` and for the samples a run
writes during training (``training.sample_prompts``).

Each refusal names the key, its value and the fix. The same refusals are made on the ranks
(:func:`merak_core.generation.run_api.check_run_options` and :func:`merak_core.generation.decode.generate`),
for a run started from Python.

Not done here: the TP plan and head counts (``tp_plan``, ``sizes``), decoding itself (``generation``).
"""

from __future__ import annotations

from typing import Any

from merak_core.checks.base import PreflightError


def check_generation_layout(job: Any, model: Any, what: str) -> None:
    """Refuse the job's layout and options that generation does not support (``what`` prefixes the message)."""
    from merak_core.generation.decoders import FAMILIES
    from merak_core.generation.run_api import check_run_options

    t = job.training
    refusals = {
        "training.virtual_stages": (
            t.virtual_stages > 1,
            "generation runs one stage per rank: training.virtual_stages=1",
        ),
        "training.sequence_parallel": (
            t.sequence_parallel and t.tp > 1,
            "use training.sequence_parallel=false",
        ),
        "model.lora": (
            job.model.lora is not None and t.pp > 1,
            "generate a LoRA checkpoint at training.pp=1",
        ),
    }
    for key, (bad, fix) in refusals.items():
        if bad:
            raise PreflightError(
                f"{what}: {key}={getattr(t, key.split('.')[1], 'set')!r} is not supported for generation: {fix}"
            )
    try:
        check_run_options(t, t.pp)  # the Trainer's own refusals (zero_stage, ep, cp, overlap_chunks), here
    except ValueError as exc:
        raise PreflightError(f"{what}: training.{exc}") from None
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if t.pp > 1 and model_type not in FAMILIES:
        raise PreflightError(
            f"{what}: training.pp={t.pp} with a {model_type or type(model).__name__!r} model: generation under "
            f"pipeline parallelism supports {sorted(FAMILIES)}; pass training.pp=1 (and training.tp=... instead)"
        )


def check_samples_job(job: Any, model: Any) -> list[str]:
    """``training.sample_prompts``: a tokenizer is known and the layout can generate (nothing when unset)."""
    t = job.training
    if not t.sample_prompts:
        return []
    if t.sample_tokenizer is None:
        raise PreflightError(
            "training.sample_prompts is set but the job names no tokenizer to encode them (no "
            "training.sample_tokenizer, no text data's data.tokenizer, no tokenizer files in model.pretrained="
            f"{job.model.pretrained!r}): set training.sample_tokenizer=PATH (a tokenizer.json or a tokenizer "
            "folder), or remove training.sample_prompts"
        )
    from merak_core.data.text import load_tokenizer

    try:
        load_tokenizer(t.sample_tokenizer)
    except ValueError as exc:
        raise PreflightError(f"training.sample_tokenizer={t.sample_tokenizer!r}: {exc}") from None
    if t.layout != "auto":  # auto: the degrees are known on the ranks, which refuse there
        check_generation_layout(job, model, "training.sample_prompts")
    return [f"{len(t.sample_prompts)} sample prompts can be generated"]
