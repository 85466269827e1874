"""``merak generate JOB.yaml --checkpoint latest (--prompt TEXT | --prompts FILE.jsonl)``: text from a checkpoint.

::

    merak generate job.yaml --prompt "Once upon a time" --max-new-tokens 40
    merak generate job.yaml training.tp=2 training.pp=1 --prompts prompts.jsonl --out samples.jsonl \\
        --temperature 0.8 --top-p 0.95 --seed 0

The command checks, in this process: the job file, the checkpoint, the prompts (a JSONL file of
``{"prompt": "..."}`` records, or plain strings), the tokenizer (``--tokenizer``, else the job's
``data.tokenizer``, else the ``model.pretrained`` folder's) and that the layout can generate
(world = dp*tp*pp, the TP plan divides the heads, no virtual stages, sequence parallelism or
ZeRO-3, a family :mod:`merak_core.generation` rebuilds under pp > 1); then it starts torchrun
with the job's layout. Every rank builds the model as ``merak eval`` does, loads the checkpoint
(any layout: checkpoints reshard) and runs :meth:`merak_core.Trainer.generate` on the prompts,
left-padded, in batches of ``--batch-size``. Global rank 0 prints the continuation of a
``--prompt``, or one JSON line per prompt (``prompt``, ``text``, ``tokens``), or writes them to
``--out``. Greedy unless ``--temperature`` (> 0), ``--top-k`` or ``--top-p`` asks for sampling.

Not done here: the decoding itself (:mod:`merak_core.generation`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from merak_core.cli.job_args import add_job_arguments, add_job_command

logger = logging.getLogger(__name__)
CMD = "merak generate"


def read_prompts(prompt: str | None, prompts_file: str | None) -> list[str]:
    """The prompts of ``--prompt`` or ``--prompts FILE.jsonl`` (``ValueError`` naming the line and the fix)."""
    if (prompt is None) == (prompts_file is None):
        raise ValueError(f"{CMD}: pass exactly one of --prompt TEXT and --prompts FILE.jsonl")
    if prompt is not None:
        return [prompt]
    path = Path(str(prompts_file))
    if not path.is_file():
        raise ValueError(
            f'{CMD} --prompts {str(path)!r}: no such file; pass a JSONL file of {{"prompt": ...}} lines'
        )
    out: list[str] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{CMD} --prompts {str(path)!r} line {number} is not JSON ({exc})") from None
        text = record.get("prompt") if isinstance(record, dict) else record
        if not isinstance(text, str) or not text:
            raise ValueError(
                f"{CMD} --prompts {str(path)!r} line {number}: expected a non-empty string or "
                f'{{"prompt": "..."}}, got {line[:80]!r}'
            )
        out.append(text)
    if not out:
        raise ValueError(f"{CMD} --prompts {str(path)!r} holds no prompt")
    return out


def tokenizer_path(job: Any, explicit: str | None) -> str:
    """Where the prompts' tokenizer is: ``--tokenizer``, ``data.tokenizer``, or the pretrained folder's."""
    from merak_core.generation.prompts import job_tokenizer

    found = explicit if explicit is not None else job_tokenizer(job)
    if found is not None:
        return found
    raise ValueError(
        f"{CMD}: the job names no tokenizer (no text data's data.tokenizer, no tokenizer files in "
        f"model.pretrained={job.model.pretrained!r}): pass --tokenizer PATH (a tokenizer.json or a tokenizer folder)"
    )


def check_layout(job: Any) -> int:
    """The world size, after the refusals generation makes before any process starts."""
    from merak_core.checks import build_meta_model, check_tp_plan
    from merak_core.checks.generation import check_generation_layout
    from merak_core.checks.sizes import check_attention_heads
    from merak_core.checks.tp_plan import _resolve_plan

    t = job.training
    if t.layout == "auto" or t.dp is None:
        raise ValueError(
            f"{CMD}: the job does not fix its layout (layout: auto or training.dp unset): pass "
            "training.layout=manual training.dp=... training.tp=... training.pp=... (checkpoints reshard)"
        )
    model = build_meta_model(job)
    if check_tp_plan(model, t.tp_plan, t.tp, t.overlap_chunks) is not None:
        check_attention_heads(model, _resolve_plan(model, t.tp_plan), t.tp)
    check_generation_layout(job, model, CMD)
    return int(t.dp * t.tp * t.pp)


def check_checkpoint(checkpoint: str, output_dir: str) -> None:
    from merak_core.checkpoint.files import check_checkpoint_arg

    check_checkpoint_arg(CMD, checkpoint, output_dir)


def sampling_options(args: argparse.Namespace) -> dict[str, Any]:
    """``Trainer.generate``'s keyword arguments from the flags (greedy unless a sampling flag is given)."""
    if args.temperature is not None and args.temperature < 0:
        raise ValueError(f"{CMD}: --temperature {args.temperature} must be >= 0 (0: greedy)")
    sample = (args.temperature is not None and args.temperature > 0) or args.top_k or args.top_p is not None
    opts: dict[str, Any] = {"max_new_tokens": args.max_new_tokens, "do_sample": bool(sample)}
    if sample:
        opts.update(
            temperature=args.temperature or 1.0,
            top_k=args.top_k or 0,
            top_p=1.0 if args.top_p is None else args.top_p,
            seed=args.seed,
        )
    from merak_core.generation import SamplingOptions

    SamplingOptions(**{k: v for k, v in opts.items() if k != "max_new_tokens"})  # bad values: refused here
    if args.max_new_tokens < 1:
        raise ValueError(f"{CMD}: --max-new-tokens {args.max_new_tokens} must be >= 1")
    return opts


