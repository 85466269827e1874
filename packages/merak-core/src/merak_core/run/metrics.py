"""What a training run shows and leaves behind, on global rank 0 only.

- a progress line every ``logging_steps``: step / total, a bar, loss, learning
  rate, gradient norm (before clipping; when ``max_grad_norm > 0``, which computes it),
  tokens/s, step time and the estimated time left (plain text, so it reads the same in a
  terminal and in a log file; see [Note: ETA]);
- ``metrics.jsonl`` in ``output_dir``: one JSON object per logged record (NaN and infinities
  written as ``null``, so every line is valid JSON). A resumed run keeps the records up to the
  step it resumed from and appends after them (records of later steps, from the interrupted
  segment, are dropped first), so the file, the plot and :meth:`MetricsWriter.summary` cover the
  whole run;
- the same scalars to the reporters of ``training.report_to`` (:mod:`merak_core.run.reporting`):
  TensorBoard event files by default when the ``tensorboard`` package is installed (the
  ``tensorboard`` extra), Weights & Biases (the ``wandb`` extra);
- ``loss.png`` at the end: the loss curve (needs matplotlib, the ``plot`` extra;
  without it the run says so and skips the picture).

[Note: ETA] The time left is the mean wall time per step since the first logged step of this
run segment (so tracing, the first step's warm-up and a resume's loading are not counted),
times the steps left; on that first record, its own step time times the steps left. Written
``ETA 1:02:03`` (hours) or ``ETA 2:03`` (minutes and seconds).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from merak_core.run import reporting
from merak_core.run.nonfinite import json_safe

logger = logging.getLogger(__name__)

_BAR = 24


class MetricsWriter:
    """Rank-0 sink for training records (no-op on other ranks)."""

    def __init__(
        self,
        output_dir: str,
        *,
        enabled: bool,
        clock: Callable[[], float] = time.monotonic,
        report_to: Sequence[str] | None = None,
        run_config: Mapping[str, Any] | None = None,
    ) -> None:
        """``report_to``: the run's ``training.report_to`` (see [Note: report_to]); ``run_config``: the
        arguments a reporter records with the run (W&B's ``config``)."""
        self.output_dir = output_dir
        self.enabled = enabled
        self.total = 0
        self.records: list[dict[str, Any]] = []
        self._reporters: list[reporting.Reporter] = []
        self._report_to = report_to
        self._run_config = run_config
        self._clock = clock
        self._anchor: tuple[float, int] | None = None
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
        self._anchor = None
        self._reporters = reporting.open_reporters(
            self.output_dir, self._report_to, resumed_step=resumed_step, config=self._run_config
        )

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
        for reporter in self._reporters:
            reporter.write(record)
        print(self._line(record), flush=True)

    def log_text(self, tag: str, text: str, step: int) -> None:
        """``text`` at ``step`` to the reporters that show text (TensorBoard's text tab); rank 0 only."""
        if not self.enabled:
            return
        for reporter in self._reporters:
            write_text = getattr(reporter, "write_text", None)
            if write_text is not None:
                write_text(tag, text, step)

    def append(self, record: dict[str, Any]) -> None:
        """Add ``record`` to ``metrics.jsonl`` alone (not to the history, the progress line or TensorBoard)."""
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(json_safe(record), allow_nan=False) + "\n")

    def eta_s(self, step: int, step_time_s: float) -> float:
        """Seconds left after ``step`` (see [Note: ETA]); the first call anchors the estimate."""
        now = self._clock()
        left = max(0, self.total - step)
        if self._anchor is None or step <= self._anchor[1]:
            self._anchor = (now, step)
            return step_time_s * left
        t0, s0 = self._anchor
        return (now - t0) / (step - s0) * left

    def _line(self, r: dict[str, Any]) -> str:
        step = int(r.get("step", 0))
        if "loss" not in r:
            rest = "  ".join(f"{k} {v:.4f}" for k, v in r.items() if k != "step" and isinstance(v, float))
            return f"step {step:>{len(str(self.total))}}/{self.total}  eval  {rest}"
        done = min(_BAR, round(_BAR * step / max(1, self.total)))
        bar = "=" * done + (">" if done < _BAR else "") + " " * max(0, _BAR - done - 1)
        parts = [
            f"step {step:>{len(str(self.total))}}/{self.total} [{bar}]",
            f"loss {r['loss']:.4f}",
            f"lr {r.get('lr', 0.0):.2e}",
        ]
        if r.get("grad_norm") is not None:
            parts.append(f"grad_norm {r['grad_norm']:.3g}")
        if r.get("skipped"):
            parts.append(f"SKIPPED (non-finite; {r.get('skipped_steps', 1)} so far)")
        if "tokens_per_s" in r:
            parts.append(f"{r['tokens_per_s']:,.0f} tok/s")
        parts.append(f"{r.get('step_time_s', 0.0) * 1e3:.0f} ms/step")
        parts.append(f"ETA {format_duration(self.eta_s(step, float(r.get('step_time_s', 0.0))))}")
        return "  ".join(parts)

    def finish(self) -> str | None:
        """Close TensorBoard and draw ``loss.png``; returns its path (None when not drawn)."""
        if not self.enabled:
            return None
        for reporter in self._reporters:
            reporter.close()
        self._reporters = []
        points = [
            (r["step"], r["loss"])
            for r in self.records
            if isinstance(r.get("loss"), float) and math.isfinite(r["loss"])
        ]
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
        """First and last training loss of the whole run (every segment), and the skipped non-finite steps.

        ``first_loss`` is the loss of the first logged step whose loss is finite (``first_loss_step``): a
        skipped first step does not make it NaN.
        """
        losses = [r for r in self.records if "loss" in r]
        finite = [r for r in losses if isinstance(r["loss"], (int, float)) and math.isfinite(r["loss"])]
        return {
            "first_loss": finite[0]["loss"] if finite else None,
            "first_loss_step": finite[0]["step"] if finite else None,
            "final_loss": losses[-1]["loss"] if losses else None,
            "skipped_steps": sum(1 for r in losses if r.get("skipped")),
        }


def format_duration(seconds: float) -> str:
    """``75`` -> ``1:15``, ``3725`` -> ``1:02:05`` (rounded to the second; ``--:--`` when not finite)."""
    if not math.isfinite(seconds):
        return "--:--"
    total = max(0, round(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
