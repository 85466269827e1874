"""``merak plans`` (the registered TP plans) and ``merak check CONFIG.yaml`` (the job's TP plan against the unsharded model).

Not done here: the check itself (:mod:`merak_core.checks.tp_check`, :mod:`merak_core.checks.tp_check_job`).
"""

from __future__ import annotations

import argparse

from merak_core.cli.job_args import add_job_command

__all__ = ["add_check_parser", "add_plans_parser", "run_check", "run_plans"]


def add_plans_parser(sub: argparse._SubParsersAction) -> None:
    sub.add_parser(
        "plans",
        help="list the registered tensor-parallel plans and the model types they cover",
        description="List the TP plans merak_tp knows (built in: transformers families by model_type), "
        "for training.tp_plan.",
    )


def run_plans(_args: argparse.Namespace) -> int:
    import merak_tp

    for name, covers in merak_tp.list_plans().items():
        print(f"{name:<18} {', '.join(covers) or '-'}")
    return 0


def add_check_parser(sub: argparse._SubParsersAction) -> None:
    p = add_job_command(
        sub,
        "check",
        help="check that the job's TP plan shards its model exactly",
        description="Run one batch through the job's model unsharded and sharded with its TP plan "
        "on tp CPU processes (gloo), and report the largest difference of every sharded module's "
        "output. Exits 1 when one is above the tolerance.",
    )
    p.add_argument(
        "--tp", type=int, default=None, help="TP ranks to check on (default: the job's tp, at least 2)"
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="largest relative difference accepted (default 1e-9, float64 rounding; 1e-5 when the "
        "sharded modules compute in float32 inside)",
    )
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--tiny",
        action="store_true",
        default=None,
        help="check the same family at a tiny config (transformers models)",
    )
    size.add_argument(
        "--full", dest="tiny", action="store_false", help="check the job's model itself, however large"
    )
    p.add_argument(
        "--max-params",
        type=int,
        default=None,
        help="above this many parameters the tiny config is checked (default 200,000,000); a model "
        "that does not fit the check's memory is checked at the tiny config too",
    )


def run_check(args: argparse.Namespace) -> int:
    from merak_core.checks.tp_check import default_tolerance, format_report
    from merak_core.checks.tp_check_job import check_job
    from merak_core.job import JobConfig

    job = JobConfig.from_yaml(args.config, args.overrides)
    rows, checked = check_job(job, tp=args.tp, tiny=args.tiny, max_params=args.max_params)
    tolerance = default_tolerance(rows) if args.tolerance is None else args.tolerance
    print(f"TP plan check of {args.config}: {checked}")
    print(format_report(rows, tolerance=tolerance))
    return 1 if any(r.relative > tolerance for r in rows) else 0
