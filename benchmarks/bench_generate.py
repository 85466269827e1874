"""Decode speed of ``Trainer.generate`` at tp=2 and pp=2 against transformers' ``generate`` on one process.

A GPT-2 of about 110M parameters (vocabulary 32000, 768 wide, 12 layers; ``--quick``: about 6M) is
saved with ``save_pretrained`` (float32). In the same run:

- ``transformers``: ``from_pretrained`` + ``generate(do_sample=False)`` in this process (one thread);
- ``merak tp2`` and ``merak pp2`` (two gloo ranks each, one thread per rank, the test worker pool):
  ``Trainer(None, ..., pretrained=DIR)`` then ``trainer.generate`` of the same prompts, greedy; at
  pp=2 the batch is split into ``--microbatches`` microbatches.

Each is warmed up with a 2-token generation first. Reported per run: seconds, new tokens per second
(batch x new tokens / seconds), and for the pipeline the busy fraction of each stage (time inside the
stage's forward over the whole generate call) next to merak-pipe's simulation of the decode schedule
the decoder runs (``merak_pipe.decode_schedule``: steps overlap, each microbatch's next step starts
when its tokens are back on the first stage) with the measured mean forward time of each stage
(``simulated_busy``), the schedule's closed-form bound T·M / (T·M + S - 1) (T new tokens, M >= S
microbatches, S stages; equal stage costs, free messages) and, for comparison, M / (M + S - 1) of one
GPipe round per step; and whether the tokens equal transformers'. Measured below simulated is time
outside the forwards: the messages, sampling and Python.

Run: OMP_NUM_THREADS=1 python benchmarks/bench_generate.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def _config(quick: bool) -> Any:
    import transformers as tf

    if quick:
        return tf.GPT2Config(
            vocab_size=4000,
            n_embd=256,
            n_layer=4,
            n_head=8,
            n_positions=256,
            use_cache=False,
            bos_token_id=None,
            eos_token_id=None,
        )
    return tf.GPT2Config(
        vocab_size=32000,
        n_embd=768,
        n_layer=12,
        n_head=12,
        n_positions=512,
        use_cache=False,
        bos_token_id=None,
        eos_token_id=None,
    )


def _prompts(batch: int, length: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for row in range(batch):  # left padding of different lengths
        pad = (row * length) // (2 * batch)
        ids[row, :pad] = 0
        mask[row, :pad] = 0
    return ids, mask


class _Dataset(torch.utils.data.Dataset):
    def __init__(self, vocab: int) -> None:
        self.ids = torch.randint(1, vocab, (8, 16), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.ids[i],
            "attention_mask": torch.ones_like(self.ids[i]),
            "labels": self.ids[i],
        }


def _loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    logits = output.logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def merak_body(
    folder: str, layout: dict[str, int], batch: int, length: int, new: int, microbatches: int
) -> dict:
    """Rank body: build from the folder, warm up, time one generate; the stage's busy seconds."""
    from merak_core import Trainer
    from merak_core.config import TrainingArguments
    from merak_core.generation import decode

    torch.set_num_threads(1)
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="merak-bench-gen-"),
        per_device_train_batch_size=1,
        gradient_accumulation_steps=max(layout["pp"], 1),
        dtype="float32",
        seed=0,
        **layout,
    )
    vocab = int(json.loads((Path(folder) / "config.json").read_text())["vocab_size"])
    trainer = Trainer(None, args, _Dataset(vocab), loss_fn=_loss, pretrained=folder)
    busy = [0.0]
    calls = [0]
    build = decode._decoder

    def timed_decoder(model: Any, device: Any) -> Any:
        inner = build(model, device)

        class Timed:
            first, last = inner.first, inner.last

            def new_cache(self) -> Any:
                return inner.new_cache()

            def __call__(self, *a: Any) -> Any:
                t0 = time.perf_counter()
                out = inner(*a)
                busy[0] += time.perf_counter() - t0
                calls[0] += 1
                return out

        return Timed()

    decode._decoder = timed_decoder  # type: ignore[assignment]
    ids, mask = _prompts(batch, length, vocab)
    kwargs = {"num_microbatches": microbatches} if layout["pp"] > 1 else {}
    trainer.generate(ids, mask, max_new_tokens=2, **kwargs)  # warm-up
    busy[0], calls[0] = 0.0, 0
    t0 = time.perf_counter()
    out = trainer.generate(ids, mask, max_new_tokens=new, **kwargs)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "busy": busy[0], "calls": calls[0], "tokens": out.tolist()}


