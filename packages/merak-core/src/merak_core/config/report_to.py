"""``training.report_to``: which reporters a run's arguments may name, checked with the arguments.

The names and the check live with the configuration (``merak_core.config`` checks every argument
before any process group; a job file's before torchrun starts); opening the reporters is the run's
(:mod:`merak_core.run.reporting`, where [Note: report_to] says what each value does).
"""

from __future__ import annotations

import importlib.util
from typing import Any

REPORT_TO = ("tensorboard", "wandb", "mlflow")
"""The reporters ``training.report_to`` may name (besides ``all`` and ``none``)."""

EXTRAS = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow-skinny")}
"""Per reporter needing a package: (the merak-core extra, the package it installs); the module is the name."""

_EXPECTED = f"one of {REPORT_TO} or a list of them, 'all' (every one installed) or 'none'"


def check_report_to(value: Any) -> list[str] | None:
    """``report_to`` as a list of names (None stays None: the default); ValueError for a value not allowed.

    ``"wandb"`` -> ``["wandb"]``; ``"none"`` -> ``[]``; ``"all"`` -> ``["all"]``. See [Note: report_to].
    """
    if value is None:
        return None
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"report_to={value!r} is invalid: expected {_EXPECTED}; set report_to accordingly")
    names = list(dict.fromkeys(n.strip().lower() for n in names))
    bad = [n for n in names if n not in (*REPORT_TO, "all", "none")]
    if bad or (len(names) > 1 and ("none" in names or "all" in names)):
        raise ValueError(
            f"report_to={value!r} is invalid"
            + (f" ({', '.join(map(repr, bad))} is not a reporter)" if bad else "")
            + f": expected {_EXPECTED}; set report_to accordingly"
        )
    for name in names:
        if name in EXTRAS and importlib.util.find_spec(name) is None:
            extra, package = EXTRAS[name]
            raise ValueError(
                f"report_to names {name!r} but the {package} package is not installed: pip install "
                f"'merak-core[{extra}]', or remove {name} from report_to"
            )
    return [] if names == ["none"] else names


__all__ = ["EXTRAS", "REPORT_TO", "check_report_to"]
