"""Compiled stages: ``training.compile`` applies ``torch.compile`` to this rank's stages.

[Note: compiled stages]
``compile: true`` compiles each pipeline stage as one region: the stage's chain of traced shards
(or, at pp = 1, the whole TP-sharded model) runs as one compiled callable. When the stage's
recomputation checkpoints only some of its units (``uniform:<f>``, ``stage_aware``), the
recomputation needs the unit boundaries, so each unit is compiled on its own instead.
``compile: regional`` compiles the repeated blocks: at pp = 1 every module of an
``nn.ModuleList`` whose entries share one class (the transformer layers); at pp > 1 the blocks are
inlined into the traced graph, so each traced shard of the stage (a piece of one or two blocks) is
a region. Regions compile lazily, on their first call, so nothing here costs time up front.

It is applied once, after TP, the pipeline cut and ZeRO have made the stage modules, and before the
pipeline runner takes them: parameters, their names and the DP gradient hooks on them are the
ones of the eager modules (``nn.Module.compile`` compiles in place and keeps the module's
``state_dict``). TP's collectives, the recomputation (merak-pipe's checkpointed segments) and
the DP hooks run inside or around the compiled regions unchanged; the result equals the eager
run within float32 rounding (``inductor`` reorders float operations; ``aot_eager`` and
``eager`` are bit-identical).

With virtual stages each of a rank's stages is compiled on its own (one region each, or its units).
LoRA adapters are traced inside the regions (their base layers stay eager at tp > 1, [Note: TP
layers stay eager]). Under ZeRO-2/3 each block or unit is an FSDP2 unit: FSDP2's hooks are
``torch._dynamo.disable``d in torch, so the gathers and reduce-scatters run eagerly around the
compiled graphs of the blocks.

[Note: compiled TP regions]
Under sequence parallelism a block's attention and MLP are merak-tp TP regions (each all-gathers
its sequence-sharded input on entry and reduce-scatters on exit); with ``overlap_chunks > 1`` a
region runs its input in chunks, each chunk's collective asynchronous and waited on while the next
computes. Their TP layers stay eager as everywhere ([Note: TP layers stay eager]); the region's own
bookkeeping (its forward, the entry gather, the chunking) runs as plain Python inside the compiled
block and what it calls, the attention or MLP compute between the TP layers, is compiled ([Note:
region bookkeeping is not traced] in merak_tp._untraced; under torch.export, which traces pipelined
models and refuses torch.compile's non-recursive disable, that code runs as itself). Traced whole,
the compiled code of a later block's region set the run mode on an earlier block's region state:
that region's column layers all-reduced their input gradients themselves and its entry
reduce-scattered them again (Llama, tp = 2, ``aot_eager``: the gradients about 1e-2 off eager from
the first step, hidden by Adam's first update; the weights about 2e-2 off after 2 steps). The first
block (``SequenceScatter[Block]``, scattering the sequence on entry) is compiled too: the scatter
itself runs untraced (``torch.compiler.disable`` in merak_tp.overlap), the rest of the block's
forward is compiled; :func:`_block_class` still finds the blocks for ``regional``. Context parallelism (``cp > 1``): merak-tp's attention reads the active CP
context from a ``ContextVar``, which dynamo does not trace: the graph breaks there and the ring or
Ulysses exchange runs eagerly between compiled graphs, every call. Expert parallelism (``ep > 1``):
the dispatch's split sizes are read on the host (data-dependent), a graph break; the all-to-alls run
eagerly there and dynamo recompiles the expert code for new token counts (falling back to eager
past its recompile limit), so ranks may hold different graphs but issue the same collectives.

Refused, by name, before anything runs (:func:`check_compile_arguments`):

- split-backward schedules (``zb_h1``, ``zb_v``, ...): torch computes a compiled region's input and
  weight gradients separately (``torch.autograd.grad(..., inputs=...)`` on its output is exact), but
  AOTAutograd compiled one backward function for the region, which computes every gradient each
  time it runs: ``I`` and ``W`` would each run the region's whole backward (two backwards per
  microbatch instead of one split in two, slower than 1F1B), and inductor's donated buffers forbid
  the retained graph ``I`` needs on graphs that save intermediates.

Not done here: building the stages (``compose.py``), running them (merak-pipe's runner).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

__all__ = [
    "COMPILE_MODES",
    "CompiledStage",
    "check_compile_arguments",
    "compile_mode",
    "compile_stage",
    "compile_stages",
    "keep_tp_layers_eager",
    "refused_with_compile",
    "repeated_blocks",
]

COMPILE_MODES = (False, True, "regional")
"""The values of ``training.compile`` after normalisation."""

_FIX = "set compile: false"


def compile_mode(value: Any) -> bool | str:
    """``training.compile`` normalised: False, True or ``"regional"`` (job-file strings accepted)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "regional"):
        text = value.strip().lower()
        return "regional" if text == "regional" else text == "true"
    raise ValueError(
        f"compile={value!r} is invalid: expected true (each pipeline stage compiled), regional (each "
        "repeated block) or false (eager)"
    )