# ---------------------------------------------------------------------------- per rank (torchrun)


def generate_job(
    job: Any, checkpoint: str, prompts: list[str], opts: dict[str, Any], *, tokenizer: str, batch_size: int
) -> list[dict[str, Any]]:
    """Every rank: the job's model with ``checkpoint``'s weights continues ``prompts``; collective."""
    from merak_core.autoplan.prepare import prepare_job
    from merak_core.data.text import load_tokenizer
    from merak_core.generation.prompts import decode_continuations, encode_prompts
    from merak_core.trainer import Trainer

    targs = dataclasses.replace(job.training, plan_check_steps=0, sample_prompts=None)
    train, evaluation = job.build_datasets()
    data = evaluation if evaluation is not None else train
    trainer = Trainer.from_prepared(prepare_job(job, (None, data), args=targs, load_pretrained=False))
    trainer.resume(checkpoint)
    tok = load_tokenizer(tokenizer)
    config = trainer.model.source.config if trainer.model.source is not None else None
    eos = tok.eos_id if tok.eos_id is not None else getattr(config, "eos_token_id", None)
    records: list[dict[str, Any]] = []
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        ids, mask = encode_prompts(tok, batch)
        sequences = trainer.generate(ids, mask, eos_token_id=eos, pad_token_id=tok.pad_id, **opts)
        for prompt, cont in zip(
            batch, decode_continuations(tok, sequences.cpu(), ids.shape[1], eos), strict=True
        ):
            records.append({"prompt": prompt, **cont})
    return records


def _write(records: list[dict[str, Any]], out: str | None, single: bool) -> None:
    lines = [json.dumps(r, ensure_ascii=False) for r in records]
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    elif single:
        print(records[0]["prompt"] + records[0]["text"], flush=True)
    else:
        print("\n".join(lines), flush=True)


def worker_main(argv: list[str] | None = None) -> int:
    """The per-rank entry point (``python -m merak_core.cli.generate_job``, started by ``merak generate``)."""
    import torch.distributed as dist

    parser = argparse.ArgumentParser(prog="merak_core.cli.generate_job")
    add_job_arguments(parser)
    _add_arguments(parser)
    parser.add_argument("--tokenizer-path", required=True)
    args = parser.parse_args(argv)
    from merak_core.run.bootstrap import configure_rank_process

    configure_rank_process()
    from merak_core.job import JobConfig

    job = JobConfig.from_yaml(args.config, args.overrides)
    prompts = read_prompts(args.prompt, args.prompts)
    records = generate_job(
        job,
        args.checkpoint,
        prompts,
        sampling_options(args),
        tokenizer=args.tokenizer_path,
        batch_size=args.batch_size,
    )
    if dist.get_rank() == 0:
        _write(records, args.out, single=args.prompt is not None)
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------------- the command


