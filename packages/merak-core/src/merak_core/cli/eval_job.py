"""``merak eval JOB.yaml --checkpoint latest``: loss, perplexity and the job's metrics of a checkpoint.

::

    merak eval job.yaml --checkpoint latest          # the job's eval set (its data factory's second
                                                     # dataset, or data.eval_fraction of text data)
    merak eval job.yaml training.pp=1 --checkpoint out/checkpoints/step_200 --split train --json eval.json

The command checks the job file, that the checkpoint exists and that the job has the data
asked for, in this process; then it starts torchrun with the job's layout (or
``--nproc-per-node``), and every rank builds the model as ``merak train`` does, loads the
checkpoint's weights (a checkpoint reshards into any layout, so the layout may differ from
the one that trained) and runs :meth:`merak_core.trainer.Trainer.evaluate`: every sample once,
the last batch padded and masked (see [Note: eval weighting] in :mod:`merak_core.run.evaluation`).
Global rank 0 prints one line::

    eval: step 200 (checkpoint latest), 24 eval samples  eval_loss 2.3456  eval_perplexity 10.4430  eval_accuracy 0.5000

``eval_perplexity`` is ``exp(eval_loss)``: the perplexity per counted token when the loss is the
token-mean cross-entropy (the default loss of language models).

With ``--tasks``, the checkpoint is scored by lm-evaluation-harness instead (the optional extra
``merak-core[lm-eval]``), through the ``merak`` model of :mod:`merak_core.cli.lm_eval_model` on the
job's layout::

    merak eval job.yaml --checkpoint latest --tasks hellaswag,arc_easy --num-fewshot 0 --json scores.json
    merak eval job.yaml --tasks my_task --include-path tasks/     # task YAMLs of your own

Global rank 0 prints lm-eval's table (and writes its ``results`` to ``--json``). Checked before
torchrun: lm-eval is installed, the task names exist, the job has a tokenizer and a layout that
generation supports (:mod:`merak_core.checks.generation`).

Not done here: generation, and evaluation without a checkpoint (the initial weights).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

from merak_core.cli.job_args import add_job_arguments, add_job_command

logger = logging.getLogger(__name__)

SPLITS = ("eval", "train")


def perplexity(loss: float) -> float:
    """``exp(loss)``, inf when it overflows, NaN for a NaN loss."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def pick_split(datasets: tuple[Any, Any], split: str, source: str) -> Any:
    """The dataset ``merak eval --split`` reads (raises ``ValueError`` with the fix when the job has none)."""
    train, evaluation = datasets
    chosen = evaluation if split == "eval" else train
    if chosen is None:
        raise ValueError(
            f"{source}: the job has no {split} data: set data.eval_fraction (text data) or return "
            "(train, eval) from the data factory, or evaluate the training set with --split train"
        )
    return chosen


def evaluate_job(job: Any, checkpoint: str, *, split: str = "eval") -> dict[str, Any]:
    """Every rank: the job's model with ``checkpoint``'s weights, evaluated on ``split``; collective.

    Needs the default process group (the job's world size). Returns ``step``, ``samples``,
    ``eval_loss``, ``eval_perplexity`` and ``eval_<metric>`` for each of the job's metrics.
    """
    from merak_core.autoplan.prepare import prepare_job
    from merak_core.trainer import Trainer

    targs = job.training
    if targs.layout == "auto":
        raise ValueError(
            "merak eval: training.layout is 'auto'; pass the layout to evaluate with as overrides "
            "(training.layout=manual training.dp=... training.tp=... training.pp=...): checkpoints "
            "reshard into any layout"
        )
    targs = dataclasses.replace(targs, plan_check_steps=0) if targs.plan_check_steps else targs
    data = pick_split(job.build_datasets(), split, "merak eval")
    # the checkpoint's weights replace the model's (a LoRA run's checkpoint holds the adapters too)
    trainer = Trainer.from_prepared(prepare_job(job, (None, data), args=targs, load_pretrained=False))
    step = trainer.resume(checkpoint)
    metrics = trainer.evaluate()
    loss = metrics.pop("eval_loss")
    return {
        "step": step,
        "checkpoint": checkpoint,
        "split": split,
        "samples": len(data),
        "eval_loss": loss,
        "eval_perplexity": perplexity(loss),
        **metrics,
    }


def format_result(result: dict[str, Any]) -> str:
    """The line ``merak eval`` prints (see the module docstring)."""
    values = "  ".join(
        f"{k} {v:.4f}" for k, v in result.items() if k.startswith("eval_") and isinstance(v, float)
    )
    return (
        f"eval: step {result['step']} (checkpoint {result['checkpoint']}), {result['samples']} "
        f"{result['split']} samples  {values}"
    )


