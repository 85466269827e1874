"""``merak eval JOB --tasks T1,T2``: lm-evaluation-harness tasks scored on the job's layout (torchrun).

The checks before torchrun (:func:`check_harness_args`), the flags handed to the ranks
(:func:`harness_flags`) and what every rank runs (:func:`harness_main`: the ``merak`` model of
:mod:`merak_core.cli.lm_eval_model` and ``lm_eval.simple_evaluate``; global rank 0 prints the table
and writes ``--json``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
from pathlib import Path
from typing import Any

CMD = "merak eval --tasks"


def _task_names(args: argparse.Namespace) -> list[str]:
    names = [t.strip() for t in str(args.tasks).split(",") if t.strip()]
    if not names:
        raise ValueError(f"{CMD} {args.tasks!r}: name at least one lm-evaluation-harness task")
    return names


def check_harness_args(job: Any, args: argparse.Namespace) -> None:
    """Before torchrun: lm-eval installed, the tasks known, a tokenizer, a layout generation supports."""
    from merak_core.checks import build_meta_model
    from merak_core.checks.generation import check_generation_layout
    from merak_core.data.text import load_tokenizer
    from merak_core.generation.prompts import job_tokenizer

    if importlib.util.find_spec("lm_eval") is None:
        raise ValueError(
            f"{CMD} needs lm-evaluation-harness: pip install 'merak-core[lm-eval]' (or run merak eval without --tasks)"
        )
    if args.batch_size < 1:
        raise ValueError(f"{CMD}: --batch-size {args.batch_size} must be >= 1")
    if args.include_path is not None and not Path(args.include_path).is_dir():
        raise ValueError(f"{CMD}: --include-path {args.include_path!r} is not a folder of task YAMLs")
    from lm_eval.tasks import TaskManager

    names = _task_names(args)
    known = set(TaskManager(include_path=args.include_path).all_tasks)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(
            f"{CMD}: unknown lm-eval tasks {unknown}: see `lm_eval ls tasks`, or pass --include-path DIR "
            "with their task YAMLs"
        )
    tokenizer = args.tokenizer or job_tokenizer(job)
    if tokenizer is None:
        raise ValueError(
            f"{CMD}: the job names no tokenizer (no data.tokenizer, no tokenizer files in model.pretrained="
            f"{job.model.pretrained!r}): pass --tokenizer PATH"
        )
    load_tokenizer(tokenizer)
    t = job.training
    if t.layout == "auto" or t.dp is None:
        raise ValueError(
            f"{CMD}: the job does not fix its layout (layout: auto or training.dp unset): pass "
            "training.layout=manual training.dp=... training.tp=... training.pp=... (checkpoints reshard)"
        )
    check_generation_layout(job, build_meta_model(job), CMD)
    job.build_datasets()  # the stages are traced on the job's data (text data: tokenized here, once)


def harness_flags(args: argparse.Namespace) -> list[str]:
    """The lm-eval flags of the per-rank command."""
    flags = ["--tasks", args.tasks, "--batch-size", str(args.batch_size)]
    for flag, value in (
        ("--num-fewshot", args.num_fewshot),
        ("--limit", args.limit),
        ("--include-path", None if args.include_path is None else str(Path(args.include_path).resolve())),
        ("--tokenizer", None if args.tokenizer is None else str(Path(args.tokenizer).resolve())),
    ):
        if value is not None:
            flags += [flag, str(value)]
    return flags


def harness_main(args: argparse.Namespace) -> int:
    """Every rank: score the tasks with the ``merak`` model; global rank 0 prints and writes the results."""
    import lm_eval
    import torch.distributed as dist
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import make_table

    from merak_core.cli.lm_eval_model import MerakLM

    lm = MerakLM(
        job=args.config,
        checkpoint=args.checkpoint,
        overrides=shlex.join(args.overrides),
        tokenizer=args.tokenizer,
        batch_size=args.batch_size,
    )
    limit = args.limit
    out = lm_eval.simple_evaluate(
        model=lm,
        tasks=_task_names(args),
        num_fewshot=args.num_fewshot,
        limit=int(limit) if limit is not None and limit >= 1 else limit,
        task_manager=TaskManager(include_path=args.include_path),
    )
    if dist.get_rank() == 0 and out is not None:
        print(make_table(out), flush=True)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(out["results"], indent=2, default=str) + "\n")
    dist.destroy_process_group()
    return 0


__all__ = ["check_harness_args", "harness_flags", "harness_main"]