def check_compile_arguments(args: Any) -> None:
    """``compile`` and ``compile_backend`` of a ``TrainingArguments``; ValueError for what compile refuses.

    Normalises ``args.compile``. Runs after the pipeline checks (``args.schedule`` is a registry key).
    """
    args.compile = compile_mode(args.compile)
    if not args.compile:
        return  # the backend is not used (and listing backends imports torch's compiler: not for every run)
    backends = torch.compiler.list_backends(exclude_tags=())
    if not isinstance(args.compile_backend, str) or args.compile_backend not in backends:
        raise ValueError(
            f"compile_backend={args.compile_backend!r} is not a torch.compile backend: expected one of "
            f"{sorted(backends)} (inductor generates code; aot_eager does not and needs no compiler)"
        )
    refused = refused_with_compile(args.schedule)
    if refused is not None:
        raise ValueError(refused)


def refused_with_compile(schedule: str) -> str | None:
    """Why compiled stages cannot run ``schedule`` (a split-backward schedule), or None when they can."""
    if schedule == "auto":
        return None
    from merak_pipe import schedule_info

    info = schedule_info(schedule)
    if not info.split_backward:
        return None
    return (
        f"compile with schedule={schedule!r} is not supported: the schedule splits each backward into "
        "input- and weight-gradient actions (I and W), and a compiled region's backward is one function "
        "(torch AOTAutograd) that computes every gradient whenever it runs (I and W would each run it "
        "whole: twice the backward of 1f1b; inductor refuses the retained graph). Use a schedule without "
        f"split backward (1f1b, interleaved_1f1b, shifted_critical_path, gpipe), or {_FIX}"
    )


# ---------------------------------------------------------------------------- applying it


class CompiledStage(nn.Module):
    """A stage's chain of units run as one compiled region (``compile: true``, [Note: compiled stages]).

    Holds the stage module as ``stage``; the pipeline runner gets this object, the model keeps the
    stage module itself, so parameter names and checkpoints do not change.
    """

    def __init__(self, stage: nn.Sequential) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        units = list(self.stage)
        value: Any = units[0](*args, **kwargs)
        for unit in units[1:]:  # as merak_pipe.PipelineStage chains the units of a stage
            if isinstance(value, tuple):
                value = unit(*value)
            elif isinstance(value, dict):
                value = unit(**value)
            else:
                value = unit(value)
        return value


def _block_class(entries: nn.ModuleList) -> type | None:
    """The class the entries of ``entries`` share, or None.

    A wrapper that swaps an entry's class for a subclass of it (merak-tp's sequence-parallel boundaries,
    ``SequenceScatter[Block]`` on the first block) keeps the entry a block: the class shared is the most
    derived one every entry is an instance of, outside ``torch`` (plain torch layers count only when
    their classes are identical).
    """
    types = {type(m) for m in entries}
    if len(types) == 1:
        return types.pop()
    for cls in type(entries[0]).__mro__:
        if cls.__module__.startswith("torch") or not issubclass(cls, nn.Module):
            continue
        if all(isinstance(m, cls) for m in entries):
            return cls
    return None


def repeated_blocks(module: nn.Module) -> list[nn.Module]:
    """The repeated blocks of ``module``: entries of each ``nn.ModuleList`` whose entries share one class
    (at least two; :func:`_block_class`), outermost lists only."""
    blocks: list[nn.Module] = []
    inside: set[int] = set()
    for sub in module.modules():
        if id(sub) in inside or not isinstance(sub, nn.ModuleList) or len(sub) < 2:
            continue
        if _block_class(sub) is None:
            continue
        blocks.extend(sub)
        inside.update(id(m) for block in sub for m in block.modules())
    return blocks


