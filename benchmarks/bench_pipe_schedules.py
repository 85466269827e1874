"""Benchmark: pipeline schedules compared in simulation, and the simulator's own speed.

Run: OMP_NUM_THREADS=1 PYTHONPATH=packages/merak-pipe/src python benchmarks/bench_pipe_schedules.py [--quick]

Part 1 simulates, at S=4 and S=8 stages and M=8..32 microbatches, with backward = 2x forward and
recompute = 1x forward (a stage is 8 equal layers; a recomputing stage keeps its input, 1/8 of
its activations, per microbatch): GPipe, 1F1B without recompute (the memory reference), 1F1B
with full recompute, 1F1B with stage-aware recompute under a budget of half of 1F1B's stage-0
peak, shifted-critical-path (full recompute on every stage but the last) and zb-h1. Makespans
are also given relative to 1F1B with full recompute.

Part 2 times building, validating and simulating a 64-stage x 1024-microbatch 1F1B schedule.
"""

from __future__ import annotations

import argparse
import time

from merak_pipe import CostModel, RecomputePlan, build_schedule, lower, simulate, stage_aware_plan, validate

LAYERS = 8


def _row(label: str, result, reference, full_makespan: float, plan: RecomputePlan | None) -> str:  # type: ignore[no-untyped-def]
    within = all(p <= q + 1e-9 for p, q in zip(result.peak_memory, reference.peak_memory, strict=True))
    recompute = "-" if plan is None else f"{plan.total:.3g}"
    return (
        f"| {label:<32} | {result.makespan:8.4g} | {result.makespan / full_makespan:6.3f} | "
        f"{100 * result.bubble_fraction_mean:6.1f} | {max(result.peak_memory):6.3g} | "
        f"{'yes' if within else 'no':>11} | {recompute:>9} |"
    )


def part1(sizes: list[tuple[int, int]]) -> list[str]:
    costs = CostModel(
        forward=1.0, backward=2.0, recompute=1.0, activation_bytes=1.0, input_bytes=1.0 / LAYERS
    )
    notes = []
    for S, M in sizes:
        one = build_schedule("1f1b", num_stages=S, num_microbatches=M)
        reference = simulate(one, costs)
        budget = reference.peak_memory[0] / 2
        aware_plan = stage_aware_plan(
            layer_activation_bytes=[[1.0 / LAYERS] * LAYERS] * S,
            memory_budget=budget,
            schedule=one,
            input_bytes=1.0 / LAYERS,
        )
        runs = [
            ("gpipe", build_schedule("gpipe", num_stages=S, num_microbatches=M)),
            ("1f1b (no recompute)", one),
            (
                "1f1b full recompute",
                build_schedule("1f1b", num_stages=S, num_microbatches=M, recompute="full"),
            ),
            (
                "1f1b stage-aware recompute",
                build_schedule("1f1b", num_stages=S, num_microbatches=M, recompute=aware_plan),
            ),
            (
                "shifted-critical-path",
                build_schedule("shifted-critical-path", num_stages=S, num_microbatches=M),
            ),
            ("zb-h1", build_schedule("zb-h1", num_stages=S, num_microbatches=M)),
        ]
        results = {label: simulate(s, costs) for label, s in runs}
        full = results["1f1b full recompute"].makespan
        print(
            f"\nS={S}, M={M} (F=1, B=2, R=1; stage-aware budget {budget:.3g} = half of 1F1B's stage-0 peak)"
        )
        print(
            "| schedule                         | makespan | vs full | bubble% | peak  | <= 1F1B mem | recompute |"
        )
        print(
            "|----------------------------------|----------|---------|---------|-------|-------------|-----------|"
        )
        for label, s in runs:
            print(_row(label, results[label], reference, full, s.recompute))
        scp = results["shifted-critical-path"]
        gain = 1 - scp.makespan / full
        within = all(p <= q + 1e-9 for p, q in zip(scp.peak_memory, reference.peak_memory, strict=True))
        aware_total = aware_plan.total
        notes.append(
            f"S={S} M={M}: shifted-critical-path {100 * gain:.1f}% shorter than 1F1B full recompute "
            f"(memory within 1F1B: {within}); stage-aware recomputes {aware_total:.3g} stage-equivalents "
            f"vs {float(S):.3g} for full ({aware_plan.fractions})"
        )
    return notes


