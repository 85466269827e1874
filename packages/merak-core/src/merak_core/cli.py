"""The ``merak`` command line.

Only this module configures logging; the libraries never touch the root logger.
"""

from __future__ import annotations

import argparse
import logging
import sys

from merak_core import __version__


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="merak", description="Automated 3D-parallel training for PyTorch."
    )
    parser.add_argument("--version", action="version", version=f"merak {__version__}")
    parser.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    if args.command is None:
        parser.print_help()
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
