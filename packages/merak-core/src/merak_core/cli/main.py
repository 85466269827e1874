"""The ``merak`` command: its parser and the dispatch to each subcommand's module.

Only this module (and the per-rank entry point) configures logging; the libraries never touch
the root logger.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

from merak_core import __version__
from merak_core.cli import check, plan, train
from merak_core.run.exitcodes import BAD_INPUT, PREEMPTED

__all__ = ["main"]


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="merak", description="Automated 3D-parallel training for PyTorch.")
    parser.add_argument("--version", action="version", version=f"merak {__version__}")
    parser.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    train.add_parser(sub)
    plan.add_parser(sub)
    check.add_plans_parser(sub)
    check.add_check_parser(sub)
    from merak_core.cli.export import add_parser as _add_export

    _add_export(sub)
    from merak_core.cli.eval_job import add_parser as _add_eval

    _add_eval(sub)
    from merak_core.cli.generate_job import add_parser as _add_generate

    _add_generate(sub)
    return parser


class _StoppedBeforeLaunch(BaseException):
    """SIGINT or SIGTERM while ``merak train`` checks the job (the signal's name is the message).

    A ``BaseException``, like ``KeyboardInterrupt``: the checks report a factory's ``Exception`` as bad input.
    """


@contextlib.contextmanager
def _stop_before_launch() -> Iterator[None]:
    """Turn SIGINT/SIGTERM into :class:`_StoppedBeforeLaunch` (torchrun's supervisor installs its own meanwhile)."""

    def stop(signum: int, frame: Any) -> None:
        raise _StoppedBeforeLaunch(signal.Signals(signum).name)

    if threading.current_thread() is not threading.main_thread():  # only the main thread has handlers
        yield
        return
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    except KeyboardInterrupt:  # a SIGINT handler of someone else's
        raise _StoppedBeforeLaunch("SIGINT") from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse ``argv``; ``section.key=value`` overrides after the options are overrides too.

    argparse fills a command's ``overrides`` only from the words right after the job file, so
    ``merak train JOB --dry-run training.max_steps=5`` would stop at the override; here such
    words join ``overrides`` in their order. Anything else unknown is the usual usage error.
    """
    args, extra = parser.parse_known_args(argv)
    overrides = [w for w in extra if "=" in w and not w.startswith("-")]
    if extra and (len(overrides) < len(extra) or not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if overrides:
        args.overrides = [*args.overrides, *overrides]
    return args


_LAZY = {
    "export": "merak_core.cli.export",
    "eval": "merak_core.cli.eval_job",
    "generate": "merak_core.cli.generate_job",
}
"""Subcommands whose module is imported only when run: command -> module with ``run(args)``."""


def _run_lazy(args: argparse.Namespace) -> int:
    """Run ``args.command`` from its module; a ``ValueError`` (CheckpointError included) is one line, exit 2."""
    import importlib

    module = importlib.import_module(_LAZY[args.command])
    try:
        return int(module.run(args))
    except ValueError as exc:
        print(f"merak {args.command}: error: {exc}", file=sys.stderr)
        return BAD_INPUT


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = _parse(parser, argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "train":
        try:
            with _stop_before_launch():
                return train.run(args)
        except ValueError as exc:  # a bad job file or override: one clear line, no traceback
            print(f"merak train: error: {exc}", file=sys.stderr)
            return BAD_INPUT
        except _StoppedBeforeLaunch as exc:  # SIGINT/SIGTERM before torchrun started (while checking the job)
            print(
                f"merak train: stopped by {exc} before the job started (nothing was launched)",
                file=sys.stderr,
            )
            return PREEMPTED
    if args.command == "plan":
        try:
            return plan.run(args)
        except ValueError as exc:
            print(f"merak plan: error: {exc}", file=sys.stderr)
            return 2
    if args.command == "plans":
        return check.run_plans(args)
    if args.command == "check":
        try:
            return check.run_check(args)
        except ValueError as exc:
            print(f"merak check: error: {exc}", file=sys.stderr)
            return BAD_INPUT
    if args.command in _LAZY:
        return _run_lazy(args)
    parser.error(f"unknown command {args.command!r}")
    return 2
