"""What a planner chooses for a job, spelled once: :class:`LayoutChoice` (the job file's fields of it).

The profiled planner (:func:`merak_core.planner.plan`, :func:`~merak_core.planner.predict`), the
cluster planner (:func:`merak_core.planner.cluster_search.plan_cluster`,
:func:`~merak_core.planner.cluster_search.predict_config`), the plan check
(:mod:`merak_core.autoplan.check`) and the job-file writer (``merak plan --write-config``,
``replanned.yaml``) all take or return this record; a planned candidate *is* a choice with its
predictions added (:class:`~merak_core.planner.candidate.Candidate`,
:class:`~merak_core.planner.cluster_search.ClusterCandidate`).

It lives with the configuration (below the planners and ``merak_core.job``) because it is a set of
``training`` fields: :meth:`LayoutChoice.training_fields` is the one mapping from a choice to the
job file's keys. Not done here: checking a choice against a model or a machine (the planners do,
naming the value).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["LayoutChoice"]


@dataclass(frozen=True, kw_only=True)
class LayoutChoice:
    """One layout, schedule, batching and memory choice of a job (see the module docstring)."""

    dp: int
    """Data-parallel replicas."""
    tp: int
    """Tensor-parallel ranks."""
    pp: int
    """Pipeline ranks."""
    schedule: str
    """The pipeline schedule (a merak-pipe registry key)."""
    num_microbatches: int
    """Microbatches per optimizer step (``gradient_accumulation_steps``)."""
    micro_batch_size: int
    """Samples per microbatch of one DP replica (``per_device_train_batch_size``)."""
    recompute: str = "none"
    """``none``, ``full`` or ``stage_aware``."""
    virtual_stages: int = 1
    """Pipeline stages per rank (interleaved schedules); ``pp * virtual_stages`` stages in all."""
    zero_stage: int = 0
    """ZeRO stage of the optimizer states (0: none)."""
    tp_overlap: bool = False
    """Sub-pipelined TP overlap (priced by the cluster planner; the job keeps its own overlap setting)."""
    cp: int = 1
    """Context-parallel ranks (each holds ``seq_len / cp`` tokens of every sample); 1: off."""
    cp_mode: str = "ring"
    """Attention over the cp group: ``ring`` or ``ulysses`` (meaningful at cp > 1)."""
    ep: int = 1
    """Expert-parallel ranks carved out of dp (each holds experts / ep of every MoE block); 1: off."""

    @property
    def layout(self) -> str:
        """``dp{dp}-tp{tp}-pp{pp}``, with ``-cp{cp}`` after dp when cp > 1 (the rank grid's order)."""
        cp = f"-cp{self.cp}" if self.cp > 1 else ""
        ep = f"-ep{self.ep}" if self.ep > 1 else ""  # carved out of dp
        return f"dp{self.dp}{ep}{cp}-tp{self.tp}-pp{self.pp}"

    @property
    def schedule_label(self) -> str:
        """The schedule, with ``v=N`` when it runs N > 1 stages per pipeline rank and the cp mode at cp > 1."""
        label = self.schedule + (f" v={self.virtual_stages}" if self.virtual_stages > 1 else "")
        return label + (f" {self.cp_mode}" if self.cp > 1 else "")

    def choice(self) -> LayoutChoice:
        """This choice alone (a candidate without its predictions)."""
        return LayoutChoice(**self.choice_fields())

    def choice_fields(self) -> dict[str, Any]:
        """The choice's fields by name (to build a candidate from it)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(LayoutChoice)}

    def training_fields(self, memory_budget: float | None = None) -> dict[str, Any]:
        """The job file's ``training`` fields of this choice; ``memory_budget`` (bytes) goes with
        stage-aware recomputation."""
        out: dict[str, Any] = {
            "dp": self.dp,
            "tp": self.tp,
            "pp": self.pp,
            "schedule": self.schedule,
            "per_device_train_batch_size": self.micro_batch_size,
            "gradient_accumulation_steps": self.num_microbatches,
            "recompute": self.recompute,
            "virtual_stages": self.virtual_stages,
            "zero_stage": self.zero_stage,
        }
        if self.cp > 1:
            out["cp"], out["cp_mode"] = self.cp, self.cp_mode
        if self.ep > 1:
            out["ep"] = self.ep
        if self.recompute == "stage_aware" and memory_budget is not None:
            out["memory_budget"] = int(memory_budget)
        return out