def keep_tp_layers_eager(module: nn.Module) -> int:
    """Mark merak-tp's layers in ``module`` to run eagerly inside compiled regions; how many were marked.

    merak-tp's TP regions (a block's attention or MLP made one region under sequence parallelism or
    sub-pipelined TP) and sequence boundaries (``SequenceScatter[Block]``) are not marked: their
    compute is traced, their bookkeeping and the boundary's collective are not ([Note: compiled TP
    regions]).

    [Note: TP layers stay eager] A TP layer is an autograd function whose backward launches
    collectives on the TP group (asynchronous handles, gloo or NCCL): torch.compile cannot trace it,
    breaks the graph there and then compiles the function's forward as a frame of its own, once per
    layer name until its recompile limit. ``torch.compiler.disable`` on the layer's ``forward`` makes
    the break explicit and the layer (its matmul and collective) run as in eager mode; the
    compiled graphs are what lies between the layers (norms, attention, activations, residuals).
    """
    from merak_tp import TP_LEAF_MODULES, SequenceGather, SequenceScatter, TPRegion

    # a region or a sequence boundary: a whole block, its own collectives untraced in merak-tp
    traced = (TPRegion, SequenceScatter, SequenceGather)
    layers = tuple(c for c in TP_LEAF_MODULES if not issubclass(c, traced))
    marked = 0
    for sub in module.modules():
        if isinstance(sub, layers) and "forward" not in vars(sub):
            sub.forward = torch.compiler.disable(sub.forward)  # type: ignore[method-assign]
            marked += 1
    return marked


def compile_stage(
    module: nn.Module,
    mode: bool | str,
    *,
    backend: str,
    checkpointed_units: int | None = None,
) -> nn.Module:
    """The module the pipeline runner should run for one stage, compiled as ``mode`` says.

    ``checkpointed_units``: how many leading units of the stage its recomputation checkpoints
    (None: not known, treated as a partial checkpoint). Compiles in place (``nn.Module.compile``)
    except for ``mode=True`` on a chain of units, which returns a :class:`CompiledStage` around it.
    """
    if not mode:
        return module
    keep_tp_layers_eager(module)
    units = list(module) if isinstance(module, nn.Sequential) else None
    if mode == "regional":
        if units is not None:  # a traced stage: its shards are the regions
            regions = units
        else:
            regions = repeated_blocks(module)
            if not regions:
                raise ValueError(
                    f"compile='regional' found no repeated blocks in {type(module).__name__} (no nn.ModuleList "
                    "of two or more modules of one class); use compile: true to compile the whole model"
                )
        for region in regions:
            region.compile(backend=backend)
        logger.info("compile=regional: %d regions of %s", len(regions), type(module).__name__)
        return module
    if not isinstance(module, nn.Sequential):
        module.compile(backend=backend)
        return module
    assert units is not None
    if checkpointed_units is None or 0 < checkpointed_units < len(units):
        for unit in units:  # partial recomputation checkpoints at unit boundaries: keep them
            unit.compile(backend=backend)
        return module
    whole = CompiledStage(module)
    whole.compile(backend=backend)
    return whole


def compile_stages(
    modules: dict[int, nn.Module], args: Any, *, recompute: Any, schedule: str
) -> dict[int, nn.Module]:
    """Stage index -> the module the pipeline runner runs, compiled as ``args.compile`` says.

    ``recompute``: the run's ``merak_pipe.RecomputePlan`` (None: none); ``schedule``: the schedule
    the runner runs (a planner's choice is checked here, the job's in :func:`check_compile_arguments`).
    """
    refused = refused_with_compile(schedule)
    if refused is not None:
        raise ValueError(refused)
    out: dict[int, nn.Module] = {}
    for s, module in modules.items():
        fraction = 0.0 if recompute is None else float(recompute[s])
        num_units = len(module) if isinstance(module, nn.Sequential) else 1
        checkpointed = min(num_units, max(0, round(fraction * num_units)))  # as merak_pipe.PipelineStage
        out[s] = compile_stage(
            module,
            args.compile,
            backend=args.compile_backend,
            checkpointed_units=checkpointed,
        )
    return out
