"""Calibration of the speedup intervals: how often does an A/A comparison contain 1.0?

Each trial is a complete ablation whose only arms are the baseline and its control (the
same baseline again), so the true speedup is exactly 1.0. A 95% interval should contain it
in about 95% of trials; much less would mean the intervals are too narrow for this
machine's noise (or that the timing is biased), much more that they are needlessly wide.

Run:  python benchmarks/aa_calibration.py [--trials 20] [--repeats 3] [--json benchmarks/results/aa-calibration.json]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    import workbench as wb
    from workbench.environment import machine_summary

    started = time.time()
    intervals = []
    for trial in range(args.trials):
        res = wb.ablate(
            model=args.model,
            techniques={},
            steps=args.steps,
            warmup=5,
            repeats=args.repeats,
            control=True,
            out=False,
            progress=False,
            seed=trial,
        )
        row = res.table.set_index("arm").loc["baseline (control)"]
        intervals.append((row.speedup_low, row.speedup, row.speedup_high))
        print(
            f"trial {trial + 1}/{args.trials}: {row.speedup:.3f} [{row.speedup_low:.3f}, {row.speedup_high:.3f}]",
            flush=True,
        )
    intervals = [tuple(float(value) for value in interval) for interval in intervals]
    hits = int(sum(low <= 1.0 <= high for low, _, high in intervals))
    low, high = wilson(hits, args.trials)
    widths = sorted(high - low for low, _, high in intervals)
    print(
        f"\n{hits}/{args.trials} A/A intervals contain 1.0 (coverage {hits / args.trials:.0%}, "
        f"95% Wilson interval {low:.0%}-{high:.0%}); median interval width {widths[len(widths) // 2]:.3f}"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "benchmark": "aa-calibration",
                    "model": args.model,
                    "steps": args.steps,
                    "repeats": args.repeats,
                    "trials": args.trials,
                    "covered": hits,
                    "coverage_interval": [low, high],
                    "intervals": intervals,
                    "median_width": widths[len(widths) // 2],
                    "wall_s": time.time() - started,
                    "machine": machine_summary(),
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
