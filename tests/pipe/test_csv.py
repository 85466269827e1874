"""CSV import/export in torch.distributed.pipelining's format, checked by torch's own code."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from merak_pipe import CostModel, Schedule, build_schedule, from_csv, lower, simulate, to_csv, validate

torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

CASES = [
    ("gpipe", {}, 4, 6),
    ("1f1b", {}, 4, 8),
    ("zb-h1", {}, 5, 7),
    ("interleaved-1f1b", {"num_ranks": 2}, 8, 8),
    ("shifted-critical-path", {}, 4, 8),
]


def _load_in_torch(path: Path) -> dict[int, list[object]]:
    """What PipelineScheduleMulti._load_csv does: one row per rank, _Action.from_str per cell."""
    import csv

    with open(path, newline="") as f:
        return {
            rank: [torch_schedules._Action.from_str(c) for c in row] for rank, row in enumerate(csv.reader(f))
        }


@pytest.mark.parametrize("name,kw,S,M", CASES)
def test_exported_csv_passes_torch_validation(
    tmp_path: Path, name: str, kw: dict[str, int], S: int, M: int
) -> None:
    schedule = build_schedule(name, num_stages=S, num_microbatches=M, **kw)
    path = tmp_path / "s.csv"
    to_csv(schedule, path, drop_recompute=True)
    actions = _load_in_torch(path)
    stage_to_rank = torch_schedules._validate_schedule(actions, schedule.num_ranks, S, M)
    assert stage_to_rank == dict(enumerate(schedule.stage_to_rank))


def test_recompute_actions_need_an_explicit_choice(tmp_path: Path) -> None:
    schedule = build_schedule("shifted-critical-path", num_stages=3, num_microbatches=4)
    with pytest.raises(ValueError, match="drop_recompute=True"):
        to_csv(schedule)
    text = to_csv(schedule, drop_recompute=True)
    back = from_csv(text, recompute=schedule.recompute)
    assert not back.has_recompute_actions
    validate(back)  # recompute inside the backward: still a valid schedule


@pytest.mark.parametrize("name,kw,S,M", CASES)
def test_round_trip_compute_only_and_lowered(
    tmp_path: Path, name: str, kw: dict[str, int], S: int, M: int
) -> None:
    schedule = (
        build_schedule(name, num_stages=S, num_microbatches=M, recompute="none", **kw)
        if name != "shifted-critical-path"
        else build_schedule(name, num_stages=S, num_microbatches=M, **kw)
    )
    for s in (schedule, lower(schedule)):
        text = to_csv(s, tmp_path / "x.csv", drop_recompute=False) if not s.has_recompute_actions else None
        if text is None:
            continue
        back = from_csv(tmp_path / "x.csv")
        assert back.actions == s.actions
        assert back.stage_to_rank == s.stage_to_rank and back.lowered == s.lowered
        assert (back.num_stages, back.num_microbatches) == (S, M)
        validate(back)


def test_torch_generated_schedules_load_validate_and_simulate_here(tmp_path: Path) -> None:
    """Torch's own interleaved 1F1B rank ops and its send/recv lowering, written as CSV, read here."""
    P, v, M = 4, 2, 8
    fake = SimpleNamespace(
        n_local_stages=v, pp_group_size=P, microbatches_per_round=M // max(1, M // P), _n_microbatches=M
    )
    compute = {
        rank: [
            a
            for a in torch_schedules.ScheduleInterleaved1F1B._calculate_single_rank_operations(fake, rank)
            if a is not None
        ]
        for rank in range(P)
    }
    rows = [",".join(str(a) for a in compute[r]) for r in range(P)]
    (tmp_path / "torch.csv").write_text("\n".join(rows) + "\n")
    ours = from_csv(tmp_path / "torch.csv", name="torch-interleaved")
    assert ours.stage_to_rank == tuple(s % P for s in range(P * v))
    validate(ours)
    result = simulate(ours, CostModel(forward=1.0, backward=2.0))
    assert result.makespan >= v * M * 3.0  # each rank computes v * M * (F + B)

    with_comms = torch_schedules._add_send_recv(compute, lambda s: s % P, P * v)
    rows = [",".join(str(a) for a in with_comms[r]) for r in range(P)]
    lowered = from_csv("\n".join(rows) + "\n", name="torch-lowered")
    assert lowered.lowered
    validate(lowered)
    assert simulate(lowered, CostModel(forward=1.0, backward=2.0)).makespan == pytest.approx(result.makespan)


def test_bad_csv_cells_and_layouts_are_reported(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="row 1 .* column 1"):
        from_csv("0F0,0B0\n1F0,oops\n")
    with pytest.raises(ValueError, match="stage 0 appears on rank 0 and on rank 1"):
        from_csv("0F0,0B0\n0F1,0B1\n")
    with pytest.raises(ValueError, match="never appear"):
        from_csv("0F0,0B0\n2F0,2B0\n")
    with pytest.raises(ValueError, match="no rows"):
        from_csv(tmp_path / "missing.csv" if False else "\n\n,\n")
    s: Schedule = from_csv("0F0,,0B0\n")
    assert [str(a) for a in s.actions[0]] == ["0F0", "0B0"]
