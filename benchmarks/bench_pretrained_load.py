"""Memory and time of loading a Hugging Face folder into a 3D layout: ``model.pretrained`` vs the full model.

The benchmark makes a GPT-2 of about 110M parameters (vocabulary 32000, 768 wide, 12 layers;
``--quick``: about 6M) with ``save_pretrained`` (float32, one ``model.safetensors``) and loads it
at pp=4 and at tp=2 x pp=2 (4 ranks, gloo, fresh processes for every run) in two ways:

- ``pretrained``: the ``model.pretrained`` path: the model built on the meta device from
  ``config.json``, partitioned, this rank's stage materialised and filled with its TP slices
  (``merak_core.hf``);
- ``full``: every rank calls ``transformers.AutoModelForCausalLM.from_pretrained`` and the
  model is then partitioned (what a factory returning ``from_pretrained(...)`` does).

Each rank first builds and partitions the meta model once, unmeasured (imports, the first
torch.export), frees it and returns the freed heap to the kernel (``malloc_trim``), then the
measured load. Per rank it reports the seconds (meta build / from_pretrained, tracing and partitioning,
loading; the same tracing in both), and the peak memory two ways, both as the increase over
the rank's RSS just before loading (after imports and the process group):

- ``hwm``: the kernel's RSS high-water mark (``VmHWM``): anonymous memory plus the file pages
  of the memory-mapped safetensors file the rank touched while they were mapped;
- ``anon``: the peak of the anonymous RSS (``RssAnon``, sampled every millisecond by a thread),
  i.e. tensors and other heap, without page cache.

Target (``pretrained``): peak <= 1.3 x (the rank's own parameter bytes + the largest tensor of
the model). The script prints a table, the ratios, the load average and writes ``--json``.

``--resume``: instead, a Merak checkpoint of the same GPT-2 (float32 AdamW, one step saved by a
Trainer) resumed by a new Trainer at tp=2 (``tp2``: GPT-2's ``c_attn`` is a fused q/k/v, three
sections) and at ZeRO-3 over dp=2 (``zero3_dp2``), 2 ranks each; per rank the same two peaks during
``resume`` (over the RSS just before it, which holds the rank's parameters), against the target
share + largest tensor, the share being the rank's parameters and optimizer states as it holds them
([Note: bounded checkpoint loads] in ``merak_core.checkpoint.regions``).

Run: OMP_NUM_THREADS=1 python benchmarks/bench_pretrained_load.py [--quick] [--resume] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAYOUTS = {"pp4": (4, 1), "tp2_pp2": (2, 2)}
"""name -> (pp, tp)."""
RESUME_LAYOUTS = {"tp2": {"tp": 2}, "zero3_dp2": {"dp": 2, "zero_stage": 3}}
"""name -> the Trainer's layout keys (2 ranks each)."""
SEQ = 8


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


class _AnonPeak:
    """Samples RssAnon every millisecond in a thread; ``peak`` in bytes."""

    def __init__(self) -> None:
        self.peak = _status_kb("RssAnon") * 1024
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _status_kb("RssAnon") * 1024)
            time.sleep(0.001)

    def __enter__(self) -> _AnonPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _status_kb("RssAnon") * 1024)


def _trim_heap() -> None:
    """Give freed heap back to the kernel (glibc ``malloc_trim``), so later allocations show in the RSS."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: the measured increase may then be an underestimate
        pass


def make_folder(out: Path, quick: bool) -> tuple[int, int]:
    """Save the benchmark's GPT-2 under ``out``; (parameters, bytes of the largest tensor)."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    if quick:
        cfg = tf.GPT2Config(
            vocab_size=8000,
            n_embd=256,
            n_layer=4,
            n_head=8,
            n_positions=128,
            use_cache=False,
            bos_token_id=0,
            eos_token_id=0,
        )
    else:
        cfg = tf.GPT2Config(
            vocab_size=32000,
            n_embd=768,
            n_layer=12,
            n_head=12,
            n_positions=1024,
            use_cache=False,
            bos_token_id=0,
            eos_token_id=0,
        )
    model = tf.GPT2LMHeadModel(cfg)
    model.save_pretrained(str(out))
    params = dict(model.named_parameters())
    return sum(p.numel() for p in params.values()), max(p.numel() * p.element_size() for p in params.values())


