"""Partitioning huge models without materialising them (merak_graph).

Llama-70B shapes (80 layers, hidden 8192, vocab 128256, sequence 4096) into 8
stages and Llama-405B shapes (126 layers, hidden 16384, vocab 128256) into 16
stages: build under ``empty_init()``, trace, cost-annotate, shard and partition,
each configuration in a fresh process so the peak resident memory (ru_maxrss)
is its own. Both tracers are measured. "total s" is wall time of the five steps;
"process CPU s" is the whole process's user+system CPU time (imports included),
which a busy machine inflates less than wall time. Usage:

    OMP_NUM_THREADS=1 PYTHONPATH=packages/merak-graph/src python benchmarks/bench_graph_scale.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CONFIGS = {
    "llama-70b": (
        dict(
            vocab_size=128256,
            hidden_size=8192,
            num_layers=80,
            num_heads=64,
            num_kv_heads=8,
            intermediate_size=28672,
            max_seq_len=4096,
        ),
        8,
    ),
    "llama-405b": (
        dict(
            vocab_size=128256,
            hidden_size=16384,
            num_layers=126,
            num_heads=128,
            num_kv_heads=8,
            intermediate_size=53248,
            max_seq_len=4096,
        ),
        16,
    ),
}


def _one(name: str, method: str) -> dict[str, float]:
    sys.path.insert(0, str(ROOT))
    import torch

    from merak_graph import annotate_costs, empty_init, is_meta_module, partition_traced, trace
    from tests.support.models import DecoderConfig, Llama

    cfg_kwargs, num_stages = CONFIGS[name]
    times: dict[str, float] = {}
    t = time.perf_counter()
    with empty_init():
        model = Llama(DecoderConfig(**cfg_kwargs))
    times["build"] = time.perf_counter() - t
    inputs = (torch.zeros(1, cfg_kwargs["max_seq_len"], dtype=torch.long, device="meta"),)
    t = time.perf_counter()
    gm = trace(model, example_inputs=inputs, method=method)
    times["trace"] = time.perf_counter() - t
    t = time.perf_counter()
    annotate_costs(gm, inputs)
    times["annotate"] = time.perf_counter() - t
    t = time.perf_counter()
    part = partition_traced(gm, num_stages, model=model, method="cost")  # partition()'s default sharding
    times["shard+partition"] = time.perf_counter() - t
    sharded = part.sharded
    assert is_meta_module(model)
    costs = part.stage_costs
    params = sum(p.numel() for p in model.parameters())
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {
        **times,
        "total": sum(times.values()),
        "cpu": usage.ru_utime + usage.ru_stime,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "params_b": params / 1e9,
        "shards": len(sharded.shards),
        "stages": num_stages,
        "ratio": max(costs) / (sum(costs) / len(costs)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Llama-70B shapes with fx only")
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "METHOD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(_one(*args.one)))
        return
    runs = (
        [("llama-70b", "fx")]
        if args.quick
        else [("llama-70b", "fx"), ("llama-70b", "export"), ("llama-405b", "fx"), ("llama-405b", "export")]
    )
    print(
        "| model | params | stages | tracer | build s | trace s | annotate s | shard+partition s | total s "
        "| process CPU s | peak RSS GiB | shards | slowest/mean |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, method in runs:
        out = subprocess.run(
            [sys.executable, __file__, "--one", name, method],
            capture_output=True,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            check=False,
        )
        if out.returncode != 0:
            print(f"| {name} | - | - | {method} | failed: {out.stderr.strip().splitlines()[-1][:80]} |")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"| {name} | {r['params_b']:.1f}B | {r['stages']} | {method} | {r['build']:.1f} | {r['trace']:.1f} | "
            f"{r['annotate']:.1f} | {r['shard+partition']:.1f} | {r['total']:.1f} | {r['cpu']:.1f} | "
            f"{r['peak_rss_gib']:.2f} | {r['shards']} | {r['ratio']:.3f} |"
        )


if __name__ == "__main__":
    main()