def ablation(sizes: list[tuple[int, int]]) -> None:
    """What each of the three shifted-critical-path ideas buys, one added at a time."""
    costs = CostModel(
        forward=1.0, backward=2.0, recompute=1.0, activation_bytes=1.0, input_bytes=1.0 / LAYERS
    )
    print("\nShifted-critical-path ablation (makespan; F=1, B=2, R=1)")
    print(
        "| S | M | 1F1B full recompute | (a) last stage keeps activations | (a)+(b) R while waiting | (a)+(b)+(c) deeper warm-up |"
    )
    print(
        "|---|---|---------------------|----------------------------------|-------------------------|----------------------------|"
    )
    for S, M in sizes:
        full = simulate(
            build_schedule("1f1b", num_stages=S, num_microbatches=M, recompute="full"), costs
        ).makespan
        last_free = RecomputePlan((1.0,) * (S - 1) + (0.0,))
        a = simulate(
            build_schedule("1f1b", num_stages=S, num_microbatches=M, recompute=last_free), costs
        ).makespan
        ab = simulate(
            build_schedule("shifted-critical-path", num_stages=S, num_microbatches=M, extra_warmup=0), costs
        ).makespan
        abc = simulate(
            build_schedule("shifted-critical-path", num_stages=S, num_microbatches=M), costs
        ).makespan
        print(f"| {S} | {M} | {full:g} | {a:g} | {ab:g} | {abc:g} |")


def part2(repeats: int) -> None:
    print(
        f"\nSimulator speed: 1F1B, 64 stages x 1024 microbatches (best of {repeats}; wall seconds, and the "
        "process CPU seconds of build + validate + simulate, which other load on the machine does not inflate)"
    )
    best = [float("inf")] * 6
    for _ in range(repeats):
        c0 = time.process_time()
        t0 = time.perf_counter()
        schedule = build_schedule("1f1b", num_stages=64, num_microbatches=1024, check=False)
        t1 = time.perf_counter()
        validate(schedule)
        t2 = time.perf_counter()
        result = simulate(schedule, check=False)
        t3 = time.perf_counter()
        c1 = time.process_time()
        lowered = lower(schedule)
        validate(lowered)
        t4 = time.perf_counter()
        for i, v in enumerate((t1 - t0, t2 - t1, t3 - t2, t3 - t0, c1 - c0, t4 - t3)):
            best[i] = min(best[i], v)
    print(
        "| build (s) | validate (s) | simulate (s) | total (s) | total CPU (s) | lower+validate lowered (s) | actions |"
    )
    print(
        "|-----------|--------------|--------------|-----------|---------------|----------------------------|---------|"
    )
    n = sum(len(a) for a in schedule.actions.values())
    print(
        f"| {best[0]:9.3f} | {best[1]:12.3f} | {best[2]:12.3f} | {best[3]:9.3f} | {best[4]:13.3f} | {best[5]:26.3f} "
        f"| {n:7d} |"
    )
    print(
        f"makespan {result.makespan:g}, bubble {100 * result.bubble_fraction[0]:.2f}% "
        f"(closed form {100 * 63 / (1024 + 63):.2f}%); target total < 2 s: {'met' if best[3] < 2.0 else 'NOT met'}"
        f" (wall), {'met' if best[4] < 2.0 else 'NOT met'} (CPU)"
    )


def sweep() -> None:
    """Validate (compute-only and lowered) every built-in schedule over the issue's full ranges."""
    t0 = time.perf_counter()
    checked = refused = 0
    for name in ("gpipe", "1f1b", "zb-h1", "shifted-critical-path"):
        for S in range(1, 17):
            for M in range(1, 65):
                validate(lower(build_schedule(name, num_stages=S, num_microbatches=M)), channel_order=True)
                checked += 1
    for v in range(1, 5):
        for P in range(1, 17):
            for M in range(1, 65):
                try:
                    schedule = build_schedule(
                        "interleaved-1f1b", num_stages=P * v, num_microbatches=M, num_ranks=P
                    )
                except ValueError:
                    refused += 1  # M not a multiple of the number of rounds: a clear error
                    continue
                validate(lower(schedule), channel_order=True)
                checked += 1
    print(
        f"\nsweep: {checked} schedules valid (compute-only and lowered), {refused} interleaved sizes refused "
        f"with a ValueError, {time.perf_counter() - t0:.0f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="S=4, M=8 and S=8, M=16 only; one timing run")
    parser.add_argument(
        "--sweep", action="store_true", help="also validate every schedule for S=1..16, M=1..64, v=1..4"
    )
    args = parser.parse_args()
    sizes = [(4, 8), (8, 16)] if args.quick else [(S, M) for S in (4, 8) for M in (8, 16, 32)]
    notes = part1(sizes)
    print()
    for note in notes:
        print(note)
    ablation(sizes)
    part2(1 if args.quick else 3)
    if args.sweep:
        sweep()


if __name__ == "__main__":
    main()
