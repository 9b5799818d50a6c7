"""The main job's figures: wall time, table and stability of ``workbench ablate --preset quick``.

Run:  python benchmarks/quick_preset.py [--runs 5] [--start template|spawn|late|both|prewarm]
          [--plan BLOCKSxSTEPS ...] [--threads N] [--json FILE]

Each run is the command a user types, start to exit, in a fresh process. With several runs
it also reports how far each arm's speedup strays from its median over the runs: the goal
is every arm within +-3% (and the whole command within 45 s on the 2-core CI machine).
``--start both`` alternates the two ways a run starts its processes (forked from a warm
template, or a new interpreter each), run by run, to measure what the template saves.
``--start prewarm`` alternates the template the command starts before it imports torch
(the default) with one the run starts afterwards, to measure what starting it first saves.
``--plan 3x20 --plan 6x10`` alternates ways of splitting the timed steps into blocks (3
blocks of 20 steps per arm, or 6 of 10), run by run, to measure what more blocks buy.
``--threads 1`` runs every measuring process on one intra-op thread, out of reach of the
machine's changing cost of threads working together (workbench.core_sync).
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


LATE_TEMPLATE = (
    "import sys, workbench.cli as cli; cli._prewarm_template = lambda args: None; sys.exit(cli.main())"
)


def run_once(
    folder: Path, start: str, plan: tuple[int, int] | None, threads: int | None = None
) -> tuple[float, object]:
    from workbench.results import load_results

    out = folder / "quick"
    started = time.perf_counter()
    # "late": the warm template, started by the run itself once this process has imported torch
    # (as before the command started it first, workbench.template.prewarm), for comparison.
    launcher = ["-c", LATE_TEMPLATE] if start == "late" else ["-m", "workbench"]
    command = [
        sys.executable,
        *launcher,
        "ablate",
        "--preset",
        "quick",
        "--out",
        str(out),
        "--no-progress",
        "--start",
        "template" if start == "late" else start,
    ]
    if plan:  # the same timed steps per arm, split over a different number of blocks
        blocks, steps = plan
        command += ["--blocks", str(blocks), "--steps", str(steps)]
    if threads is not None:
        command += ["--threads", str(threads)]
    done = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"the quick preset failed:\n{done.stderr}")
    return wall, load_results(out)


def speedups_by_estimator(results) -> dict[str, dict[str, float]]:
    """Each arm's speedup by every candidate estimator of a block's typical step time
    (workbench.stats.ESTIMATORS, with workbench.stats.arm_speedup's turn to a capped mean for slow
    steps of a job's own), from the run's stored windows: how each would have moved."""
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
        pairs = [(_side(arms["baseline"]), _side(arms[arm["name"]])) for arms in blocks]
        found[arm["name"]] = {
            estimator: stats.arm_speedup(pairs, paired=shared, estimator=estimator).speedup.point
            for estimator in stats.ESTIMATORS
        }
    return found


def largest_deviation_pct(values: list[float]) -> tuple[float, float]:
    """The median of ``values`` and the largest distance from it, in percent."""
    median = statistics.median(values)
    return median, 100 * max(abs(v / median - 1) for v in values)


def parse_plan(text: str) -> tuple[int, int]:
    """``6x10`` -> (6 blocks, 10 timed steps per arm in each)."""
    blocks, _, steps = text.partition("x")
    try:
        return int(blocks), int(steps)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a plan is BLOCKSxSTEPS, such as 6x10, not {text!r}") from None


def stability_of(tables: list[list[dict]], by_estimator: list[dict]) -> tuple[dict, dict]:
    """Each arm's speedups over the runs, their median and largest distance from it; then the
    same by every candidate estimator."""
    stability, estimator_stability = {}, {}
    print("speedup per run, and the largest distance from the arm's median over the runs:")
    for index, row in enumerate(tables[0]):  # the arms, in the same order in every run
        speedups = [table[index]["speedup"] for table in tables]
        median, worst = largest_deviation_pct(speedups)
        stability[row["arm"]] = {"speedups": speedups, "median": median, "largest_deviation_pct": worst}
        print(
            f"  {row['arm']:20s} {' '.join(f'{s:.3f}' for s in speedups)}   within {worst:.1f}% of {median:.3f}"
        )
    print("the same runs by every candidate estimator: median speedup, and largest distance from it:")
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
    return stability, estimator_stability


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1, help="run the preset this many times (stability)")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument(
        "--start",
        choices=["template", "spawn", "late", "both", "prewarm"],
        default="template",
        help="how the preset's processes start: forked from the template the command starts first "
        "(template), or the run starts later (late), or new interpreters (spawn); both alternates "
        "template and spawn, prewarm template and late, run by run",
    )
    parser.add_argument(
        "--plan",
        type=parse_plan,
        action="append",
        metavar="BLOCKSxSTEPS",
        help="blocks and timed steps per block instead of the preset's (repeat to alternate plans, run by run)",
    )
    parser.add_argument(
        "--threads", type=int, help="intra-op CPU threads in every measuring process (the preset's --threads)"
    )
    args = parser.parse_args()
    starts = {"both": ["template", "spawn"], "prewarm": ["template", "late"]}.get(args.start, [args.start])
    # Every combination of start and plan, alternated run by run so that the hour's noise
    # falls on all of them alike.
    conditions = [(start, plan) for start in starts for plan in (args.plan or [None])]

    def label(condition: tuple[str, tuple[int, int] | None]) -> str:
        start, plan = condition
        threads = f" --threads {args.threads}" if args.threads else ""
        how = (
            "--start template (the run starts the template, not the command)"
            if start == "late"
            else f"--start {start}"
        )
        return how + (f" --blocks {plan[0]} --steps {plan[1]}" if plan else "") + threads

    from workbench.environment import machine_summary

    walls, outside, tables, ran, by_estimator, probes, warnings = [], [], [], [], [], [], []
    for run in range(args.runs * len(conditions)):
        condition = conditions[run % len(conditions)]
        with tempfile.TemporaryDirectory() as folder:
            wall, results = run_once(Path(folder), *condition, threads=args.threads)
        walls.append(wall)
        # What the run spent outside its blocks' processes: start-up, the template, saving.
        outside.append(wall - sum(block.get("wall_s", 0.0) for block in results.record["blocks"]))
        ran.append(condition)
        tables.append(json.loads(results.table[COLUMNS].to_json(orient="records")))
        by_estimator.append(speedups_by_estimator(results))
        # The state of the machine's threads in each block (workbench.core_sync), and what the run warned.
        probes.append([block.get("core_sync_us", []) for block in results.record["blocks"]])
        warnings.append(results.warnings())
        typical = ", ".join(f"{statistics.median(p):.1f}" for p in probes[-1] if p)
        print(
            f"run {run + 1}/{args.runs * len(conditions)} ({label(condition)}): {wall:.1f} s; "
            + (f"fork-join probe per block {typical} us" if typical else "no fork-join probe (one thread)"),
            flush=True,
        )
    print(results.summary())
    stability: dict[str, dict] = {}
    for condition in conditions:
        these = [i for i, c in enumerate(ran) if c == condition]
        print(
            f"\nwall time of `workbench ablate --preset quick {label(condition)}` (start to exit): "
            f"{', '.join(f'{walls[i]:.1f}' for i in these)} s; median {statistics.median(walls[i] for i in these):.1f} s"
            f"; outside the blocks' processes: {', '.join(f'{outside[i]:.1f}' for i in these)} s, median "
            f"{statistics.median(outside[i] for i in these):.1f} s"
        )
        if len(these) > 1:
            speedups, estimators = stability_of([tables[i] for i in these], [by_estimator[i] for i in these])
            stability[label(condition)] = {"speedups": speedups, "by_estimator": estimators}
    if args.json:
        report = {
            "benchmark": "quick-preset",
            "runs": args.runs,
            "wall_s": walls,
            "outside_blocks_s": outside,
            "start": [start for start, _ in ran],
            "plan": [list(plan) if plan else None for _, plan in ran],
            "table": tables[-1],
            "tables": tables,
            "speedups_by_estimator": by_estimator,
            "threads": args.threads,
            "core_sync_us": probes,
            "warnings": warnings,
        }
        if len(conditions) == 1 and stability:  # one condition: the shape earlier records have
            (only,) = stability.values()
            report.update(stability=only["speedups"], stability_by_estimator=only["by_estimator"])
        else:
            report["stability_by_condition"] = stability
        Path(args.json).write_text(json.dumps(report | {"machine": machine_summary()}, indent=1))


if __name__ == "__main__":
    main()