def _add_arguments(p: argparse.ArgumentParser) -> None:
    """The options ``merak generate`` and its per-rank entry point share (after the job's arguments)."""
    p.add_argument(
        "--checkpoint",
        default="latest",
        metavar="PATH|latest",
        help="a step_<N> directory, or 'latest' (default)",
    )
    p.add_argument("--prompt", default=None, metavar="TEXT", help="one prompt; its continuation is printed")
    p.add_argument(
        "--prompts", default=None, metavar="FILE.jsonl", help='a JSONL file of {"prompt": ...} lines'
    )
    p.add_argument(
        "--out", default=None, metavar="OUT.jsonl", help="write the JSONL records here (default: print)"
    )
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to add at most (default 32)")
    p.add_argument(
        "--temperature", type=float, default=None, help="sample at this temperature (0 or unset: greedy)"
    )
    p.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="sample from the top-p probability mass")
    p.add_argument(
        "--seed", type=int, default=None, help="seed of the sampling streams (reproducible output)"
    )
    p.add_argument("--batch-size", type=int, default=8, help="prompts decoded together (default 8)")


def add_parser(sub: Any) -> None:
    """``merak generate`` in the ``merak`` command's subparsers."""
    p = add_job_command(
        sub,
        "generate",
        help="generate text from a checkpoint of a job on its layout",
        description="Continue prompts with a checkpoint on the job's dp/tp/pp layout (torchrun): KV-cached "
        "decoding, greedy or sampled; prints the text or writes JSONL.",
    )
    _add_arguments(p)
    p.add_argument(
        "--tokenizer", default=None, metavar="PATH", help="tokenizer.json or folder (default: the job's)"
    )
    p.add_argument("--dry-run", action="store_true", help="check, print the torchrun command and exit")


def generate_command(args: argparse.Namespace) -> list[str]:
    """The torchrun command of ``merak generate`` (single node), after every check."""
    from merak_core.data.text import load_tokenizer
    from merak_core.job import JobConfig

    job = JobConfig.from_yaml(args.config, args.overrides)
    check_checkpoint(args.checkpoint, job.training.output_dir)
    read_prompts(args.prompt, args.prompts)
    sampling_options(args)
    if args.batch_size < 1:
        raise ValueError(f"{CMD}: --batch-size {args.batch_size} must be >= 1")
    tokenizer = tokenizer_path(job, args.tokenizer)
    load_tokenizer(tokenizer)  # a bad path or file is refused here
    world = check_layout(job)
    job.build_datasets()  # the stages are traced on the job's data (text data: tokenized here, once)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    cmd += [
        "-m",
        "merak_core.cli.generate_job",
        args.config,
        *args.overrides,
        "--checkpoint",
        args.checkpoint,
    ]
    cmd += (
        ["--prompt", args.prompt] if args.prompt is not None else ["--prompts", os.path.abspath(args.prompts)]
    )
    cmd += ["--tokenizer-path", os.path.abspath(tokenizer), "--max-new-tokens", str(args.max_new_tokens)]
    cmd += ["--batch-size", str(args.batch_size)]
    for flag, value in (
        ("--temperature", args.temperature),
        ("--top-k", args.top_k),
        ("--top-p", args.top_p),
        ("--seed", args.seed),
    ):
        if value is not None:
            cmd += [flag, str(value)]
    if args.out:
        cmd += ["--out", os.path.abspath(args.out)]
    return cmd


def run(args: argparse.Namespace) -> int:
    """``merak generate``: check here, then generate on torchrun's ranks; the exit status of torchrun."""
    from merak_core.cli.supervise import launch_or_print

    return launch_or_print(generate_command(args), dry_run=args.dry_run)


if __name__ == "__main__":
    sys.exit(worker_main())
