"""The arguments every subcommand that runs a job file starts with: ``JOB.yaml [section.key=value ...]``.

:func:`merak_core.cli.main` also takes ``section.key=value`` words after the options as overrides.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_job_arguments", "add_job_command"]


def add_job_arguments(p: argparse.ArgumentParser, config_help: str = "YAML job file") -> None:
    """The job file and its overrides, the first two positional arguments of ``p``."""
    p.add_argument("config", help=config_help)
    p.add_argument(
        "overrides", nargs="*", help="section.key=value overrides of the job file (e.g. training.tp=2)"
    )


def add_job_command(
    sub: Any, name: str, *, help: str, description: str, config_help: str = "YAML job file"
) -> argparse.ArgumentParser:
    """The ``merak NAME CONFIG [overrides ...]`` subparser, for the command to add its own options to."""
    p: argparse.ArgumentParser = sub.add_parser(name, help=help, description=description)
    add_job_arguments(p, config_help)
    return p
