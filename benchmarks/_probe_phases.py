"""Probe for docs/cluster.md: where a step of the demo (examples/addition) spends its time, per rank
and phase of ``ParallelEngine.step`` (the pipeline, the DP gradient all-reduce, the gradient norm,
the loss all-reduce, the optimizer; clipping, the learning-rate schedule) and between steps (the
data loader, the records), on the fork pool's gloo ranks, optionally each rank pinned to its own core.

Per phase, the median over the measured steps of: the main thread's CPU time (``thread_time``), wall
time, minor page faults, voluntary and involuntary context switches (``getrusage`` of the thread).

    OMP_NUM_THREADS=1 python benchmarks/_probe_phases.py dp1,dp2,pp2,dp1m1 nopin,pin
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def _full() -> tuple[float, ...]:
    import resource

    ru = resource.getrusage(resource.RUSAGE_THREAD)
    return (time.thread_time(), time.perf_counter(), ru.ru_minflt, ru.ru_nvcsw, ru.ru_nivcsw)


def _snap() -> tuple[float, ...]:
    return _full()


def _body(overrides: list[str], steps: int, warm: int, pin: bool, out_dir: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from _cluster_steps import _build_trainer

    rank = dist.get_rank()
    if pin:
        os.sched_setaffinity(0, {rank % os.cpu_count()})
    torch.set_num_threads(1)
    trainer = _build_trainer(overrides, steps, out_dir)
    eng = trainer.engine
    acc: dict[str, list[float]] = defaultdict(lambda: [0.0] * 5)
    steps_rows: list[dict[str, list[float]]] = []
    orig_phase = eng._phase

    @contextlib.contextmanager
    def phase(what: str, step: int, **kw: Any) -> Any:
        key = what.split(" over")[0].split(" (")[0]
        s0 = _snap()
        with orig_phase(what, step, **kw):
            yield
        s1 = _snap()
        row = acc[key]
        for i in range(5):
            row[i] += s1[i] - s0[i]

    eng._phase = phase  # type: ignore[method-assign]
    import gc

    gc_t = [0.0, 0.0]

    def gc_cb(ph: str, info: dict) -> None:
        if ph == "start":
            gc_t[1] = time.thread_time()
        else:
            acc["gc"][0] += time.thread_time() - gc_t[1]
            acc["gc"][2] += 1

    gc.callbacks.append(gc_cb)

    def wrap(obj: Any, name: str, key: str) -> None:
        fn = getattr(obj, name)

        def w(*a: Any, **k: Any) -> Any:
            s0 = _snap()
            out = fn(*a, **k)
            s1 = _snap()
            for i in range(5):
                acc[key][i] += s1[i] - s0[i]
            return out

        setattr(obj, name, w)

    from merak_core.run import engine as em

    wrap(em, "scale_gradients_", "clip scale")
    wrap(eng.lr_scheduler, "step", "lr schedule")
    wrap(eng, "_fill_missing_grads", "fill grads")
    wrap(eng, "stage_inputs", "stage_inputs")
    if eng.dp_sync is not None:
        wrap(eng.dp_sync, "prepare_step", "dp prepare")
    # the optimizer step wrapped separately from clipping inside _apply_update
    inner = trainer._step
    last = [None]

    def timed(*a: Any, **k: Any) -> Any:
        acc.clear()
        s0 = _full()
        out = inner(*a, **k)
        s1 = _full()
        row = {k2: list(v) for k2, v in acc.items()}
        row["step"] = [s1[i] - s0[i] for i in range(5)]
        if last[0] is not None:
            row["between"] = [s0[i] - last[0][i] for i in range(5)]
        last[0] = s1
        steps_rows.append(row)
        return out

    trainer._step = timed  # type: ignore[method-assign]
    trainer.train()
    dist.barrier()
    return {"rows": steps_rows[warm:], "affinity": sorted(os.sched_getaffinity(0))}


def _layout(dp: int, pp: int, mbs: int, m: int) -> list[str]:
    return [
        f"training.dp={dp}",
        "training.tp=1",
        f"training.pp={pp}",
        f"training.per_device_train_batch_size={mbs}",
        f"training.gradient_accumulation_steps={m}",
    ]


CONFIGS = {
    "dp1": _layout(1, 1, 16, 4),
    "dp2": _layout(2, 1, 16, 2),
    "pp2": _layout(1, 2, 16, 4),
    "dp1m1": _layout(1, 1, 1, 1),
}


def main() -> None:
    from tests.support.dist import run_on_ranks

    names = sys.argv[1].split(",")
    pins = [p == "pin" for p in sys.argv[2].split(",")]
    steps, warm = 14, 4
    print(os.popen("uptime").read().strip())
    for pin in pins:
        for name in names:
            ov = CONFIGS[name]
            world = 2 if ("dp2" in name or "pp2" in name) else 1
            with tempfile.TemporaryDirectory() as tmp:
                per_rank = run_on_ranks(world, _body, ov, steps, warm, pin, tmp)
            print(f"== {name} pin={pin} affinity={[r['affinity'] for r in per_rank]}")
            for r, res in enumerate(per_rank):
                keys = sorted({k for row in res["rows"] for k in row})
                for k in keys:
                    vals = [row[k] for row in res["rows"] if k in row]
                    med = [statistics.median(v[i] for v in vals) for i in range(5)]
                    print(
                        f"  rank{r} {k:28s} cpu {med[0] * 1e3:7.2f} wall {med[1] * 1e3:7.2f} "
                        f"minflt {med[2]:6.0f} vol {med[3]:4.0f} invol {med[4]:4.0f}"
                    )
    print(os.popen("uptime").read().strip())


if __name__ == "__main__":
    main()
