"""What every preflight check raises and what the run reports."""

from __future__ import annotations

from dataclasses import dataclass, field


class PreflightError(ValueError):
    """A mistake in the job found before launch (the message names the key, the value and the fix)."""


@dataclass
class PreflightReport:
    """What :func:`preflight` checked (for the launch log)."""

    checks: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return "; ".join(self.checks)
