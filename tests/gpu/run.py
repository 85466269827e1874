"""The GPU check's one entry: ``python -m tests.gpu.run --out DIR``, on a machine as it comes.

It needs python3, torch >= 2.11, and the repository on ``PYTHONPATH`` (the four packages' ``src``
folders and the repository root); nothing installed, no nox, no network. It runs every check of
``tests/gpu/checks.py`` in a process of its own (``python -m tests.gpu.main``): the single-device
checks one after another within ``--single-budget-s`` (480 s), then, with two or more devices,
the multi-rank checks under ``python -m torch.distributed.run --standalone`` within
``--multi-budget-s`` (600 s). It sets the thread counts itself: a single-device check's CPU
float32 reference gets every core (``--threads``, default ``os.cpu_count()``), each rank of a
multi-rank check its share, whatever ``OMP_NUM_THREADS`` the caller had (the test suite sets 1).

It writes ``DIR/gpu_check.json`` and ``DIR/gpu_check.md`` (format in docs/devices.md) and exits 0
only when every check that ran passed. ``--device cpu --size tiny`` runs the same on CPU (the
normal suite does, in ``tests/gpu/test_run_cpu.py``). A child started with ``python -S`` gets
``-S`` too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [
    ROOT / "packages" / name / "src" for name in ("merak-pipe", "merak-graph", "merak-tp", "merak-core")
]
PACKAGES = ("merak_pipe", "merak_graph", "merak_tp", "merak_core")
REPORT_FORMAT = 1
RESULT_PREFIX = "MERAK_GPU_RESULT "
THROUGHPUT_KEYS = ("tokens_per_s", "mfu")


def _child_env(threads: int) -> dict[str, str]:
    path = [str(p) for p in SOURCES] + [str(ROOT)]
    if os.environ.get("PYTHONPATH"):
        path.append(os.environ["PYTHONPATH"])
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(path),
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "PYTHONUNBUFFERED": "1",
    }


def _python() -> list[str]:
    return [sys.executable, *(["-S"] if sys.flags.no_site else [])]


def _run_check(name: str, command: list[str], threads: int, timeout_s: float, world: int) -> dict[str, Any]:
    """Run one check's process; its record for the report."""
    record: dict[str, Any] = {"check": name, "world": world, "threads": threads, "command": " ".join(command)}
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            command, cwd=ROOT, env=_child_env(threads), capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired as exc:
        record.update(status="timeout", seconds=time.perf_counter() - start)
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr or ""
        record["error"] = f"no result within {timeout_s:.0f} s\n{out[-2000:]}\n{err[-4000:]}"
        return record
    record["seconds"] = time.perf_counter() - start
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        record.update(status="failed", exit_code=proc.returncode)
        record["error"] = (proc.stderr or proc.stdout)[-6000:]
        return record
    result = json.loads(lines[-1].removeprefix(RESULT_PREFIX))
    record.update(status="passed", result=result)
    record["skipped_parts"] = list(result.get("skipped", []))
    for key in THROUGHPUT_KEYS:
        record[key] = {k: v for k, v in result.items() if k.endswith(key)} or None
    return record


def _host(device: str) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpu_count": os.cpu_count(),
        "device": device,
        "gpus": [],
    }
    if device == "cuda" and torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def _imports() -> dict[str, str]:
    """Where each Merak package was imported from (the check runs from the sources, not an install)."""
    import importlib

    return {name: str(Path(importlib.import_module(name).__file__ or "").parent) for name in PACKAGES}


def _plan(args: argparse.Namespace, devices: int) -> list[tuple[str, int]]:
    from tests.gpu import checks

    wanted = set(args.only.split(",")) if args.only else None
    if wanted:
        unknown = wanted - set(checks.SINGLE_CHECKS) - set(checks.MULTI_CHECKS)
        if unknown:
            raise SystemExit(f"--only names unknown checks {sorted(unknown)}")
    plan = [(name, 1) for name in checks.SINGLE_CHECKS if wanted is None or name in wanted]
    for name in checks.MULTI_CHECKS:
        if wanted is not None and name not in wanted:
            continue
        need, ranks = checks.MULTI_RANKS[name]
        plan.append((name, (ranks or devices) if devices >= need else 0))
    return plan