def _rank(
    rank: int, world: int, store: str, folder: str, mode: str, pp: int, tp: int, result_dir: str
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    import transformers as tf

    import merak_core
    from merak_core.hf import PretrainedWeights, pretrained_model, skip_init
    from merak_core.parallel.compose import build_parallel_model

    layout = merak_core.init(dp=1, tp=tp, pp=pp)
    example = {
        "input_ids": torch.zeros(1, SEQ, dtype=torch.long),
        "attention_mask": torch.ones(1, SEQ, dtype=torch.long),
    }
    # Warm-up, identical in both modes and not measured: the imports, the first torch.export and the
    # partitioner's caches (a meta model, so no weights), which would otherwise count as load memory.
    build_parallel_model(
        pretrained_model(folder), layout, example_inputs=example, init_fn=skip_init, device="cpu"
    )
    gc.collect()
    _trim_heap()
    dist.barrier()
    rss0, anon0 = _status_kb("VmRSS") * 1024, _status_kb("RssAnon") * 1024
    hwm_before = _status_kb("VmHWM") * 1024
    times: dict[str, float] = {}
    with _AnonPeak() as anon:
        t0 = time.perf_counter()
        if mode == "pretrained":
            model = pretrained_model(folder)
            weights = PretrainedWeights.match(model, folder)
        else:
            model = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        t1 = time.perf_counter()
        pm = build_parallel_model(model, layout, example_inputs=example, init_fn=skip_init, device="cpu")
        del model
        t2 = time.perf_counter()
        if mode == "pretrained":
            weights.load_into(pm)
        t3 = time.perf_counter()
    times = {"build_s": t1 - t0, "partition_s": t2 - t1, "load_s": t3 - t2, "total_s": t3 - t0}
    own = sum(p.numel() * p.element_size() for p in {id(p): p for _, p in pm.named_parameters()}.values())
    hwm = _status_kb("VmHWM") * 1024
    record = {
        "rank": rank,
        "mode": mode,
        "pp": pp,
        "tp": tp,
        "own_bytes": own,
        **times,
        "hwm_bytes": hwm - rss0,
        "anon_bytes": anon.peak - anon0,
        "rss_before": rss0,
        "hwm_before_load_over_rss": hwm_before - rss0,
    }
    Path(result_dir, f"{mode}_{pp}_{tp}_{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


class _Tokens:
    """Random next-token samples for the resume benchmark's one saved step."""

    def __init__(self, vocab: int) -> None:
        import torch

        self.ids = torch.randint(0, vocab, (8, SEQ + 1), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.ids[i, :-1], "labels": self.ids[i, 1:]}


def _lm_loss(output: Any, labels: Any) -> Any:
    import torch

    logits = getattr(output, "logits", output)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))


