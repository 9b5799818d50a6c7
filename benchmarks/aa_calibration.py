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

The record keeps every window's step times (in microseconds), so that a set can be judged
again later, by estimators or intervals that did not exist when it ran, on the very same
measurements: ``--reanalyse RECORD`` does that and writes nothing new unless ``--json`` is given.

Run:  python benchmarks/aa_calibration.py [--trials 40] [--blocks 3] [--steps 200]
          [--json benchmarks/results/aa-calibration.json]
      python benchmarks/aa_calibration.py --reanalyse benchmarks/results/aa-calibration-....json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path


def wilson(hits: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a proportion: sane even at 0 or n successes."""
    p = hits / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    return centre - half, centre + half


CONTROL = ("baseline", "baseline (control)")


def control_windows(results) -> list[dict[str, list[list[float]]]]:
    """Per block, the baseline's and the control's windows of step times, in microseconds
    (0.1 us resolution: far finer than the noise, and under half the size of full floats)."""
    from workbench.results import _side

    by_block: dict[int, dict[str, list[list[float]]]] = {}
    for unit in results.record["units"]:
        if unit["status"] == "ok" and unit["arm"] in CONTROL:
            windows = [[round(1e6 * s, 1) for s in w] for w in _side(unit["result"]).windows]
            by_block.setdefault(unit["block"], {})[unit["arm"]] = windows
    return [arms for _, arms in sorted(by_block.items()) if set(CONTROL) <= set(arms)]


def control_intervals(blocks: list[dict], estimator: str) -> dict[bool, tuple[float, float, float]]:
    """The control arm's (low, point, high) with ``estimator``, from one trial's stored windows,
    by ``floored``: never narrower than the blocks' own rounds allow (as
    workbench.stats.combine_blocks does by default), or the bare t-interval over the blocks.
    As in workbench's table, a side with slow steps of its own in every block is counted by
    the mean (workbench.stats.arm_speedup)."""
    from workbench import stats

    def side(windows: list[list[float]]) -> stats.Side:  # samples per step cancel in an A/A ratio
        return stats.Side([[1e-6 * s for s in w] for w in windows], 1.0)

    pairs = [(side(arms[CONTROL[0]]), side(arms[CONTROL[1]])) for arms in blocks]
    measured = stats.arm_speedup(pairs, paired=True, estimator=estimator)
    speedups = {True: measured.speedup, False: stats.combine_blocks(measured.ratios, floored=False)}
    return {floored: (s.low, s.point, s.high) for floored, s in speedups.items()}


def judge(trials: list[list[dict]]) -> dict[str, dict[str, dict]]:
    """Every estimator, floored and bare, on the same trials: coverage of 1.0 and half-widths."""
    from workbench import stats

    summary: dict[str, dict] = {"floored": {}, "unfloored": {}}
    for name in stats.ESTIMATORS:
        by_trial = [control_intervals(blocks, name) for blocks in trials]
        for floored in (True, False):
            found = [intervals[floored] for intervals in by_trial]
            hits = int(sum(low <= 1.0 <= high for low, _, high in found))
            half_widths = sorted(100 * max(high - point, point - low) / point for low, point, high in found)
            coverage_low, coverage_high = wilson(hits, len(trials))
            summary["floored" if floored else "unfloored"][name] = {
                "covered": hits,
                "coverage": hits / len(trials),
                "coverage_interval": [coverage_low, coverage_high],
                "median_half_width_pct": half_widths[len(half_widths) // 2],
                "intervals": found,
            }
    return summary


def print_summary(summary: dict[str, dict[str, dict]], trials: int) -> None:
    from workbench import stats

    for kind, label in (("floored", "floored"), ("unfloored", "t only")):
        for name, figures in summary[kind].items():
            coverage_low, coverage_high = figures["coverage_interval"]
            print(
                f"  {name:26s} {label:8s} {figures['covered']}/{trials} contain 1.0 "
                f"(Wilson 95%: {coverage_low:.0%}-{coverage_high:.0%}); "
                f"median half-width {figures['median_half_width_pct']:.2f}%"
                + ("   <- workbench's" if name == stats.ESTIMATOR and kind == "floored" else "")
            )


def reanalyse(path: str, json_out: str | None) -> None:
    """Judge today's estimators and intervals on a stored set's windows."""
    record = json.loads(Path(path).read_text())
    if "windows" not in record:
        sys.exit(f"{path} keeps no windows (sets recorded before they were kept cannot be judged again)")
    from workbench import stats

    summary = judge(record["windows"])
    print(
        f"{record['trials']} A/A trials from {path} (measured at {record['machine'].get('git_revision')}), "
        f"judged by today's code:"
    )
    print_summary(summary, record["trials"])
    if json_out:
        record.update(
            estimator=stats.ESTIMATOR,
            estimators=summary["floored"],
            estimators_unfloored=summary["unfloored"],
        )
        Path(json_out).write_text(json.dumps(record, separators=(",", ":")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=None, help="default: chosen from the step time")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument(
        "--reanalyse", metavar="RECORD", help="judge a stored set's windows instead of running"
    )
    args = parser.parse_args()
    if args.reanalyse:
        reanalyse(args.reanalyse, args.json)
        return

    import workbench as wb
    from workbench import stats
    from workbench.environment import machine_summary

    started = time.time()
    trials: list[list[dict]] = []  # per trial, per block: the two arms' windows
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
        trials.append(control_windows(res))
        low, point, high = control_intervals(trials[-1], stats.ESTIMATOR)[True]
        print(
            f"trial {trial + 1}/{args.trials} ({walls[-1]:.0f} s): control {point:.4f} [{low:.4f}, {high:.4f}] "
            f"({stats.ESTIMATOR})",
            flush=True,
        )
    summary = judge(trials)
    print(f"\n{args.trials} A/A trials, {args.model}, {args.steps} steps x {args.blocks} blocks:")
    print_summary(summary, args.trials)
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
                    "windows": trials,
                },
                separators=(",", ":"),
            )
        )


if __name__ == "__main__":
    main()
