"""The main job's figures: wall time, table and stability of ``workbench ablate --preset quick``.

Run:  python benchmarks/quick_preset.py [--runs 5] [--start template|spawn|both] [--json FILE]

Each run is the command a user types, start to exit, in a fresh process. With several runs
it also reports how far each arm's speedup strays from its median over the runs: the goal
is every arm within +-3% (and the whole command within 45 s on the 2-core CI machine).
``--start both`` alternates the two ways a run starts its processes (forked from a warm
template, or a new interpreter each), run by run, to measure what the template saves.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COLUMNS = [
    "arm",
    "status",
    "samples_per_s",
    "speedup",
    "speedup_low",
    "speedup_high",
    "within_block_pct",
    "between_block_pct",
    "noisy",
    "step_ms",
    "peak_mem_mb",
    "activation_mb",
    "startup_s",
    "final_loss",
    "loss_vs_baseline",
]


def run_once(folder: Path, start: str) -> tuple[float, object]:
    from workbench.results import load_results

    out = folder / "quick"
    started = time.perf_counter()
    command = [
        sys.executable,
        "-m",
        "workbench",
        "ablate",
        "--preset",
        "quick",
        "--out",
        str(out),
        "--no-progress",
        "--start",
        start,
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"the quick preset failed:\n{done.stderr}")
    return wall, load_results(out)


def speedups_by_estimator(results) -> dict[str, dict[str, float]]:
    """Each arm's speedup by every candidate estimator of a block's typical step time
    (workbench.stats.ESTIMATORS), from the run's stored windows: how each would have moved."""
    from workbench import stats
    from workbench.results import _side

    by_block: dict[int, dict[str, dict]] = {}
    for unit in results.record["units"]:
        if unit["status"] == "ok":
            by_block.setdefault(unit["block"], {})[unit["arm"]] = unit["result"]
    found: dict[str, dict[str, float]] = {}
    for arm in results.record["arms"]:
        if arm["role"] == "baseline":
            continue
        blocks = [arms for arms in by_block.values() if {"baseline", arm["name"]} <= set(arms)]
        shared = arm.get("process", "block") == "block"
        found[arm["name"]] = {
            estimator: stats.combine_blocks(
                [
                    stats.block_ratio(
                        _side(arms["baseline"]), _side(arms[arm["name"]]), paired=shared, estimator=estimator
                    )
                    for arms in blocks
                ]
            ).point
            for estimator in stats.ESTIMATORS
        }
    return found


def largest_deviation_pct(values: list[float]) -> tuple[float, float]:
    """The median of ``values`` and the largest distance from it, in percent."""
    median = statistics.median(values)
    return median, 100 * max(abs(v / median - 1) for v in values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1, help="run the preset this many times (stability)")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument(
        "--start",
        choices=["template", "spawn", "both"],
        default="template",
        help="how the preset's processes start; both: alternate, run by run",
    )
    args = parser.parse_args()
    starts = ["template", "spawn"] if args.start == "both" else [args.start]

    from workbench.environment import machine_summary

    walls, tables, started, by_estimator = [], [], [], []
    for run in range(args.runs * len(starts)):
        start = starts[run % len(starts)]
        with tempfile.TemporaryDirectory() as folder:
            wall, results = run_once(Path(folder), start)
        walls.append(wall)
        started.append(start)
        tables.append(json.loads(results.table[COLUMNS].to_json(orient="records")))
        by_estimator.append(speedups_by_estimator(results))
        print(f"run {run + 1}/{args.runs * len(starts)} ({start}): {wall:.1f} s", flush=True)
    print(results.summary())
    for start in starts:
        these = [w for w, s in zip(walls, started, strict=True) if s == start]
        print(
            f"\nwall time of `workbench ablate --preset quick --start {start}` (start to exit): "
            f"{', '.join(f'{w:.1f}' for w in these)} s; median {statistics.median(these):.1f} s"
        )
    stability = {}
    if len(tables) > 1:
        print("\nspeedup per run, and the largest distance from the arm's median over the runs:")
        for index, row in enumerate(tables[0]):  # the arms, in the same order in every run
            speedups = [table[index]["speedup"] for table in tables]
            median, worst = largest_deviation_pct(speedups)
            stability[row["arm"]] = {
                "speedups": speedups,
                "median": median,
                "largest_deviation_pct": worst,
            }
            print(
                f"  {row['arm']:20s} {' '.join(f'{s:.3f}' for s in speedups)}   within {worst:.1f}% of {median:.3f}"
            )
    estimator_stability: dict[str, dict[str, dict]] = {}
    if len(tables) > 1:
        print("\nthe same runs by every candidate estimator: median speedup, and largest distance from it:")
        for arm in by_estimator[0]:
            estimator_stability[arm] = {}
            for estimator in by_estimator[0][arm]:
                median, worst = largest_deviation_pct([run[arm][estimator] for run in by_estimator])
                estimator_stability[arm][estimator] = {"median": median, "largest_deviation_pct": worst}
            print(
                f"  {arm:20s} "
                + "  ".join(
                    f"{e} {f['median']:.3f} ({f['largest_deviation_pct']:.1f}%)"
                    for e, f in estimator_stability[arm].items()
                )
            )
    if args.json:
        report = {
            "benchmark": "quick-preset",
            "runs": args.runs,
            "wall_s": walls,
            "start": started,
            "table": tables[-1],
            "tables": tables,
            "stability": stability,
            "speedups_by_estimator": by_estimator,
            "stability_by_estimator": estimator_stability,
            "machine": machine_summary(),
        }
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
