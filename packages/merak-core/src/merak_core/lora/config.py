"""``LoraConfig``: which modules get adapters, their rank and scale; and what LoRA cannot run with yet.

The job file's ``model.lora`` section is this dataclass's fields (``from`` for ``from_dir``)::

    model:
      pretrained: llama-small/
      lora: {r: 8, alpha: 16, dropout: 0.0, target_modules: [q_proj, k_proj, v_proj, o_proj]}

``target_modules`` is matched like PEFT matches a list: a module whose qualified name equals an
entry or ends with ``.`` + the entry; ``all-linear`` is every linear except the output layer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

ALL_LINEAR = "all-linear"

__all__ = ["ALL_LINEAR", "LoraConfig", "check_lora_arguments"]


@dataclass(kw_only=True)
class LoraConfig:
    """Low-rank adapters ``W x + (alpha / r) * B A x`` on the target modules; the base weights are frozen."""

    r: int = 8
    """Rank of the adapters (A is ``r x in``, B is ``out x r``)."""
    alpha: float = 16.0
    """Scale numerator: the adapter's output is multiplied by ``alpha / r`` (PEFT's ``lora_alpha``)."""
    dropout: float = 0.0
    """Dropout on the adapter's input (PEFT's ``lora_dropout``)."""
    target_modules: list[str] | str = field(default_factory=lambda: [ALL_LINEAR])
    """Module names matched by suffix like PEFT (``q_proj`` matches ``model.layers.0.self_attn.q_proj``),
    or ``all-linear``: every linear but the output layer."""
    from_dir: str | None = None
    """A PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) to start from
    (job key ``from``); None: A drawn like PEFT (Kaiming-uniform), B zero."""

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"model.lora.r={self.r!r}: the rank must be a positive integer (e.g. r: 8)")
        if (
            isinstance(self.alpha, bool)
            or not isinstance(self.alpha, (int, float))
            or not math.isfinite(self.alpha)
        ):
            raise ValueError(f"model.lora.alpha={self.alpha!r}: expected a finite number (e.g. alpha: 16)")
        self.alpha = float(self.alpha)
        if (
            isinstance(self.dropout, bool)
            or not isinstance(self.dropout, (int, float))
            or not 0 <= self.dropout < 1
        ):
            raise ValueError(
                f"model.lora.dropout={self.dropout!r}: expected a probability in [0, 1) (e.g. 0.0)"
            )
        self.dropout = float(self.dropout)
        targets = self.target_modules
        if isinstance(targets, str):
            if targets != ALL_LINEAR:
                raise ValueError(
                    f"model.lora.target_modules={targets!r}: expected a list of module names (e.g. "
                    f"[q_proj, v_proj]) or {ALL_LINEAR!r}"
                )
            targets = [targets]
        if not isinstance(targets, list) or not targets or not all(isinstance(t, str) and t for t in targets):
            raise ValueError(
                f"model.lora.target_modules={targets!r}: expected a non-empty list of module names "
                f"(e.g. [q_proj, v_proj]) or {ALL_LINEAR!r}"
            )
        if ALL_LINEAR in targets and len(targets) > 1:
            raise ValueError(
                f"model.lora.target_modules={targets!r}: {ALL_LINEAR!r} already takes every linear; "
                "give it alone or list module names"
            )
        self.target_modules = list(targets)
        if self.from_dir is not None and (not isinstance(self.from_dir, str) or not self.from_dir):
            raise ValueError(f"model.lora.from={self.from_dir!r}: expected the path of a PEFT adapter folder")

    @property
    def scaling(self) -> float:
        """The adapter's output scale ``alpha / r``."""
        return self.alpha / self.r

    @property
    def all_linear(self) -> bool:
        return self.target_modules == [ALL_LINEAR]

    @classmethod
    def from_mapping(cls, raw: Any, *, base_dir: str | Path = ".", source: str = "job") -> LoraConfig:
        """The job file's ``model.lora`` section (``from`` resolved against the job file's directory)."""
        if not isinstance(raw, Mapping):
            raise ValueError(
                f"{source}: model.lora must be a mapping such as {{r: 8, alpha: 16, target_modules: "
                f"[q_proj, v_proj]}}, got {type(raw).__name__} {raw!r}"
            )
        keys = {f.name for f in fields(cls)} - {"from_dir"} | {"from"}
        unknown = sorted(set(raw) - keys)
        if unknown:
            raise ValueError(f"{source}: unknown key model.lora.{unknown[0]}; valid: {sorted(keys)}")
        values = {k: v for k, v in raw.items() if k != "from"}
        if raw.get("from") is not None:
            values["from_dir"] = str(Path(base_dir) / Path(str(raw["from"])).expanduser())
        try:
            return cls(**values)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None


def check_lora_arguments(*, tp: int | None, dp: int | None, args: Any, config: LoraConfig) -> None:
    """ValueError for a run option LoRA does not (yet) compute exactly; ``tp``/``dp`` None: not known yet.

    Each refusal names the option and the fix: such a run would otherwise train silently wrong.
    """
    tp_many = tp is None or tp > 1
    if config.dropout > 0 and tp_many and getattr(args, "overlap_chunks", 1) > 1:
        raise ValueError(
            f"model.lora.dropout={config.dropout} with training.overlap_chunks={args.overlap_chunks}: "
            "sub-pipelined TP runs each microbatch in chunks interleaved with other layers, so the "
            "adapters' dropout masks would not be one process's ([Note: adapter dropout under TP]): "
            "set model.lora.dropout: 0.0 or training.overlap_chunks: 1"
        )