def simulated_busy(results: list[dict], microbatches: int, steps: int) -> list[float]:
    """Each stage's busy fraction in merak-pipe's simulator: the decode schedule the decoder interprets
    (``merak_pipe.decode_schedule(stages, microbatches, steps)``, steps overlapping) with each stage's
    measured mean forward seconds per call, free messages."""
    import merak_pipe

    forward = [r["busy"] / max(r["calls"], 1) for r in results]
    schedule = merak_pipe.decode_schedule(len(results), microbatches, steps)
    sim = merak_pipe.simulate(schedule, merak_pipe.CostModel(forward=forward))
    return [round(b / sim.makespan, 3) for b in sim.busy]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--json", default=None)
    a = parser.parse_args()
    import transformers as tf

    from tests.support.dist import run_on_ranks

    torch.set_num_threads(1)
    folder = Path(tempfile.mkdtemp(prefix="merak-bench-gen-")) / "gpt2"
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(_config(a.quick)).eval()
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(str(folder))
    ids, mask = _prompts(a.batch, a.prompt_len, model.config.vocab_size)
    greedy = dict(max_new_tokens=a.new, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
        t0 = time.perf_counter()
        reference = model.generate(input_ids=ids, attention_mask=mask, **greedy).tolist()
        hf_seconds = time.perf_counter() - t0
    rows = [{"run": "transformers (1 process)", "seconds": hf_seconds, "busy": None, "equal": True}]
    for name, layout in (("merak tp2", dict(dp=1, tp=2, pp=1)), ("merak pp2", dict(dp=1, tp=1, pp=2))):
        results = run_on_ranks(
            2, merak_body, str(folder), layout, a.batch, a.prompt_len, a.new, a.microbatches
        )
        seconds = max(r["seconds"] for r in results)
        rows.append(
            {
                "run": name,
                "seconds": seconds,
                "busy": [round(r["busy"] / r["seconds"], 3) for r in results] if layout["pp"] > 1 else None,
                "simulated": simulated_busy(results, a.microbatches, a.new) if layout["pp"] > 1 else None,
                "equal": all(r["tokens"] == reference for r in results),
            }
        )
    bound = a.microbatches / (a.microbatches + 2 - 1)  # a GPipe round per step
    items = a.microbatches * a.new
    overlapped = items / (items + 2 - 1) if a.microbatches >= 2 else a.microbatches / 2  # the decode schedule
    print(
        f"GPT-2 {params / 1e6:.1f}M params, batch {a.batch}, prompt {a.prompt_len}, {a.new} new tokens, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    print(
        f"{'run':28s} {'seconds':>8s} {'tokens/s':>9s}  {'stage busy':12s} {'simulated':12s} "
        f"(bound {overlapped:.2f}; a round per step: {bound:.2f})  equal"
    )
    for row in rows:
        tps = a.batch * a.new / row["seconds"]
        busy = "" if row["busy"] is None else " ".join(f"{b:.2f}" for b in row["busy"])
        sim = "" if row.get("simulated") is None else " ".join(f"{b:.2f}" for b in row["simulated"])
        print(
            f"{row['run']:28s} {row['seconds']:8.2f} {tps:9.1f}  {busy:12s} {sim:12s} {'':34s} {row['equal']}"
        )
    if a.json:
        Path(a.json).write_text(
            json.dumps({"params": params, "rows": rows, "round_bound": bound, "bound": overlapped}, indent=2)
        )


if __name__ == "__main__":
    main()
