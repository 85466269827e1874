"""The ``merak-pipe`` command line: build, show, validate, export and simulate schedules.

Examples::

    merak-pipe simulate --schedule shifted-critical-path --stages 4 --microbatches 8 \\
        --forward 1 --backward 2 --recompute full --trace out.json --png out.png
    merak-pipe show --schedule 1f1b --stages 4 --microbatches 8 --lower
    merak-pipe export-csv --schedule zb-h1 --stages 4 --microbatches 8 --out zb.csv
    merak-pipe simulate --csv zb.csv --forward 1 --backward 2

This module only parses arguments and prints; the work is done by the library functions.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from merak_pipe.csv_io import from_csv, to_csv
from merak_pipe.ir import RecomputePlan, Schedule, ScheduleError
from merak_pipe.lowering import lower
from merak_pipe.schedules import available_schedules, build_schedule
from merak_pipe.sim import CostModel, simulate
from merak_pipe.trace import chrome_trace, plot_timeline
from merak_pipe.validate import validate

__all__ = ["main"]


def _floats(text: str) -> float | list[float]:
    parts = [p for p in text.split(",") if p.strip()]
    values = [float(p) for p in parts]
    return values[0] if len(values) == 1 else values


def _recompute(text: str | None, num_stages: int) -> RecomputePlan | str | float | None:
    if text is None:
        return None
    if text in ("none", "full"):
        return text
    value = _floats(text)
    if isinstance(value, list):
        return RecomputePlan.from_list(value)
    return value


def _add_schedule_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--schedule", choices=available_schedules(), help="a built-in or registered schedule")
    src.add_argument("--csv", help="a schedule in torch.distributed.pipelining's CSV format")
    p.add_argument("--stages", type=int, help="number of stages (with --schedule)")
    p.add_argument("--microbatches", type=int, help="number of microbatches (with --schedule)")
    p.add_argument("--ranks", type=int, default=None, help="number of pipeline ranks (interleaved schedules)")
    p.add_argument("--virtual-stages", type=int, default=None, help="stages per rank (interleaved-1f1b)")
    p.add_argument(
        "--recompute",
        default=None,
        help="none | full | a fraction for every stage | comma-separated fractions, one per stage",
    )


def _schedule(args: argparse.Namespace) -> Schedule:
    if args.csv:
        schedule = from_csv(args.csv, name=args.csv)
        if args.recompute is not None:
            plan = _recompute(args.recompute, schedule.num_stages)
            from merak_pipe.recompute import as_plan

            schedule.recompute = as_plan(plan, schedule.num_stages)
        return schedule
    if args.stages is None or args.microbatches is None:
        raise SystemExit("error: --schedule needs --stages and --microbatches")
    options: dict[str, Any] = {}
    if args.virtual_stages is not None:
        options["virtual_stages"] = args.virtual_stages
    return build_schedule(
        args.schedule,
        num_stages=args.stages,
        num_microbatches=args.microbatches,
        num_ranks=args.ranks,
        recompute=_recompute(args.recompute, args.stages),
        **options,
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="merak-pipe", description=__doc__.split("\n")[0] if __doc__ else None
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("show", help="print the per-rank table of a schedule")
    _add_schedule_args(p)
    p.add_argument("--lower", action="store_true", help="add send/recv actions first")

    p = sub.add_parser("validate", help="validate a schedule (exit 1 and print the marked table if invalid)")
    _add_schedule_args(p)
    p.add_argument("--lower", action="store_true", help="validate the lowered schedule")

    p = sub.add_parser("export-csv", help="write a schedule in torch.distributed.pipelining's CSV format")
    _add_schedule_args(p)
    p.add_argument("--out", required=True, help="CSV file to write")
    p.add_argument("--lower", action="store_true", help="write send/recv actions too (compute_comms form)")
    p.add_argument("--drop-recompute", action="store_true", help="write R actions as recompute-in-backward")

    p = sub.add_parser("simulate", help="simulate a schedule: makespan, bubbles, peak memory")
    _add_schedule_args(p)
    p.add_argument("--forward", type=_floats, default=1.0, help="forward time (one value or one per stage)")
    p.add_argument("--backward", type=_floats, default=2.0, help="full backward time, without recompute")
    p.add_argument("--backward-input", type=_floats, default=None, help="I time (default backward/2)")
    p.add_argument("--backward-weight", type=_floats, default=None, help="W time (default backward - I)")
    p.add_argument(
        "--recompute-time",
        type=_floats,
        default=None,
        help="time to recompute a whole stage (default forward)",
    )
    p.add_argument("--latency", type=float, default=0.0, help="p2p latency")
    p.add_argument("--bandwidth", type=float, default=float("inf"), help="p2p bytes per time unit")
    p.add_argument(
        "--boundary-bytes", type=_floats, default=0.0, help="bytes of a stage's output per microbatch"
    )
    p.add_argument(
        "--activation-bytes", type=_floats, default=1.0, help="activation bytes per microbatch per stage"
    )
    p.add_argument(
        "--input-bytes", type=_floats, default=0.0, help="bytes of a recomputing stage's kept input"
    )
    p.add_argument("--trace", default=None, help="write a Chrome trace / Perfetto JSON here")
    p.add_argument("--png", default=None, help="write a PNG timeline here (needs matplotlib)")
    p.add_argument("--critical-path", action="store_true", help="print the critical path")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``merak-pipe`` command; returns the exit status."""
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        schedule = _schedule(args)
        if args.command == "show":
            print(lower(schedule) if args.lower and not schedule.lowered else schedule)
        elif args.command == "validate":
            validate(lower(schedule) if args.lower and not schedule.lowered else schedule)
            print(
                f"ok: {schedule.name}, {schedule.num_stages} stages, {schedule.num_microbatches} microbatches, "
                f"{schedule.num_ranks} ranks"
            )
        elif args.command == "export-csv":
            out = lower(schedule) if args.lower and not schedule.lowered else schedule
            to_csv(out, args.out, drop_recompute=args.drop_recompute)
            print(f"wrote {args.out}")
        else:
            costs = CostModel(
                forward=args.forward,
                backward=args.backward,
                backward_input=args.backward_input,
                backward_weight=args.backward_weight,
                recompute=args.recompute_time,
                p2p_latency=args.latency,
                p2p_bandwidth=args.bandwidth,
                boundary_bytes=args.boundary_bytes,
                activation_bytes=args.activation_bytes,
                input_bytes=args.input_bytes,
            )
            result = simulate(schedule, costs)
            print(result.summary())
            if args.critical_path:
                print("critical path: " + " -> ".join(f"r{t.rank}:{t.action}" for t in result.critical_path))
            if args.trace:
                chrome_trace(result, args.trace)
                print(f"wrote {args.trace}")
            if args.png:
                plot_timeline(result, args.png)
                print(f"wrote {args.png}")
    except ScheduleError as err:
        print(f"invalid schedule: {err}", file=sys.stderr)
        return 1
    except (ValueError, ImportError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
