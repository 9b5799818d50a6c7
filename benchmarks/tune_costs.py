"""The tuner's cost estimates against the time its rounds took, per way of running blocks.

Run:  python benchmarks/tune_costs.py [--budget 90] [--modes shared isolate slurm] [--json FILE]
      (slurm needs a cluster: bash .ci/slurm start && export SLURM_CONF=/tmp/workbench-slurm/slurm.conf)

``wb.tune`` plans each round from what it has measured so far (``tuner.Costs``): the
calibration's single block first, then each finished round's processes and arms. A round it
plans too long runs into the budget's deadline and loses blocks; one it plans too short leaves
budget unspent. This runs one search per mode on the quick preset's job (resnet-mini on
textures, batch 32, 20 timed steps after 3 warm-up steps) over a small space (channels_last,
checkpointing, grad_accum over 2 micro-batches; amp is left out because on a CPU without
bfloat16 instructions its emulated arm would take most of the budget) and compares, for every round, the estimate it announced
(``tune_round`` events) with the wall time until the next round was announced, or the
search returned. The modes:

* ``shared``: the default, every arm of a block in one process;
* ``isolate``: ``isolate=True``, every arm in a process of its own beside its own baseline, so
  a block is as many processes as arms (the per-process cost the calibration cannot see);
* ``slurm``: ``executor="slurm"``, every block a job (its queueing and start are per block).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from record import write_record

JOB = {"steps": 20, "warmup": 3, "batch_size": 32, "device": "cpu"}
SPACE = {"channels_last": True, "checkpointing": True, "grad_accum": {"steps": 2}}
MODES = {"shared": {}, "isolate": {"isolate": True}, "slurm": {"executor": "slurm"}}


def search(mode: str, budget_s: float, folder: Path) -> dict:
    import workbench as wb

    announced: list[tuple[float, dict]] = []

    def on_event(event: dict) -> None:
        if event["type"] == "tune_round":
            announced.append((time.perf_counter(), event))

    started = time.perf_counter()
    results = wb.tune("resnet-mini", "textures", budget_s=budget_s, techniques=SPACE, out=folder / mode,
                      progress=False, on_event=on_event, **JOB, **MODES[mode])  # fmt: skip
    ended = time.perf_counter()
    rounds = []
    for i, (at, event) in enumerate(announced):
        until = announced[i + 1][0] if i + 1 < len(announced) else ended
        rounds.append({
            "round": event["round"],
            "candidates": len(event["candidates"]),
            "blocks": event["blocks"],
            "estimate_s": round(event["estimate_s"], 2),
            "took_s": round(until - at, 2),
            "left_s": round(event["left_s"], 2),
        })  # fmt: skip
    calibration = results.record["tune"].get("calibration", {})
    return {
        "mode": mode,
        "budget_s": budget_s,
        "wall_s": round(ended - started, 2),
        "calibration_s": round(calibration.get("wall_s", float("nan")), 2),
        "rounds": rounds,
        "best": results.best,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=90.0, help="each search's budget_s")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    if "slurm" in args.modes and not (os.environ.get("SLURM_CONF") and shutil.which("sbatch")):
        sys.exit(
            "slurm mode needs a cluster: bash .ci/slurm start && export SLURM_CONF=/tmp/workbench-slurm/slurm.conf"
        )

    searches = []
    with tempfile.TemporaryDirectory(prefix="tune-costs-") as scratch:
        for mode in args.modes:
            print(f"{mode}: searching with a budget of {args.budget:g} s ...", flush=True)
            figures = search(mode, args.budget, Path(scratch))
            searches.append(figures)
            print(
                f"  wall {figures['wall_s']:.1f} s (calibration {figures['calibration_s']:.1f} s), best {figures['best']}"
            )
            for r in figures["rounds"]:
                error = (
                    (r["took_s"] - r["estimate_s"]) / r["estimate_s"] * 100
                    if r["estimate_s"]
                    else float("nan")
                )
                print(f"  round {r['round']}: {r['candidates']} candidates x {r['blocks']} blocks, "
                      f"estimated {r['estimate_s']:.1f} s, took {r['took_s']:.1f} s ({error:+.0f}%), "
                      f"{r['left_s']:.1f} s were left")  # fmt: skip
    if args.json:
        write_record(args.json, "tune_costs", job=JOB, space=SPACE, searches=searches)


if __name__ == "__main__":
    main()
