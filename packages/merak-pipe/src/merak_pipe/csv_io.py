"""CSV import/export in torch.distributed.pipelining's format: one row per rank, one action per cell.

``to_csv`` writes what ``PipelineScheduleMulti._load_csv(..., format="compute_only")`` reads
(a lowered schedule gives the "compute_comms" form). ``from_csv`` reads either form, inferring
the number of stages and microbatches and the stage-to-rank map from the cells. torch has no
recompute action: a schedule with ``R`` actions is refused unless ``drop_recompute=True``, which
writes it as "recompute inside the backward" (the same math, see [Note: recompute actions]).
"""

from __future__ import annotations

import csv
import io
import os

from merak_pipe.ir import Action, ActionKind, RecomputePlan, Schedule

__all__ = ["from_csv", "to_csv"]


def to_csv(
    schedule: Schedule, path: str | os.PathLike[str] | None = None, *, drop_recompute: bool = False
) -> str:
    """Write ``schedule`` as CSV (to ``path`` if given) and return the text."""
    if schedule.is_decode:
        raise ValueError(
            f"schedule {schedule.name!r} is a multi-step decode schedule (steps and token messages), which "
            "torch.distributed.pipelining's CSV form cannot hold; print it (format_table) instead"
        )
    has_r = schedule.has_recompute_actions
    if has_r and not drop_recompute:
        raise ValueError(
            f"schedule {schedule.name!r} holds R (recompute) actions, which torch.distributed.pipelining does "
            "not know; pass drop_recompute=True to write it with recomputation inside the backward"
        )
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    for rank in range(schedule.num_ranks):
        writer.writerow([str(a) for a in schedule.actions[rank] if a.kind is not ActionKind.RECOMPUTE])
    text = buffer.getvalue()
    if path is not None:
        with open(path, "w", newline="") as f:
            f.write(text)
    return text


def from_csv(
    source: str | os.PathLike[str],
    *,
    name: str = "csv",
    num_stages: int | None = None,
    num_microbatches: int | None = None,
    recompute: RecomputePlan | None = None,
) -> Schedule:
    """Read a schedule from a CSV file path, or from CSV text when ``source`` contains a newline or comma.

    Row r holds rank r's actions in order; empty cells are skipped. ``num_stages`` and
    ``num_microbatches`` default to one more than the largest index seen. Every stage must
    appear on exactly one rank.
    """
    text: str
    if isinstance(source, str) and ("\n" in source or "," in source) and not os.path.exists(source):
        text = source
    else:
        with open(source, newline="") as f:
            text = f.read()
    rows = list(csv.reader(io.StringIO(text)))
    while rows and not any(cell.strip() for cell in rows[-1]):
        rows.pop()
    if not rows:
        raise ValueError("the CSV holds no rows; expected one row of actions per rank")
    actions: dict[int, list[Action]] = {}
    stage_rank: dict[int, int] = {}
    for rank, row in enumerate(rows):
        acts = []
        for col, cell in enumerate(row):
            if not cell.strip():
                continue
            try:
                a = Action.parse(cell)
            except ValueError as err:
                raise ValueError(f"CSV row {rank} (rank {rank}), column {col}: {err}") from None
            previous = stage_rank.setdefault(a.stage, rank)
            if previous != rank:
                raise ValueError(
                    f"CSV: stage {a.stage} appears on rank {previous} and on rank {rank}; a stage lives on one rank"
                )
            acts.append(a)
        actions[rank] = acts
    seen_stages = max(stage_rank, default=-1) + 1
    seen_mbs = max((a.microbatch for acts in actions.values() for a in acts), default=-1) + 1
    S = num_stages if num_stages is not None else seen_stages
    M = num_microbatches if num_microbatches is not None else seen_mbs
    missing = [s for s in range(S) if s not in stage_rank]
    if missing:
        raise ValueError(f"CSV: stages {missing} never appear, so their rank is unknown (num_stages={S})")
    lowered = any(a.kind.is_comm for acts in actions.values() for a in acts)
    return Schedule(
        name,
        S,
        M,
        tuple(stage_rank[s] for s in range(S)),
        actions,
        lowered=lowered,
        recompute=recompute,
    )
