"""The tuner against the full grid, side by side in one run, on the quick preset's job.

Run:  python benchmarks/tune_vs_grid.py [--blocks 3] [--json FILE]

The search space is the quick preset's techniques with the settings the tuner varies (each
technique's ``tune_space``): amp in bfloat16 at level O1 (autocast) or O2 (a bfloat16 model
with float32 master weights), channels_last, checkpointing, and grad_accum over 2 or 4
micro-batches. amp's float16 is left out on a CPU: this machine has no float16 arithmetic,
so autocast to float16 is an emulation about ten times slower than float32 (a first run
measured it), which would stretch the grid to half an hour and teach nothing new. First the full grid over that space: every combination,
each technique off or at one of its values, each arm beside the baseline and its control in
every block, timed start to end. Its best arm is the fastest whose whole interval lies above 1
and whose final loss stays within 10% of the baseline's (``Results.best``). Then ``wb.tune`` on
the same job and the same space with a quarter of the grid's wall time as its budget.

The question (issue 17): is the tuner's pick as good as the grid's best? It is, here, when the
grid measured the tuner's pick within the grid best's noise band, that is when the two
intervals that the grid itself measured overlap. Both come from the same grid run, so they are
compared inside one set of processes; the tuner's own figures are reported beside them.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

# What the tuner varies for each of the quick preset's techniques (their tune_space).
SEARCH_SPACE = {
    "amp": {"dtype": "bfloat16", "level": ["O1", "O2"]},
    "channels_last": True,
    "checkpointing": True,
    "grad_accum": {"steps": [2, 4]},
}


def arm_with(results, techniques: dict) -> dict | None:
    """The grid's row for the arm that switches on exactly ``techniques``, with these settings."""
    settings = {arm["name"]: arm["settings"] for arm in results.record["arms"] if arm["role"] == "treatment"}
    table = results.table.set_index("arm")
    for name, switched in settings.items():
        if switched == techniques:
            row = table.loc[name]
            return {
                "arm": name,
                **{k: float(row[k]) for k in ("speedup", "speedup_low", "speedup_high", "loss_vs_baseline")},
            }
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=3, help="blocks of the grid (the preset's: 3)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    from record import table_rows, write_record

    import workbench as wb
    from workbench.cli import PRESETS

    job = dict(PRESETS["quick"])
    job.pop("techniques")
    job.pop("mode")
    techniques = SEARCH_SPACE
    job["blocks"] = args.blocks
    with tempfile.TemporaryDirectory() as folder:
        started = time.perf_counter()
        grid = wb.ablate(**job, techniques=techniques, mode="grid", out=Path(folder) / "grid", progress=True)
        grid_s = time.perf_counter() - started
        budget_s = grid_s / 4
        print(
            f"\nthe grid: {len(grid.table) - 2} combinations x {args.blocks} blocks in {grid_s:.0f} s",
            flush=True,
        )
        print(f"the tuner: a budget of {budget_s:.0f} s (a quarter of that)\n", flush=True)
        search_job = {k: v for k, v in job.items() if k != "blocks"}
        started = time.perf_counter()
        search = wb.tune(
            **search_job, techniques=techniques, budget_s=budget_s, out=Path(folder) / "tune", progress=True
        )
        tune_s = time.perf_counter() - started

    grid_best = grid.best
    tune_best = search.best
    fastest = search.record["tune"]["fastest"]
    tune_pick = tune_best or (fastest["techniques"] if fastest else {})
    grid_best_row = arm_with(grid, grid_best) if grid_best else None
    grid_on_tune_pick = arm_with(grid, tune_pick) if tune_pick else None
    within = None
    if grid_best_row and grid_on_tune_pick:
        within = grid_on_tune_pick["speedup_high"] >= grid_best_row["speedup_low"]

    print(
        grid.table[["arm", "speedup", "speedup_low", "speedup_high", "loss_vs_baseline"]]
        .round(3)
        .to_string(index=False)
    )
    print()
    print(search.tuning.drop(columns=["techniques"]).round(3).to_string(index=False))
    print()
    print(f"grid ({grid_s:.0f} s): best {grid_best_row}")
    print(f"tuner ({tune_s:.0f} s of a {budget_s:.0f} s budget): {search.tuning_verdict}")
    print(f"the grid's figures for the tuner's pick: {grid_on_tune_pick}")
    if within is None:
        print("no verdict: the grid or the tuner found nothing measurably faster")
    else:
        print(f"the tuner's pick is {'within' if within else 'OUTSIDE'} the grid best's noise band")
    if args.json:
        columns = ["arm", "speedup", "speedup_low", "speedup_high", "loss_vs_baseline"]
        tune = {
            k: search.record["tune"][k]
            for k in ("best", "fastest", "runner_up", "rounds", "spent_s", "stopped")
        }
        write_record(args.json, "tune-vs-grid", job={**job, "techniques": techniques}, grid_s=grid_s,
                     tune_budget_s=budget_s, tune_s=tune_s, grid_table=table_rows(grid, columns),
                     grid_best=grid_best_row, tune=tune, grid_on_tune_pick=grid_on_tune_pick,
                     within_noise_band=within)  # fmt: skip
    sys.exit(0 if within in (True, None) else 1)


if __name__ == "__main__":
    main()