def _resume_rank(rank: int, store: str, folder: str, name: str, out_dir: str, result_dir: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    import transformers as tf

    from merak_core import Trainer, TrainingArguments
    from merak_core.checkpoint.specs import tensor_specs
    from merak_core.parallel.fsdp import local_tensor

    def trainer(max_steps: int) -> Any:
        model = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        args = TrainingArguments(
            output_dir=out_dir, max_steps=max_steps, save_steps=1, dtype="float32", logging_steps=1,
            per_device_train_batch_size=2, **RESUME_LAYOUTS[name],
        )  # fmt: skip
        return Trainer(model, args, _Tokens(model.config.vocab_size), loss_fn=_lm_loss)

    trainer(1).train()  # saves step 1
    run = trainer(2)
    gc.collect()
    _trim_heap()
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts from the current RSS
    rss0, anon0 = _status_kb("VmRSS") * 1024, _status_kb("RssAnon") * 1024
    with _AnonPeak() as anon:
        t0 = time.perf_counter()
        run.resume("latest")
        seconds = time.perf_counter() - t0
    hwm = _status_kb("VmHWM") * 1024
    params = {id(p): p for p in run.model.module.parameters()}.values()
    states = [t for s in run.engine.optimizer.state.values() for t in s.values()]
    share = sum(local_tensor(t).numel() * t.element_size() for t in [*params, *states])
    largest = max(
        math.prod(spec.full_shape) * p.element_size()
        for p, spec in tensor_specs(run.checkpoint_parts).values()
    )
    record = {
        "rank": rank,
        "layout": name,
        "share_bytes": share,
        "largest_bytes": largest,
        "hwm_bytes": hwm - rss0,
        "anon_bytes": anon.peak - anon0,
        "resume_s": seconds,
    }
    Path(result_dir, f"resume_{name}_{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


def run_resume(folder: Path, name: str, result_dir: Path) -> list[dict[str, Any]]:
    import torch.multiprocessing as tmp

    with tempfile.TemporaryDirectory() as d:
        tmp.spawn(
            _resume_rank,
            args=(os.path.join(d, "store"), str(folder), name, os.path.join(d, "out"), str(result_dir)),
            nprocs=2,
        )
    return [json.loads((result_dir / f"resume_{name}_{r}.json").read_text()) for r in range(2)]


def resume_table(records: list[dict[str, Any]]) -> None:
    print(
        f"{'layout':10} {'rank':>4} {'share MB':>9} {'hwm MB':>8} {'anon MB':>8} {'target MB':>9} {'hwm/tgt':>7} {'s':>6}"
    )
    for r in records:
        target = r["share_bytes"] + r["largest_bytes"]
        r["target_bytes"] = target
        print(
            f"{r['layout']:10} {r['rank']:>4} {r['share_bytes'] / 1e6:9.1f} {r['hwm_bytes'] / 1e6:8.1f} "
            f"{r['anon_bytes'] / 1e6:8.1f} {target / 1e6:9.1f} {r['hwm_bytes'] / target:7.2f} {r['resume_s']:6.2f}"
        )
    ok = all(r["hwm_bytes"] <= r["target_bytes"] for r in records)
    print(f"every rank within share + largest tensor (hwm): {ok}")


def run_layout(folder: Path, mode: str, pp: int, tp: int, result_dir: Path) -> list[dict[str, Any]]:
    import torch.multiprocessing as tmp

    world = pp * tp
    with tempfile.TemporaryDirectory() as d:
        tmp.spawn(
            _rank,
            args=(world, os.path.join(d, "store"), str(folder), mode, pp, tp, str(result_dir)),
            nprocs=world,
        )
    return [json.loads((result_dir / f"{mode}_{pp}_{tp}_{r}.json").read_text()) for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a ~6M-parameter model instead of ~110M")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {sorted(LAYOUTS)}")
    parser.add_argument("--json", default=None, help="write every rank's record here")
    parser.add_argument(
        "--resume", action="store_true", help="resume a Merak checkpoint at tp2 and zero3_dp2"
    )
    args = parser.parse_args()
    load_start = os.getloadavg()
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="merak-bench-load-") as d:
        folder = Path(d) / "gpt2"
        num_params, largest = make_folder(folder, args.quick)
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        print(
            f"GPT-2 with {num_params / 1e6:.1f}M parameters, {size / 1e6:.0f} MB of safetensors; "
            f"largest tensor {largest / 1e6:.1f} MB"
        )
        if args.resume:
            for name in RESUME_LAYOUTS:
                records += run_resume(folder, name, Path(d))
            resume_table(records)
            print(f"load average (1, 5, 15 min): start {load_start}, end {os.getloadavg()}")
            if args.json:
                Path(args.json).write_text(json.dumps({"params": num_params, "records": records}, indent=1))
            return
        for name in args.layouts.split(","):
            pp, tp = LAYOUTS[name]
            for mode in ("pretrained", "full"):
                records += run_layout(folder, mode, pp, tp, Path(d))
    load_end = os.getloadavg()
    print(
        f"{'layout':8} {'mode':10} {'rank':>4} {'own MB':>8} {'hwm MB':>8} {'anon MB':>8} "
        f"{'target MB':>9} {'hwm/tgt':>7} {'anon/tgt':>8} {'seconds':>8} {'load s':>7}"
    )
    for r in records:
        target = 1.3 * (r["own_bytes"] + largest)
        r["target_bytes"] = target
        print(
            f"{'pp' + str(r['pp']) + ('_tp' + str(r['tp']) if r['tp'] > 1 else ''):8} {r['mode']:10} "
            f"{r['rank']:>4} {r['own_bytes'] / 1e6:8.1f} {r['hwm_bytes'] / 1e6:8.1f} {r['anon_bytes'] / 1e6:8.1f} "
            f"{target / 1e6:9.1f} {r['hwm_bytes'] / target:7.2f} {r['anon_bytes'] / target:8.2f} "
            f"{r['total_s']:8.2f} {r['load_s'] + r['build_s']:7.2f}"
        )
    for name in args.layouts.split(","):
        pp, tp = LAYOUTS[name]
        mine = [r for r in records if (r["pp"], r["tp"]) == (pp, tp)]
        peak = {m: max(r["hwm_bytes"] for r in mine if r["mode"] == m) for m in ("pretrained", "full")}
        secs = {m: max(r["total_s"] for r in mine if r["mode"] == m) for m in ("pretrained", "full")}
        ok = all(r["hwm_bytes"] <= r["target_bytes"] for r in mine if r["mode"] == "pretrained")
        print(
            f"{name}: max peak (hwm) pretrained/full = {peak['pretrained'] / peak['full']:.2f}, "
            f"slowest rank seconds pretrained/full = {secs['pretrained'] / secs['full']:.2f}; "
            f"every pretrained rank within target (hwm): {ok}"
        )
    print(f"load average (1, 5, 15 min): start {load_start}, end {load_end}; {os.cpu_count()} CPUs")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "params": num_params,
                    "largest_tensor_bytes": largest,
                    "loadavg": [load_start, load_end],
                    "records": records,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
