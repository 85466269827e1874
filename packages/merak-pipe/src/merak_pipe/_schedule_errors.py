"""A schedule's error with its per-rank table and the bad step marked (validation and the NCCL check)."""

from __future__ import annotations

from merak_pipe.ir import Schedule, ScheduleError, format_table

_CONTEXT_ROWS = 12


def _fail(
    schedule: Schedule, message: str, rank: int | None = None, step: int | None = None
) -> ScheduleError:
    mark = (rank, step) if rank is not None and step is not None else None
    table = _table_excerpt(schedule, mark)
    where = f"rank {rank}, step {step}: " if mark is not None else ""
    return ScheduleError(f"{where}{message}\n\n{table}", rank=rank, step=step)


def _table_excerpt(schedule: Schedule, mark: tuple[int, int] | None) -> str:
    """The full table, or the rows around the marked step for long schedules."""
    text = format_table(schedule, mark=mark)
    lines = text.splitlines()
    head, body = lines[:3], lines[3:]
    if len(body) <= 4 * _CONTEXT_ROWS:
        return text
    center = mark[1] if mark is not None else 0
    lo = max(0, center - _CONTEXT_ROWS)
    hi = min(len(body), center + _CONTEXT_ROWS + 1)
    excerpt = body[lo:hi]
    if lo > 0:
        excerpt.insert(0, f"  ... ({lo} steps above)")
    if hi < len(body):
        excerpt.append(f"  ... ({len(body) - hi} steps below)")
    return "\n".join(head + excerpt)