def _skipped(name: str, devices: int) -> dict[str, Any]:
    """The record of a multi-rank check that the machine has too few devices for."""
    from tests.gpu import checks

    need = checks.MULTI_RANKS[name][0]
    return {
        "check": name,
        "world": 0,
        "part": "multi",
        "status": "skipped",
        "error": f"needs {need} devices, this machine has {devices}",
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    devices = (
        args.nproc if args.nproc is not None else (torch.cuda.device_count() if args.device == "cuda" else 0)
    )
    threads = args.threads or os.cpu_count() or 1
    budgets = {"single": args.single_budget_s, "multi": args.multi_budget_s}
    used = {"single": 0.0, "multi": 0.0}
    records = []
    for name, world in _plan(args, devices):
        part = "single" if world == 1 else "multi"
        if world == 0:
            records.append(_skipped(name, devices))
            print(f"[gpu check] {name}: skipped: {records[-1]['error']}", flush=True)
            continue
        left = budgets[part] - used[part]
        if left <= 5:
            records.append(
                {"check": name, "world": world, "status": "skipped", "error": f"{part} budget spent"}
            )
            print(f"[gpu check] {name}: skipped: {part} budget spent", flush=True)
            continue
        main = ["-m", "tests.gpu.main", name, "--device", args.device, "--size", args.size]
        if world == 1:
            command = [*_python(), *main, "--threads", str(threads)]
            rank_threads = threads
        else:
            rank_threads = max(1, threads // world)
            command = [
                *_python(), "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                *main, "--threads", str(rank_threads),
            ]  # fmt: skip
        record = _run_check(name, command, rank_threads, left, world)
        record["part"] = part
        used[part] += record.get("seconds", left)
        records.append(record)
        print(
            f"[gpu check] {name} (world {world}): {record['status']} in {record.get('seconds', 0):.1f} s",
            flush=True,
        )
        for line in record.get("skipped_parts", []):
            print(f"[gpu check] {name}: skipped part: {line}", flush=True)
    return {
        "format": REPORT_FORMAT,
        "passed": all(r["status"] in ("passed", "skipped") for r in records)
        and any(r["status"] == "passed" for r in records),
        "size": args.size,
        "host": _host(args.device),
        "imports": _imports(),
        "nox_imported": "nox" in sys.modules,
        "budgets_s": budgets,
        "used_s": used,
        "checks": records,
    }


def markdown(report: dict[str, Any]) -> str:
    """The report as a Markdown page: the host, then one row per check."""
    host = report["host"]
    lines = [
        f"# GPU check: {'passed' if report['passed'] else 'FAILED'}",
        "",
        f"python {host['python']}, torch {host['torch']} (CUDA {host['cuda']}), device {host['device']}, "
        f"{len(host['gpus'])} GPU(s) {sorted(set(host['gpus']))}, {host['cpu_count']} CPU cores, size {report['size']}",
        "",
        "MFU: training FLOPs over the peak dense bf16 FLOP/s of the devices used (n/a: peak unknown, e.g. CPU).",
        "",
        "| check | ranks | status | seconds | tokens/s | MFU |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["checks"]:
        tps = r.get("tokens_per_s") or {}
        mfu = r.get("mfu") or {}
        lines.append(
            f"| {r['check']} | {r['world']} | {r['status']} | {r.get('seconds', 0):.1f} | "
            + ", ".join(f"{k}={v:.4g}" for k, v in tps.items() if isinstance(v, (int, float)))
            + " | "
            + ", ".join(f"{k}={v:.3f}" if isinstance(v, (int, float)) else f"{k}=n/a" for k, v in mfu.items())
            + " |"
        )
    skips = [
        f"- {r['check']}: {line}"
        for r in report["checks"]
        for line in ([r["error"]] if r["status"] == "skipped" else r.get("skipped_parts", []))
    ]
    if skips:
        lines += ["", "Skipped:", "", *skips]
    failures = [r for r in report["checks"] if r["status"] not in ("passed", "skipped")]
    for r in failures:
        lines += [
            "",
            f"## {r['check']}: {r['status']}",
            "",
            "```",
            str(r.get("error", "")).strip()[-3000:],
            "```",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.gpu.run", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for gpu_check.json and gpu_check.md")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument(
        "--size", default=None, choices=("full", "tiny"), help="default: full on cuda, tiny on cpu"
    )
    parser.add_argument("--only", default="", help="comma-separated check names (default: all)")
    parser.add_argument(
        "--nproc", type=int, default=None, help="ranks of the multi-rank checks (default: GPUs)"
    )
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (default: every core)")
    parser.add_argument("--single-budget-s", type=float, default=480.0)
    parser.add_argument("--multi-budget-s", type=float, default=600.0)
    args = parser.parse_args(argv)
    if args.size is None:
        args.size = "full" if args.device == "cuda" else "tiny"
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            f"the GPU check needs CUDA: torch {torch.__version__} sees no GPU (use --device cpu)",
            file=sys.stderr,
        )
        return 2
    report = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (args.out / "gpu_check.md").write_text(markdown(report))
    print(markdown(report), flush=True)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