# ---------------------------------------------------------------------------- per rank (torchrun)


def worker_main(argv: list[str] | None = None) -> int:
    """The per-rank entry point (``python -m merak_core.cli.eval_job``, started by ``merak eval``)."""
    import torch.distributed as dist

    parser = argparse.ArgumentParser(prog="merak_core.cli.eval_job")
    add_job_arguments(parser)
    parser.add_argument("--checkpoint", default="latest")
    parser.add_argument("--split", default="eval", choices=SPLITS)
    parser.add_argument("--json", default=None)
    _add_harness_arguments(parser)
    args = parser.parse_args(argv)
    from merak_core.run.bootstrap import configure_rank_process

    configure_rank_process()
    from merak_core.job import JobConfig

    if args.tasks:
        from merak_core.cli.lm_eval_harness import harness_main

        return harness_main(args)
    job = JobConfig.from_yaml(args.config, args.overrides)
    result = evaluate_job(job, args.checkpoint, split=args.split)
    if dist.get_rank() == 0:
        print(format_result(result), flush=True)
        if args.json:
            from merak_core.run.nonfinite import json_safe

            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(json_safe(result), indent=2, allow_nan=False) + "\n")
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------------- the command


def add_parser(sub: Any) -> None:
    """``merak eval`` in the ``merak`` command's subparsers."""
    p = add_job_command(
        sub,
        "eval",
        help="evaluate a checkpoint of a job: loss, perplexity and the job's metrics",
        description="Evaluate a checkpoint on the job's eval set (or training set) with torchrun: "
        "every sample once; prints eval_loss, eval_perplexity and the job's metrics.",
    )
    p.add_argument(
        "--checkpoint",
        default="latest",
        metavar="PATH|latest",
        help="a step_<N> directory, or 'latest' in the job's output_dir (default)",
    )
    p.add_argument("--split", default="eval", choices=SPLITS, help="the data to evaluate (default: eval)")
    p.add_argument("--json", default=None, metavar="OUT.json", help="also write the result as JSON")
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        help="processes (default: the job's dp*tp*pp; needed when training.dp is not set)",
    )
    p.add_argument("--dry-run", action="store_true", help="check, print the torchrun command and exit")
    _add_harness_arguments(p)


def _add_harness_arguments(p: Any) -> None:
    p.add_argument(
        "--tasks", default=None, metavar="T1,T2", help="score with lm-evaluation-harness tasks instead"
    )
    p.add_argument("--num-fewshot", type=int, default=None, help="lm-eval: few-shot examples per prompt")
    p.add_argument("--limit", type=float, default=None, help="lm-eval: documents per task (or a fraction)")
    p.add_argument("--include-path", default=None, metavar="DIR", help="lm-eval: a folder of task YAMLs")
    p.add_argument("--batch-size", type=int, default=8, help="lm-eval: requests per forward (default 8)")
    p.add_argument(
        "--tokenizer", default=None, metavar="PATH", help="lm-eval: tokenizer (default: the job's)"
    )


def eval_command(args: argparse.Namespace) -> list[str]:
    """The torchrun command of ``merak eval`` (single node)."""
    from merak_core.checkpoint.files import check_checkpoint_arg
    from merak_core.job import JobConfig

    job = JobConfig.from_yaml(args.config, args.overrides)
    t = job.training
    check_checkpoint_arg("merak eval", args.checkpoint, t.output_dir)
    if args.tasks:
        from merak_core.cli.lm_eval_harness import check_harness_args

        check_harness_args(job, args)
    else:
        pick_split(job.build_datasets(), args.split, "merak eval")  # text data: tokenized here, once
    world = args.nproc_per_node
    if world is None:
        if t.dp is None or t.layout == "auto":
            raise ValueError(
                "merak eval: the job does not fix dp (training.dp unset or layout: auto): pass "
                "--nproc-per-node, or set training.dp/tp/pp as overrides"
            )
        world = t.dp * t.tp * t.pp
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world}",
        "-m",
        "merak_core.cli.eval_job",
        args.config,
        *args.overrides,
        "--checkpoint",
        args.checkpoint,
        "--split",
        args.split,
    ]
    if args.json:
        cmd += ["--json", os.path.abspath(args.json)]
    if args.tasks:
        from merak_core.cli.lm_eval_harness import harness_flags

        cmd += harness_flags(args)
    return cmd


def run(args: argparse.Namespace) -> int:
    """``merak eval``: check here, then evaluate on torchrun's ranks; the exit status of torchrun."""
    from merak_core.cli.supervise import launch_or_print

    return launch_or_print(eval_command(args), dry_run=args.dry_run)


if __name__ == "__main__":
    sys.exit(worker_main())
