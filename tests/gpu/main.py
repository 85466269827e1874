"""Run one GPU check in this process (``python -m tests.gpu.main CHECK``, or under torchrun).

Single-rank checks initialise a one-rank default group with the backend ``cpu:gloo,cuda:nccl``
(the checks compare against float32 runs on the CPU in the same process); multi-rank checks use
``merak_core.init``'s defaults (NCCL on CUDA). The result is printed as one line
``MERAK_GPU_RESULT <json>`` on rank 0; the exit status is non-zero on any failure.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.gpu.main")
    parser.add_argument("check")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", default="full", choices=("full", "tiny"))
    parser.add_argument(
        "--threads", type=int, default=0, help="CPU threads for the CPU references (default: every core)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")

    import torch
    import torch.distributed as dist

    # Whatever OMP_NUM_THREADS this process inherited (the test suite sets 1): the CPU float32
    # references of a full-size check need the host's cores.
    torch.set_num_threads(args.threads or os.cpu_count() or 1)

    from merak_core.parallel.layout import ensure_process_group
    from tests.gpu import checks

    single = args.check in checks.SINGLE_CHECKS
    if not single and args.check not in checks.MULTI_CHECKS:
        parser.error(
            f"unknown check {args.check!r}: one of {sorted({**checks.SINGLE_CHECKS, **checks.MULTI_CHECKS})}"
        )
    device = ensure_process_group(
        args.device, backend="cpu:gloo,cuda:nccl" if single and args.device != "cpu" else None
    )
    fn = (checks.SINGLE_CHECKS if single else checks.MULTI_CHECKS)[args.check]
    start = time.perf_counter()
    result = fn(str(device), args.size)
    result["seconds"] = time.perf_counter() - start
    result["torch"] = torch.__version__
    result["threads"] = torch.get_num_threads()
    if dist.get_rank() == 0:
        print(
            "MERAK_GPU_RESULT "
            + json.dumps({"check": args.check, "world": dist.get_world_size(), **result}, default=str),
            flush=True,
        )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
