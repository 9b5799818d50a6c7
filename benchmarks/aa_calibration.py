"""Calibration of the speedup intervals: how often does an A/A comparison contain 1.0, and how wide is it?

Each trial is a complete ablation whose only arms are the baseline and its control (the
same baseline again, in the same blocks), so the true speedup is exactly 1.0. A 95%
interval should contain it in about 95% of trials; much less would mean the intervals are
too narrow for this machine's noise (or that the timing is biased), much more that they
are needlessly wide.

The trials keep every window's step times, so each candidate estimator of an arm's typical
step time (workbench.stats.ESTIMATORS) is judged on the very same measurements: its
coverage, and its median half-width (workbench's choice, and why: BENCHMARKS.md, "Which
estimator"). Each is judged twice: with the interval workbench computes (the t-interval over
blocks, never narrower than the interval the blocks' own rounds give) and with the bare
t-interval, so that the floor's effect is measured on the same runs.

Run:  python benchmarks/aa_calibration.py [--trials 40] [--blocks 3] [--steps 200]
          [--json benchmarks/results/aa-calibration.json]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path


def wilson(hits: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a proportion: sane even at 0 or n successes."""
    p = hits / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    return centre - half, centre + half


def control_intervals(results, estimator: str) -> dict[bool, tuple[float, float, float]]:
    """The control arm's (low, point, high) with ``estimator``, from the stored windows, by
    ``floored``: never narrower than the blocks' own rounds allow (as workbench.stats.combine_blocks
    does by default), or the bare t-interval over the blocks."""
    from workbench import stats
    from workbench.results import _side

    by_block: dict[int, dict[str, dict]] = {}
    for unit in results.record["units"]:
        if unit["status"] == "ok":
            by_block.setdefault(unit["block"], {})[unit["arm"]] = unit["result"]
    ratios = [
        stats.block_ratio(
            _side(arms["baseline"]), _side(arms["baseline (control)"]), paired=True, estimator=estimator
        )
        for arms in by_block.values()
        if {"baseline", "baseline (control)"} <= set(arms)
    ]
    speedups = {floored: stats.combine_blocks(ratios, floored=floored) for floored in (True, False)}
    return {floored: (s.low, s.point, s.high) for floored, s in speedups.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=None, help="default: chosen from the step time")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    import workbench as wb
    from workbench import stats
    from workbench.environment import machine_summary

    started = time.time()
    # Each estimator twice: the interval as workbench computes it (floored at the interval of
    # the blocks' own rounds), and the bare t-interval over the blocks, on the same measurements.
    variants = [(name, floored) for name in stats.ESTIMATORS for floored in (True, False)]
    intervals: dict[tuple[str, bool], list[tuple[float, float, float]]] = {v: [] for v in variants}
    walls, rounds = [], []
    for trial in range(args.trials):
        trial_started = time.time()
        res = wb.ablate(
            model=args.model,
            techniques={},
            steps=args.steps,
            warmup=args.warmup,
            blocks=args.blocks,
            rounds=args.rounds,
            control=True,
            out=False,
            progress=False,
            seed=trial,
        )
        walls.append(time.time() - trial_started)
        rounds += [block["rounds"] for block in res.record["blocks"]]
        for name in stats.ESTIMATORS:
            for floored, interval in control_intervals(res, name).items():
                intervals[name, floored].append(interval)
        low, point, high = intervals[stats.ESTIMATOR, True][-1]
        print(
            f"trial {trial + 1}/{args.trials} ({walls[-1]:.0f} s): control {point:.4f} [{low:.4f}, {high:.4f}] "
            f"({stats.ESTIMATOR})",
            flush=True,
        )
    summary: dict[str, dict] = {"floored": {}, "unfloored": {}}
    print(f"\n{args.trials} A/A trials, {args.model}, {args.steps} steps x {args.blocks} blocks:")
    for (name, floored), found in intervals.items():
        hits = int(sum(low <= 1.0 <= high for low, _, high in found))
        half_widths = sorted(100 * max(high - point, point - low) / point for low, point, high in found)
        coverage_low, coverage_high = wilson(hits, args.trials)
        summary["floored" if floored else "unfloored"][name] = figures = {
            "covered": hits,
            "coverage": hits / args.trials,
            "coverage_interval": [coverage_low, coverage_high],
            "median_half_width_pct": half_widths[len(half_widths) // 2],
            "intervals": found,
        }
        print(
            f"  {name:26s} {'floored' if floored else 't only':8s} {hits}/{args.trials} contain 1.0 "
            f"(Wilson 95%: {coverage_low:.0%}-{coverage_high:.0%}); "
            f"median half-width {figures['median_half_width_pct']:.2f}%"
            + ("   <- workbench's" if name == stats.ESTIMATOR and floored else "")
        )
    print(
        f"median wall time per ablation: {sorted(walls)[len(walls) // 2]:.1f} s; rounds per block: {sorted(set(rounds))}"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "benchmark": "aa-calibration",
                    "model": args.model,
                    "steps": args.steps,
                    "warmup": args.warmup,
                    "blocks": args.blocks,
                    "rounds": sorted(set(rounds)),
                    "trials": args.trials,
                    "estimator": stats.ESTIMATOR,
                    "estimators": summary["floored"],
                    "estimators_unfloored": summary["unfloored"],
                    "wall_s": time.time() - started,
                    "median_ablation_s": sorted(walls)[len(walls) // 2],
                    "machine": machine_summary(),
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
