"""What a training run shows and leaves behind, on global rank 0 only.

- a progress line every ``logging_steps``: step / total, a bar, loss, learning
  rate, tokens/s and step time (plain text, so it reads the same in a terminal
  and in a log file);
- ``metrics.jsonl`` in ``output_dir``: one JSON object per logged record (NaN and infinities
  written as ``null``, so every line is valid JSON). A resumed run keeps the records up to the
  step it resumed from and appends after them (records of later steps, from the interrupted
  segment, are dropped first), so the file, the plot and :meth:`MetricsWriter.summary` cover the
  whole run;
- TensorBoard scalars when ``torch.utils.tensorboard`` (the ``tensorboard``
  package) is installed;
- ``loss.png`` at the end: the loss curve (needs matplotlib, the ``plot`` extra;
  without it the run says so and skips the picture).
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any

from merak_core.nonfinite import json_safe

logger = logging.getLogger(__name__)

_BAR = 24


class MetricsWriter:
    """Rank-0 sink for training records (no-op on other ranks)."""

    def __init__(self, output_dir: str, *, enabled: bool) -> None:
        self.output_dir = output_dir
        self.enabled = enabled
        self.total = 0
        self.records: list[dict[str, Any]] = []
        self._tb: Any = None
        self.path = os.path.join(output_dir, "metrics.jsonl")
        if enabled:
            os.makedirs(output_dir, exist_ok=True)

    def start(self, total_steps: int, *, resumed_step: int = 0) -> None:
        """Open the run: a fresh ``metrics.jsonl``, or (``resumed_step > 0``) the earlier records up to that step."""
        self.total = total_steps
        if not self.enabled:
            return
        self.records = self._earlier_records(resumed_step) if resumed_step > 0 else []
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            for record in self.records:
                f.write(json.dumps(json_safe(record), allow_nan=False) + "\n")
        os.replace(tmp, self.path)
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(os.path.join(self.output_dir, "tensorboard"))
        except Exception:  # noqa: BLE001 - TensorBoard is optional
            self._tb = None

    def _earlier_records(self, resumed_step: int) -> list[dict[str, Any]]:
        """The records of ``metrics.jsonl`` at steps up to ``resumed_step`` (a torn last line is skipped)."""
        if not os.path.exists(self.path):
            return []
        kept = []
        with open(self.path) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(record, dict) and int(record.get("step", 0)) <= resumed_step:
                    kept.append(record)
        return kept

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.records.append(dict(record))
        with open(self.path, "a") as f:
            f.write(json.dumps(json_safe(record), allow_nan=False) + "\n")
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, record.get("step", 0))
        print(self._line(record), flush=True)

    def _line(self, r: dict[str, Any]) -> str:
        step = int(r.get("step", 0))
        if "loss" not in r:
            rest = "  ".join(f"{k} {v:.4f}" for k, v in r.items() if k != "step" and isinstance(v, float))
            return f"step {step:>{len(str(self.total))}}/{self.total}  eval  {rest}"
        done = min(_BAR, round(_BAR * step / max(1, self.total)))
        bar = "=" * done + (">" if done < _BAR else "") + " " * max(0, _BAR - done - 1)
        parts = [f"step {step:>{len(str(self.total))}}/{self.total} [{bar}]", f"loss {r['loss']:.4f}",
                 f"lr {r.get('lr', 0.0):.2e}"]
        if r.get("skipped"):
            parts.append(f"SKIPPED (non-finite; {r.get('skipped_steps', 1)} so far)")
        if "tokens_per_s" in r:
            parts.append(f"{r['tokens_per_s']:,.0f} tok/s")
        parts.append(f"{r.get('step_time_s', 0.0) * 1e3:.0f} ms/step")
        return "  ".join(parts)

    def finish(self) -> str | None:
        """Close TensorBoard and draw ``loss.png``; returns its path (None when not drawn)."""
        if not self.enabled:
            return None
        if self._tb is not None:
            self._tb.close()
        points = [(r["step"], r["loss"]) for r in self.records
                  if isinstance(r.get("loss"), float) and math.isfinite(r["loss"])]
        if not points:
            return None
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            logger.warning("matplotlib is not installed (pip install 'merak-core[plot]'): no loss.png drawn")
            return None
        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
        ax.plot([p[0] for p in points], [p[1] for p in points], lw=1.5)
        evals = [(r["step"], r["eval_loss"]) for r in self.records if "eval_loss" in r]
        if evals:
            ax.plot([p[0] for p in evals], [p[1] for p in evals], "o", label="eval loss")
            ax.legend()
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = os.path.join(self.output_dir, "loss.png")
        fig.savefig(path)
        plt.close(fig)
        return path

    def summary(self) -> dict[str, Any]:
        """First and last training loss of the whole run (every segment), and the skipped non-finite steps."""
        losses = [r for r in self.records if "loss" in r]
        return {"first_loss": losses[0]["loss"] if losses else None,
                "final_loss": losses[-1]["loss"] if losses else None,
                "skipped_steps": sum(1 for r in losses if r.get("skipped"))}
