"""The search: every (dp, tp, pp), microbatch count, schedule and recomputation, predicted and ranked.

:func:`plan` enumerates the configurations and keeps what fits ``memory_per_device``;
:func:`predict` prices one given configuration. Both price with :mod:`.pricing`; the schedules
and recompute modes come from :mod:`.choices` (merak-pipe's registry), the candidates and their
table from :mod:`.candidate`.

See the package docstring (:mod:`merak_core.planner`) for the cost model and its limits.

[Note: virtual stages in the search] With ``virtual_stages`` holding v > 1, every layout with
pp >= 2 whose layers divide into ``pp * v`` equal stages also tries the registry's schedules that
run v stages per rank (interleaved-1F1B, ZB-V at v = 2), simulated over ``pp * v`` stages on pp
ranks; a rank's memory is its stages' held state plus its simulated activation peak. Layer counts
that do not divide are not tried: the interleaved schedules' gain comes from equal stages, and an
uneven cut gives some ranks the heavier stages twice.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from types import SimpleNamespace
from typing import Any

from merak_core.config.layout_choice import LayoutChoice
from merak_core.planner.candidate import Candidate, sort_key
from merak_core.planner.choices import (
    PLANNER_SCHEDULES,
    RECOMPUTE_MODES,
    check_counts,
    divisors,
    layouts,
    virtual_stage_schedules,
)
from merak_core.planner.comm import CommModel
from merak_core.planner.context_cost import check_cp, cp_allowed, cp_local_profile
from merak_core.planner.memory import MEMORY_MARGIN, ZERO_STAGES, usable_memory
from merak_core.planner.model_profile import ModelProfile
from merak_core.planner.pricing import LayoutCosts, layout_costs, price

__all__ = ["ep_refusal", "plan", "predict", "virtual_stage_counts"]


def _check_common(memory_per_device: float, zero_stage: int, compute_slots: float | None) -> None:
    if not memory_per_device > 0:
        raise ValueError(f"memory_per_device={memory_per_device!r}; expected bytes > 0")
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage={zero_stage!r}; expected one of {ZERO_STAGES}")
    if compute_slots is not None and (
        not isinstance(compute_slots, (int, float))
        or isinstance(compute_slots, bool)
        or not 1 <= compute_slots < math.inf
    ):
        raise ValueError(
            f"compute_slots={compute_slots!r}; expected a number >= 1 (ranks that can compute at once "
            "on one host: its cores, or world_size / measure_contention(...)), or None when every rank "
            "has its own device"
        )


def predict(
    profile: ModelProfile,
    choice: LayoutChoice,
    *,
    comm: CommModel | None = None,
    memory_per_device: float = math.inf,
    optimizer_state_factor: float = 2.0,
    compute_slots: float | None = None,
) -> Candidate:
    """The planner's prediction for one given :class:`LayoutChoice` (whether or not it fits the memory).

    Same cost model as :func:`plan`; ``compute_slots`` is how many ranks can compute at once on
    the host (CPU cores per host when ranks are CPU processes; None: one device per rank).
    """
    dp, tp, pp, virtual_stages = choice.dp, choice.tp, choice.pp, choice.virtual_stages
    schedule, recompute, zero_stage = choice.schedule, choice.recompute, choice.zero_stage
    comm = comm or CommModel()
    _check_common(memory_per_device, zero_stage, compute_slots)
    check_counts(
        "predict",
        (
            ("dp", dp),
            ("tp", tp),
            ("pp", pp),
            ("num_microbatches", choice.num_microbatches),
            ("micro_batch_size", choice.micro_batch_size),
        ),
    )
    if not isinstance(virtual_stages, int) or virtual_stages < 1 or (virtual_stages > 1 and pp < 2):
        raise ValueError(
            f"predict: virtual_stages={virtual_stages!r} at pp={pp}; expected 1, or an int > 1 with pp >= 2"
        )
    allowed = PLANNER_SCHEDULES if virtual_stages == 1 else virtual_stage_schedules(virtual_stages)
    if schedule not in allowed:
        raise ValueError(
            f"predict: schedule {schedule!r} with virtual_stages={virtual_stages} is not one of {allowed}"
        )
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"predict: recompute {recompute!r} is not one of {RECOMPUTE_MODES}")
    if pp * virtual_stages > profile.num_layers:
        raise ValueError(
            f"predict: pp={pp} x virtual_stages={virtual_stages} stages but the profile has "
            f"{profile.num_layers} layers; use pp * virtual_stages <= layers"
        )
    check_cp(choice.cp, choice.cp_mode)
    if not cp_allowed(profile, choice.cp, choice.cp_mode, tp):
        raise ValueError(
            f"predict: cp_mode='ulysses' with cp={choice.cp} at tp={tp}: cp must divide the heads per TP rank "
            f"(heads={profile.num_heads}, kv heads={profile.num_kv_heads}); use cp_mode='ring' or another cp"
        )
    _check_ep(profile, choice)
    local = cp_local_profile(profile, choice.cp, choice.cp_mode)  # [merak_core.planner.context_cost]
    lay = layout_costs(
        local,
        comm,
        dp,
        tp,
        pp,
        zero_stage,
        optimizer_state_factor,
        virtual_stages,
        choice.cp,
        choice.cp_mode,
        choice.ep,
    )
    if recompute == "stage_aware" and pp < 2:
        recompute = "none"
    priced = dataclasses.replace(choice, schedule=schedule if pp > 1 else "1f1b", recompute=recompute)
    cand = price(local, comm, lay, priced, memory_per_device=memory_per_device, compute_slots=compute_slots)
    if cand is None:
        raise ValueError(
            f"predict: stage-aware recomputation cannot fit memory_per_device={memory_per_device:.6g} "
            "bytes for this configuration; raise the memory or use recompute='full'"
        )
    return cand


def ep_refusal(choice: LayoutChoice) -> str | None:
    """Why expert parallelism cannot run ``choice``'s ep with its other fields (None: it can, or ep=1):
    :func:`merak_core.parallel.expert_parallel.check_ep_arguments`' message, asked at run time so that the
    search follows what the runtime refuses (ZeRO stages, virtual stages, cp)."""
    if choice.ep == 1:
        return None
    from merak_core.parallel.expert_parallel import check_ep_arguments

    fields = {**choice.choice_fields(), "layout": "manual", "moe_capacity_factor": None}
    try:
        check_ep_arguments(SimpleNamespace(**fields))
    except ValueError as exc:
        return str(exc)
    return None


def _check_ep(profile: ModelProfile, choice: LayoutChoice) -> None:
    ep = choice.ep
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise ValueError(f"predict: ep={ep!r}; expected an int >= 1")
    if ep > 1 and (choice.dp % ep or not profile.ep_allowed(ep)):
        raise ValueError(
            f"predict: ep={ep} at dp={choice.dp} with num_experts={profile.num_experts}: ep must divide dp and the "
            "experts of a mixture-of-experts profile; use another ep, or ep=1"
        )
    refused = ep_refusal(choice)
    if refused is not None:
        raise ValueError(f"predict: {refused}")


def _check_plan_inputs(
    world_size: int,
    global_batch_size: int,
    max_microbatches: int,
    memory_per_device: float,
    zero_stage: int,
    compute_slots: float | None,
    schedules: Sequence[str],
    recompute_modes: Sequence[str],
    virtual_stages: Sequence[int],
) -> None:
    check_counts(
        "plan",
        (
            ("world_size", world_size),
            ("global_batch_size", global_batch_size),
            ("max_microbatches", max_microbatches),
        ),
    )
    try:
        _check_common(memory_per_device, zero_stage, compute_slots)
    except ValueError as exc:
        raise ValueError(f"plan: {exc}") from None
    for s in schedules:
        if s not in PLANNER_SCHEDULES:
            raise ValueError(f"plan: schedule {s!r} is not one of {PLANNER_SCHEDULES}")
    for r in recompute_modes:
        if r not in RECOMPUTE_MODES:
            raise ValueError(f"plan: recompute mode {r!r} is not one of {RECOMPUTE_MODES}")
    for v in virtual_stages:
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(
                f"plan: virtual_stages holds {v!r}; expected ints >= 1 (stages per pipeline rank)"
            )


def virtual_stage_counts(num_layers: int, pp: int, virtual_stages: Sequence[int]) -> list[int]:
    """The stage counts per rank of ``virtual_stages`` that the search tries at ``pp`` (see [Note: virtual
    stages in the search]): 1, and v > 1 where pp >= 2 and the layers divide into ``pp * v`` stages."""
    return [v for v in sorted(set(virtual_stages)) if v == 1 or (pp > 1 and num_layers % (pp * v) == 0)]


def plan(
    profile: ModelProfile,
    *,
    world_size: int,
    memory_per_device: float,
    global_batch_size: int,
    comm: CommModel | None = None,
    zero_stage: int = 0,
    optimizer_state_factor: float = 2.0,
    schedules: Sequence[str] = PLANNER_SCHEDULES,
    recompute_modes: Sequence[str] = RECOMPUTE_MODES,
    max_microbatches: int = 64,
    compute_slots: float | None = None,
    virtual_stages: Sequence[int] = (1,),
    cp_degrees: Sequence[int] = (1,),
    cp_mode: str = "ring",
    ep_degrees: Sequence[int] = (1,),
) -> list[Candidate]:
    """Every feasible configuration, best predicted step time first.

    ``memory_per_device`` is bytes; ``optimizer_state_factor`` is optimizer-state bytes per
    parameter byte (2 for Adam in the parameters' dtype); ``compute_slots`` is how many ranks can
    compute at once on one host (CPU cores when the ranks are CPU processes; None: a device per
    rank); ``virtual_stages``: the stages per pipeline rank to try (see [Note: virtual stages in
    the search]); ``cp_degrees``: the context-parallel degrees to try, each dividing ``world_size``
    (priced by :mod:`merak_core.planner.context_cost` with ``cp_mode``; give (1, 2, 4, ...) for long
    sequences: a cp > 1 layout is kept when it fits and ranks by its step time like any other);
    ``ep_degrees``: the expert-parallel degrees to try for a mixture-of-experts profile, each where it
    divides dp and the experts and expert parallelism runs with the rest ([Note: expert parallelism
    priced] in :mod:`.pricing`; :func:`ep_refusal`). Ties in step time are broken by fewer TP ranks,
    then no cp or ep, the layout string, schedule, microbatches and recompute mode.
    Raises ValueError on invalid inputs, or when nothing fits (naming the least memory needed).
    """
    comm = comm or CommModel()
    _check_plan_inputs(
        world_size,
        global_batch_size,
        max_microbatches,
        memory_per_device,
        zero_stage,
        compute_slots,
        schedules,
        recompute_modes,
        virtual_stages,
    )
    out: list[Candidate] = []
    least_needed = math.inf
    grid = _cp_grid(profile, world_size, global_batch_size, cp_degrees, cp_mode)
    if not grid:
        raise ValueError(
            f"plan: no (dp, tp, pp) with dp*tp*pp={world_size} suits this model: tp must divide heads="
            f"{profile.num_heads}, kv heads={profile.num_kv_heads}, vocab={profile.vocab_size}; pp <= layers="
            f"{profile.num_layers}; dp must divide global_batch_size={global_batch_size}. Change world_size or the "
            "batch size"
        )
    for cp, local, (dp, tp, pp) in grid:
        for ep in sorted({e for e in ep_degrees if dp % e == 0 and profile.ep_allowed(e)}):
            lays = {
                v: layout_costs(
                    local, comm, dp, tp, pp, zero_stage, optimizer_state_factor, v, cp, cp_mode, ep
                )
                for v in virtual_stage_counts(profile.num_layers, pp, virtual_stages)
            }
            degrees = dict(dp=dp, tp=tp, pp=pp, cp=cp, cp_mode=cp_mode, ep=ep, zero_stage=zero_stage)
            for choice in _choices(degrees, global_batch_size, lays, schedules):
                if max_microbatches < choice.num_microbatches or ep_refusal(choice) is not None:
                    continue
                for cand in _recompute_variants(
                    local,
                    comm,
                    lays[choice.virtual_stages],
                    choice,
                    recompute_modes=recompute_modes,
                    memory_per_device=memory_per_device,
                    compute_slots=compute_slots,
                ):
                    least_needed = min(least_needed, max(cand.device_peak_bytes))
                    # [Note: memory margin] in planner.memory
                    if max(cand.device_peak_bytes) <= usable_memory(memory_per_device):
                        out.append(cand)
    if not out and math.isinf(least_needed):  # nothing priced at all
        raise ValueError(
            f"plan: nothing fits: no configuration of {world_size} ranks runs a global batch of "
            f"{global_batch_size}: each pipeline needs a microbatch per stage (at most max_microbatches="
            f"{max_microbatches}) and dp must divide the batch; raise the batch, or allow other degrees (tp, cp, ep)"
        )
    if not out:
        raise ValueError(
            f"plan: nothing fits in memory_per_device={memory_per_device:.6g} bytes; the smallest configuration needs "
            f"{least_needed / (1 - MEMORY_MARGIN):.6g} bytes per device (a predicted peak of {least_needed:.6g} and "
            f"the planner's {MEMORY_MARGIN:.0%} margin): raise the memory, add devices or shrink the batch"
        )
    out.sort(key=sort_key)
    return out


def _choices(
    degrees: dict[str, Any], global_batch_size: int, lays: dict[int, LayoutCosts], schedules: Sequence[str]
) -> Iterator[LayoutChoice]:
    """The choices at ``degrees`` (LayoutChoice fields) with every microbatch count (at least one per stage),
    schedule and stage count."""
    per_dp = global_batch_size // degrees["dp"]
    for m in divisors(per_dp):
        if m < degrees["pp"]:  # the Trainer needs a microbatch per stage at least
            continue
        for sched, v in _runs(degrees["pp"], schedules, lays):
            yield LayoutChoice(
                **degrees, schedule=sched, num_microbatches=m, micro_batch_size=per_dp // m, virtual_stages=v
            )


def _cp_grid(
    profile: ModelProfile, world_size: int, global_batch_size: int, cp_degrees: Sequence[int], cp_mode: str
) -> list[tuple[int, ModelProfile, tuple[int, int, int]]]:
    """(cp, the profile of one cp rank, (dp, tp, pp)) for every cp of ``cp_degrees`` dividing ``world_size``
    and every (dp, tp, pp) of the other ranks the model allows (Ulysses: cp divides the heads per TP rank)."""
    out = []
    for cp in sorted(set(cp_degrees)):
        check_cp(cp, cp_mode)
        if world_size % cp:
            continue
        local = cp_local_profile(profile, cp, cp_mode)

        def allowed(tp: int, cp: int = cp) -> bool:
            return profile.tp_allowed(tp) and cp_allowed(profile, cp, cp_mode, tp)

        grid = layouts(
            world_size // cp,
            num_layers=profile.num_layers,
            global_batch_size=global_batch_size,
            tp_allowed=allowed,
        )
        out += [(cp, local, degrees) for degrees in grid]
    return out


def _recompute_variants(
    profile: ModelProfile,
    comm: CommModel,
    lay: LayoutCosts,
    choice: LayoutChoice,
    *,
    recompute_modes: Sequence[str],
    memory_per_device: float,
    compute_slots: float | None,
) -> Iterator[Candidate]:
    """The configuration priced under each recompute mode, once per distinct per-stage recomputation
    (stage-aware recomputation that recomputes nothing is ``none``); modes that cannot fit are skipped."""
    seen: set[tuple[float, ...]] = set()
    for mode in recompute_modes:
        cand = price(
            profile,
            comm,
            lay,
            dataclasses.replace(choice, recompute=mode),
            memory_per_device=memory_per_device,
            compute_slots=compute_slots,
        )
        if cand is None or cand.recompute_fractions in seen:
            continue
        seen.add(cand.recompute_fractions)
        yield cand


def _runs(pp: int, schedules: Sequence[str], lays: dict[int, LayoutCosts]) -> list[tuple[str, int]]:
    """(schedule, virtual stages) pairs to try at ``pp``: the given one-stage schedules, and with v > 1 the
    registry's schedules that place v stages per rank."""
    if pp == 1:
        return [("1f1b", 1)] if 1 in lays else []
    runs = [(sched, 1) for sched in schedules] if 1 in lays else []
    for v in sorted(lays):
        if v > 1:
            runs += [(sched, v) for sched in virtual_stage_schedules(v)]
    return runs
