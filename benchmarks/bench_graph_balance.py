"""Balance of pipeline stages on meta-built models with real shapes (merak_graph).

For GPT-2-small shapes at 24 layers (hidden 768, vocab 50257, sequence 1024) and
Llama-2-7B shapes (32 layers, hidden 4096, vocab 32000, sequence 4096), at 4 and
8 stages, prints the slowest-stage / mean-stage ratio of estimated
forward+backward time for:

- ``cost``: merak_graph's method="cost", the exact optimum of its shard chain, with the
  natural shards only (one per smallest-boundary position) and with partition()'s default
  (natural shards, refined to 24 per stage when their optimum is > 5% above the bound);
- ``bound``: the lower bound max(1, largest indivisible shard / mean);
- ``even layers``: the same number of layers per stage (embedding on the first, head on the last);
- ``size split``: torch.distributed.pipelining / PiPPy's ``split_into_equal_size`` policy (cut
  when the accumulated parameter size reaches total/stages), re-implemented here because
  torch 2.13 no longer ships it.

All three are evaluated with the same per-node cost estimates (flops and bytes
on meta tensors). Nothing is materialised. Usage:

    OMP_NUM_THREADS=1 PYTHONPATH=packages/merak-graph/src python benchmarks/bench_graph_balance.py [--quick]
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from merak_graph import annotate_costs, empty_init, partition_sharded, partition_traced, shard, trace  # noqa: E402
from tests.support.models import GPT, DecoderConfig, Llama  # noqa: E402

MODELS = {
    "gpt2-small-24L": (
        GPT,
        DecoderConfig(
            vocab_size=50257,
            hidden_size=768,
            num_layers=24,
            num_heads=12,
            num_kv_heads=12,
            intermediate_size=3072,
            max_seq_len=1024,
        ),
        1024,
    ),
    "llama2-7b": (
        Llama,
        DecoderConfig(
            vocab_size=32000,
            hidden_size=4096,
            num_layers=32,
            num_heads=32,
            num_kv_heads=32,
            intermediate_size=11008,
            max_seq_len=4096,
        ),
        4096,
    ),
}
_LAYER = re.compile(r"^(?:blocks|layers)\.(\d+)(?:\.|$)")


def _node_layer(node: torch.fx.Node) -> int | None:
    from merak_graph.sharding import module_path

    m = _LAYER.match(module_path(node))
    return int(m.group(1)) if m else None


def _ratio(stage_costs: list[float]) -> float:
    return max(stage_costs) / (sum(stage_costs) / len(stage_costs))


def _even_layers(gm: torch.fx.GraphModule, num_layers: int, num_stages: int) -> list[float]:
    costs = [0.0] * num_stages
    seen_layer = False
    for n in gm.graph.nodes:
        c = n.meta.get("merak_cost")
        if c is None:
            continue
        layer = _node_layer(n)
        if layer is None:
            stage = num_stages - 1 if seen_layer else 0
        else:
            seen_layer = True
            stage = layer * num_stages // num_layers
        costs[stage] += c.time_s
    return costs


def _size_split(gm: torch.fx.GraphModule, num_stages: int) -> list[float]:
    """PiPPy's split_into_equal_size: cut after the node where accumulated parameter bytes reach total/S.

    A parameter read through a get_attr node (export graphs) counts at its first compute user, as it
    would for the call_module node of an fx graph.
    """
    nodes = [n for n in gm.graph.nodes if "merak_cost" in n.meta and n.op not in ("placeholder", "output")]
    body = [n for n in nodes if n.op != "get_attr"]
    order = {n: i for i, n in enumerate(body)}
    size = {n: float(n.meta["merak_cost"].param_bytes) for n in body}
    for n in nodes:
        if n.op == "get_attr" and n.users:
            first = min((u for u in n.users if u in order), key=order.__getitem__, default=None)
            if first is not None:
                size[first] += n.meta["merak_cost"].param_bytes
    threshold = sum(size.values()) / num_stages
    costs = [0.0] * num_stages
    stage, acc = 0, 0.0
    for n in body:
        costs[stage] += n.meta["merak_cost"].time_s
        acc += size[n]
        if acc >= threshold and stage < num_stages - 1:
            stage, acc = stage + 1, 0.0
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="GPT-2 shapes only")
    parser.add_argument(
        "--tracer", default="export", choices=["export", "fx"], help="tracer (default export)"
    )
    args = parser.parse_args()
    names = ["gpt2-small-24L"] if args.quick else list(MODELS)
    rows = []
    for name in names:
        cls, cfg, seq = MODELS[name]
        t0 = time.perf_counter()
        with empty_init():
            model = cls(cfg)
        inputs = (torch.zeros(1, seq, dtype=torch.long, device="meta"),)
        gm = trace(model, example_inputs=inputs, method=args.tracer)
        annotate_costs(gm, inputs)
        prep = time.perf_counter() - t0
        for num_stages, per_stage in ((4, 0), (4, None), (8, 0), (8, None)):
            t1 = time.perf_counter()
            if per_stage == 0:  # natural cuts only
                part = partition_sharded(shard(gm, model=model), num_stages, model=model)
            elif per_stage is None:  # the default of merak_graph.partition (natural cuts, refined if coarse)
                part = partition_traced(gm, num_stages, model=model, method="cost")
            else:
                part = partition_sharded(
                    shard(gm, per_stage * num_stages, model=model), num_stages, model=model
                )
            sharded = part.sharded
            elapsed = time.perf_counter() - t1
            costs = part.stage_costs
            mean = sum(costs) / len(costs)
            bound = max(1.0, max(s.time_s for s in sharded.shards) / mean)
            boundary = max(sum(b.nbytes for b in cut) for cut in part.boundaries) / 2**20
            label = {0: "natural", None: "default"}.get(per_stage, str(per_stage))
            rows.append(
                (
                    f"{name} ({label})",
                    num_stages,
                    len(sharded.shards),
                    boundary,
                    _ratio(costs),
                    bound,
                    _ratio(_even_layers(gm, cfg.num_layers, num_stages)),
                    _ratio(_size_split(gm, num_stages)),
                    prep + elapsed,
                )
            )
    print(
        "| model | stages | shards | max stage boundary MiB | cost (ours) | lower bound | cost/bound | even layers | "
        "size split (PiPPy) | seconds |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, s, k, mib, ours, bound, even, size, secs in rows:
        print(
            f"| {name} | {s} | {k} | {mib:.0f} | {ours:.3f} | {bound:.3f} | {ours / bound:.3f} | {even:.3f} | "
            f"{size:.3f} | {secs:.1f} |"
        )
    print("ratios are slowest-stage / mean-stage estimated fwd+bwd time; 1.000 is perfect balance")


if __name__ == "__main__":
    main()
