"""``merak export CHECKPOINT --to-hf OUT``: a checkpoint as a Hugging Face folder, in one process.

``CHECKPOINT`` is a ``step_<N>`` directory, a ``latest`` pointer (``.../checkpoints/latest``), a
checkpoints directory, a run's ``output_dir``, or ``latest`` alone: then the newest checkpoint of
``--job JOB.yaml``'s ``output_dir`` (or of ``./checkpoints``). Every file read is verified against
the checkpoint's checksums; ``latest`` skips corrupt checkpoints with a warning. The config and
tokenizer files come from the pretrained folder the run recorded, ``--pretrained PATH`` or the
job's ``model.pretrained``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from merak_core.hf.export import DEFAULT_MAX_SHARD_BYTES, check_out_dir, export_checkpoint


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "export",
        help="write a checkpoint as a Hugging Face folder (safetensors shards, index, "
        "config.json, tokenizer)",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    p.add_argument(
        "checkpoint",
        help="step_<N> directory, .../checkpoints/latest, a checkpoints or output directory, or 'latest'",
    )
    p.add_argument("--to-hf", dest="to_hf", required=True, metavar="OUT", help="the folder to write")
    p.add_argument(
        "--pretrained",
        default=None,
        metavar="PATH",
        help="the Hugging Face folder whose config.json and tokenizer files to copy "
        "(default: the one the run started from)",
    )
    p.add_argument(
        "--job",
        default=None,
        metavar="JOB.yaml",
        help="resolve 'latest' under this job's output_dir; its model.pretrained is the default folder",
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA run's checkpoint: write the whole model with the adapters merged into their weights "
        "(default: a PEFT adapter folder)",
    )
    p.add_argument(
        "--max-shard-size",
        default=str(DEFAULT_MAX_SHARD_BYTES),
        metavar="SIZE",
        help="largest safetensors file, e.g. 5GB or 500MB (default 5GB)",
    )


def resolve_checkpoint(text: str, output_dir: str | None = None) -> Path:
    """The checkpoint (or ``latest`` pointer) ``text`` names; ValueError with the fix when there is none."""
    if output_dir is not None and (text == "latest" or not os.path.isabs(text)) and not Path(text).exists():
        path = Path(output_dir) / "checkpoints" / text
    else:
        path = Path(text)
    if path.is_dir() and (path / "checkpoints").is_dir():
        path = path / "checkpoints"  # a run's output_dir
    if text == "latest" and not path.exists() and Path("checkpoints").is_dir():
        path = Path("checkpoints") / "latest"
    if not path.exists() and not (path.name == "latest" and path.parent.is_dir()):
        where = f" under output_dir {output_dir!r}" if output_dir is not None else ""
        raise ValueError(
            f"no checkpoint {text!r}{where} ({str(path)!r} does not exist): give a step_<N> directory, "
            "OUTPUT_DIR/checkpoints/latest, or 'latest' with --job JOB.yaml"
        )
    return path


def run(args: argparse.Namespace) -> int:
    check_out_dir(args.to_hf, what="--to-hf")  # first: nothing is read for an export that cannot be written
    pretrained = args.pretrained
    output_dir = None
    if args.job is not None:
        from merak_core.job import JobConfig

        job = JobConfig.from_yaml(args.job)
        output_dir = job.training.output_dir
        pretrained = pretrained or job.model.pretrained
    checkpoint = resolve_checkpoint(args.checkpoint, output_dir)
    out = export_checkpoint(
        checkpoint, args.to_hf, pretrained=pretrained, max_shard_size=args.max_shard_size, merge=args.merge
    )
    files = sorted(p.name for p in out.iterdir())
    print(
        f"merak export: wrote {out} ({len(files)} files: {', '.join(files[:8])}{' ...' if len(files) > 8 else ''})"
    )
    return 0
